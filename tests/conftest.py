import os

import pytest
import torch

torch.set_num_threads(1)  # tiny models: threads only add overhead, and CI shares 2 cores
# and a command run in-process keeps it (`clover.cli.common.default_threads` reads this), as do subprocesses
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("CLOVER_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: opt in with --runslow or CLOVER_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def session_caches(tmp_path_factory):
    """The few-row kernel (`clover.kernels.rows`) is built at most once per session, and the forward
    costs `block_size="auto"` measures (speculative's default) are kept, in tmp caches, not the user's."""
    old = {k: os.environ.get(k) for k in ("CLOVER_KERNELS", "CLOVER_COST")}
    for k in old:
        os.environ[k] = str(tmp_path_factory.mktemp(k.lower()))
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Clover checkpoint (byte tokenizer), shared by the session."""
    from clover.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    import clover

    return clover.load(tiny_dir)


@pytest.fixture(scope="session")
def bundled_f32(tmp_path_factory):
    """The bundled model exported as an f32 GGUF (main file + clover sidecar), shared by the session."""
    from pathlib import Path

    from clover.export.gguf import export_gguf

    bundled = Path(__file__).resolve().parents[1] / "src" / "clover" / "assets" / "clover-tiny"
    out = tmp_path_factory.mktemp("gguf") / "clover-tiny-f32.gguf"
    export_gguf(bundled, out, dtype="f32", progress=False)
    return out


@pytest.fixture
def alternating_policy():
    """A draft "auto" policy class (`width.DraftPolicy(widths, curve)`) that switches the width every
    forward: its widths from the largest down, round and round."""
    from clover.decoding import width as W

    class Alternating(W.DraftPolicy):
        calls = 0

        def choose(self, rows):
            self.calls += 1
            w = self.widths[-1 - (self.calls - 1) % len(self.widths)]
            return W.WidthChoice(w, len(rows), {w: 1.0})

    return Alternating
