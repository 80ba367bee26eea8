"""Checkpoints by Hugging Face repo id (clover.hub), offline on a hub cache this test lays out the
way huggingface_hub does (models--ORG--NAME/snapshots/<rev>/..., refs/main): `--model ORG/NAME`,
`clover.load`, `clover info`; the one-line refusals (not cached offline, unknown family, a model
that does not fit — before any weight is downloaded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import clover
from clover import cli, hub
from clover.api import model_path
from clover.tiny import build_tiny_checkpoint

REV = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "tiny-org/tiny-model"
GOLDEN_SDAR = Path(__file__).parent / "golden" / "sdar" / "checkpoint"


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
    """A hub cache holding REPO_ID (a tiny checkpoint), offline."""
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # REPO_ID is no local path here
    return lay_out(cache, REPO_ID, build_tiny_checkpoint(tmp_path / "src"))


def lay_out(cache, repo_id: str, src) -> Path:
    """`src`'s files as huggingface_hub's cache holds a download of `repo_id` at main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(src, repo / "snapshots" / REV)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return repo / "snapshots" / REV


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_repo_id_resolves_offline_from_the_hub_cache(hub_cache, capsys):
    assert hub.is_repo_id(REPO_ID) and not hub.is_repo_id("/abs/dir") and not hub.is_repo_id("a/b/c")
    assert model_path(REPO_ID) == hub_cache
    rc, out, err = run(capsys, "generate", "hello", "--model", REPO_ID, "--max-new-tokens", "8", "--mode", "ar", "--json")
    assert rc == 0, err
    assert len(json.loads(out)["token_ids"]) > 0
    llm = clover.load(REPO_ID)
    assert llm.path == hub_cache


def test_info_names_the_family_and_its_decoding_defaults(hub_cache, capsys):
    lay_out(hub_cache.parents[2], "JetLM/SDAR-tiny", GOLDEN_SDAR)
    rc, out, err = run(capsys, "info", "JetLM/SDAR-tiny")
    assert rc == 0, err
    assert "(sdar)" in out and "block_grid=absolute" in out
    assert [ln.split()[-1] for ln in out.splitlines() if ln.startswith(("block size", "threshold"))] == ["4", "0.9"]


def test_generate_decodes_a_released_family_from_the_cache_as_its_reference(hub_cache, capsys):
    """The golden SDAR checkpoint as repo JetLM/SDAR-tiny: `clover generate --model` decodes with its
    authors' defaults (block 4, threshold 0.9, no shift) and gives the reference's greedy tokens."""
    from test_sdar import CASES, _word_tokenizer

    snap = lay_out(hub_cache.parents[2], "JetLM/SDAR-tiny", GOLDEN_SDAR)
    _word_tokenizer(snap, 128)
    case = next(c for c in CASES["cases"] if c["block_length"] == 4)
    prompt = " ".join(f"t{i}" for i in case["prompt"])
    rc, out, err = run(capsys, "generate", prompt, "--model", "JetLM/SDAR-tiny", "--raw", "--ignore-eos", "-t", "0",
                       "-n", len(case["tokens"]), "--json")
    assert rc == 0, err
    assert json.loads(out)["token_ids"] == case["tokens"]


def test_a_local_path_wins_over_a_repo_id(hub_cache, tmp_path):
    local = tmp_path / REPO_ID
    shutil.copytree(hub_cache, local)
    assert model_path(REPO_ID).resolve() == local.resolve()


def test_missing_repo_offline_is_one_line_naming_pull(hub_cache, capsys):
    rc, out, err = run(capsys, "generate", "hello", "--model", "tiny-org/absent", "--max-new-tokens", "4")
    assert rc != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "clover pull tiny-org/absent" in lines[0], err
    with pytest.raises(hub.HubError, match="HF_HUB_OFFLINE"):
        hub.pull("tiny-org/absent")


def test_fit_check_refuses_before_any_download(hub_cache, monkeypatch):
    config = hub.family_config(json.loads((hub_cache / "config.json").read_text()), "c")
    fit = hub.estimate(config, context=1024, free=10 << 30)
    assert fit.fits and fit.weight_bytes > 0 and fit.cache_bytes > 0
    small = hub.estimate(config, context=1024, free=fit.need - 1)
    assert not small.fits and "GiB" in small.line(REPO_ID)
    # pull: the file list and config.json come from the hub, the weights never do
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    calls = []

    class Sibling:
        def __init__(self, name, size):
            self.rfilename, self.size = name, size

    class Info:
        sha = REV
        siblings = [Sibling("config.json", 100), Sibling("model.safetensors", 70 << 30), Sibling("pytorch_model.bin", 1)]

    class Api:
        def model_info(self, repo_id, files_metadata=False):
            calls.append("model_info")
            return Info()

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, f, **kw: calls.append(f) or str(hub_cache / f))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: calls.append(kw) or pytest.fail("downloaded"))
    monkeypatch.setattr(hub, "cached", lambda repo_id: None)
    with pytest.raises(hub.HubError, match="does not fit; nothing downloaded"):
        hub.pull("tiny-org/huge", free=8 << 30)
    assert calls == ["model_info", "config.json"]
    # an unknown model_type is refused in one line, before the weights
    other = hub_cache.parent / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, f, **kw: str(other / f))
    with pytest.raises(hub.HubError, match="model_type 'mamba' is not a family clover runs; families: .*sdar"):
        hub.pull("tiny-org/mamba", free=1 << 40)


def test_missing_repo_online_is_one_line(monkeypatch):
    from huggingface_hub.errors import RepositoryNotFoundError

    class Response:  # what the error reads of an HTTP response
        headers: dict = {}
        request = None

    class Api:
        def model_info(self, repo_id, files_metadata=False):
            raise RepositoryNotFoundError("404 Client Error", response=Response())

    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(hub, "cached", lambda repo_id: None)
    with pytest.raises(hub.HubError, match="no such model on the Hugging Face hub") as e:
        hub.pull("nobody/nothing")
    assert "\n" not in str(e.value)

    class Unreachable:
        def model_info(self, repo_id, files_metadata=False):
            raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "HfApi", Unreachable)
    with pytest.raises(hub.HubError, match="cannot reach the Hugging Face hub") as e:
        hub.pull("nobody/nothing")
    assert "\n" not in str(e.value)
