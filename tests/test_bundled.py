"""The bundled default model: present, within the size budget, loads with no argument, generates."""

import os
import subprocess
import sys

import pytest

from clover.api import BUNDLED_MODEL

pytestmark = pytest.mark.skipif(not (BUNDLED_MODEL / "config.json").exists(), reason="no bundled model in this checkout")


def test_size_budget():
    total = sum(p.stat().st_size for p in BUNDLED_MODEL.rglob("*") if p.is_file())
    assert total <= 25 * 1024 * 1024, f"bundled model is {total / 2**20:.1f} MiB"


def test_load_default_and_generate():
    import clover

    llm = clover.load()
    assert llm.config.is_clover and llm.config.mask_token_id is not None
    for mode in ("ar", "diffusion"):
        g = llm.generate("assert sorted([9, 2, 5]) == ", mode=mode, max_new_tokens=16, stop=["\n"])
        assert g.finish_reason in ("stop", "length") and g.stats.forwards >= 1


def test_cli_generate_on_bundled_model():
    for prompt in ("def fibonacci(n):", "assert sorted([9, 2, 5]) == "):
        # one thread, as the rest of the suite: two OpenMP threads on a core another job holds spin for ages
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-m", "clover", "generate", prompt, "--max-new-tokens", "24"],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr
        assert "tokens/forward" in out.stderr or "tokens/fwd" in out.stderr or out.stdout


@pytest.mark.slow
def test_bundled_modes_agree_on_heldout_prompts(tmp_path):
    """Opt-in (CLOVER_SLOW=1): on held-out prompts of both workloads, speculative == AR and
    naive == diffusion token for token on the bundled model."""
    import json

    from clover import cli

    out = tmp_path / "decode.json"
    assert cli.main(["bench", "decode", "--workload", "both", "--prompts", "4", "-n", "48", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    runs = res["runs"]
    for item in {r["item"] for r in runs}:
        by = {r["mode"]: r for r in runs if r["item"] == item}
        assert by["speculative"]["token_ids"] == by["ar"]["token_ids"]
        assert by["naive"]["token_ids"] == by["diffusion"]["token_ids"]
