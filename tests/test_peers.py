"""`clover bench peers`: engine discovery and skips, the JSON schema, table, Markdown and plot on a
tiny random model with clover + transformers, the llama.cpp runners' parsing (fake binaries), and
llama.cpp itself when scripts/build-llama-cpp.sh has built it (skipped otherwise, saying why).
No timing decides a test."""

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from clover import cli
from clover.bench import peers
from clover.models.layers import is_clover_parameter
from clover.models import read_config

ROW_KEYS = {"engine", "variant", "threads", "batch", "samples", "tokens", "seconds", "tokens_per_second",
            "vs_clover_ar", "vs_clover_ar_paired_median", "matches_clover_ar", "matches_clover_mode"}


def _exe(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake_llama(tmp_path) -> Path:
    """A llama.cpp cache dir whose binaries print canned output in the real tools' formats."""
    d = tmp_path / "llama.cpp"
    _exe(d / "build" / "bin" / "llama-bench", "echo '[{\"n_gen\": 4, \"avg_ts\": 400.0, \"stddev_ts\": 1.0}]'\n")
    # greedy N: N copies of token 7 (reads the prompt ids from stdin like the real probe)
    _exe(d / "bin" / "clover-llama-probe", 'cat >/dev/null\ni=0; out=""\nwhile [ $i -lt "$3" ]; do out="$out 7"; i=$((i+1)); done\necho $out\n')
    (d / "bin" / "READY").write_text("llama-cpp-python==test\n")
    return d


# ------------------------------------------------------------------------------- discovery
def test_discover_skips_with_notes(tiny_dir, tmp_path):
    cfg = read_config(tiny_dir)
    found = peers.discover(cfg, llama_dir=tmp_path / "none")
    assert set(found) == set(peers.ENGINES)
    assert found["clover"]["available"]
    assert not found["llama.cpp"]["available"] and "build-llama-cpp.sh" in found["llama.cpp"]["note"]
    assert not found["vllm"]["available"] and "--vllm-python" in found["vllm"]["note"]

    found = peers.discover(cfg, dtype="bfloat16", vllm_python=str(tmp_path / "no-python"), llama_dir=tmp_path)
    assert not found["vllm"]["available"] and "no such interpreter" in found["vllm"]["note"]
    found = peers.discover(cfg, dtype="float32", vllm_python=sys.executable, llama_dir=tmp_path)
    assert not found["vllm"]["available"] and "bf16" in found["vllm"]["note"]
    # an interpreter without vLLM (this one): skipped with the import error
    found = peers.discover(cfg, dtype="bfloat16", vllm_python=sys.executable, engines=["clover", "vllm"], llama_dir=tmp_path)
    if not found["vllm"]["available"]:
        assert "not importable" in found["vllm"]["note"]
    assert found["transformers"]["note"].startswith("not asked for")

    with pytest.raises(ValueError, match="engines"):
        peers.discover(cfg, engines=["clover", "ollama"])
    with pytest.raises(ValueError, match="dtype"):
        peers.discover(cfg, dtype="int8")


def test_discover_llama_binaries(tiny_dir, fake_llama):
    found = peers.discover(read_config(tiny_dir), llama_dir=fake_llama)["llama.cpp"]
    assert found["available"] and found["version"] == "llama-cpp-python==test"
    assert set(found["binaries"]) == {"llama-bench", "probe"}
    assert "llama-batched-bench" in found["note"]  # batch 16 skipped, and how to build it


def test_discover_llama_clover(tiny_dir, fake_llama, tmp_path):
    cfg = read_config(tiny_dir)
    found = peers.discover(cfg, llama_dir=fake_llama)["llama-clover"]
    assert not found["available"] and "PORT=1 scripts/build-llama-cpp.sh" in found["note"]
    _exe(fake_llama / "bin" / "llama-clover", "exit 0\n")
    assert peers.discover(cfg, llama_dir=fake_llama)["llama-clover"]["available"]
    cfg.mask_token_id = None
    found = peers.discover(cfg, llama_dir=fake_llama)["llama-clover"]
    assert not found["available"] and "AR checkpoint" in found["note"]


def test_port_rows_compare_with_the_same_clover_mode():
    def run(engine, variant, item, ids):
        return {"engine": engine, "variant": variant, "threads": 1, "batch": 1, "item": item, "tokens": len(ids),
                "seconds": 1.0, "tokens_per_second": float(len(ids)), "token_ids": ids}

    runs = [run("clover", "ar", 0, [1, 2]), run("clover", "diffusion", 0, [1, 3]),
            run("clover", "ar", 1, [4, 5]), run("clover", "diffusion", 1, [4, 6]),
            run("llama-clover", "diffusion", 0, [1, 3]), run("llama-clover", "diffusion", 1, [4, 7])]
    rows = {(r["engine"], r["variant"]): r for r in peers.summarize(runs)}
    port = rows[("llama-clover", "diffusion")]
    assert port["matches_clover_mode"] == 0.5 and port["matches_clover_ar"] == 0.0
    assert rows[("clover", "diffusion")]["matches_clover_mode"] is None


def test_llama_env_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CLOVER_LLAMA_CPP_DIR", str(tmp_path))
    assert peers.llama_cpp_dir() == tmp_path
    monkeypatch.delenv("CLOVER_LLAMA_CPP_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert peers.llama_cpp_dir() == tmp_path / "clover" / "llama.cpp"


def test_hf_dir_drops_clover_tensors(tiny_dir, tmp_path):
    cfg = read_config(tiny_dir)
    d = peers.write_hf_dir(tiny_dir, tmp_path / "hf", cfg, dtype="bfloat16", copy=True)
    c = json.loads((d / "config.json").read_text())
    assert c["model_type"] == "qwen3_5_moe_text" and c["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert "mask_token_id" not in c and "block_size" not in c
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert str(f.get_tensor(keys[0]).dtype) == "torch.bfloat16"
    assert keys and not [k for k in keys if is_clover_parameter(k)]
    linked = peers.write_hf_dir(tiny_dir, tmp_path / "hf-linked", cfg, dtype="float32")
    assert (linked / "model.safetensors").is_symlink() and (linked / "tokenizer.json").is_file()


# ------------------------------------------------------------------------------ the result
def _check_schema(r: dict) -> None:
    assert r["schema"] == peers.SCHEMA
    for k in ("model", "config", "settings", "engines", "machine", "rows", "runs", "prompts", "max_rss_bytes"):
        assert k in r
    for row in r["rows"]:
        assert set(row) == ROW_KEYS
        assert set(row["tokens_per_second"]) >= {"median", "q1", "q3", "min", "max", "n", "aggregate"}
    json.dumps(r)  # JSON-ready


def test_clover_and_transformers(tiny_dir, tmp_path):
    r = peers.run_peers(tiny_dir, prompt_texts=["def f(x):", "assert 1 + 1 == "], max_new_tokens=4, threads=(1,),
                        batch=2, modes=["ar", "diffusion"], engines=["clover", "transformers"], workdir=tmp_path)
    _check_schema(r)
    got = {(x["engine"], x["variant"], x["batch"]) for x in r["rows"]}
    assert got == {("clover", "ar", 1), ("clover", "diffusion", 1), ("transformers", "generate", 1),
                   ("clover", "ar", 2), ("clover", "diffusion", 2)}
    for x in r["rows"]:
        assert x["tokens"] == 4 * (x["samples"] if x["batch"] == 1 else x["batch"])  # fixed length everywhere
    by = {(x["engine"], x["variant"], x["batch"]): x for x in r["rows"]}
    assert by[("clover", "ar", 1)]["vs_clover_ar"] == pytest.approx(1.0)
    assert by[("clover", "ar", 1)]["matches_clover_ar"] == 1.0
    # same weights, f32, greedy: transformers' tokens are clover AR's (a correctness check, not a timing)
    assert by[("transformers", "generate", 1)]["matches_clover_ar"] == 1.0
    assert by[("clover", "ar", 2)]["matches_clover_ar"] is None  # batch rows are compared by speed only
    assert r["engines"]["llama.cpp"]["note"] and not r["engines"]["vllm"]["available"]

    from rich.console import Console

    con = Console(width=200, record=True)
    con.print(peers.peers_table(r))
    text = con.export_text()
    assert "transformers" in text and "vllm: skipped" in text
    md = peers.peers_markdown(r)
    assert md.count("\n") == len(r["rows"]) + 1
    png = Path(peers.plot_peers(r, tmp_path / "peers.png"))
    assert png.is_file() and png.stat().st_size < 60_000


def test_compiled_variants(tiny_dir, tmp_path, monkeypatch):
    """compiled=True adds ar+static / diffusion+static rows, checked token for token against the
    eager mode (torch.compile replaced by the identity: the static graphs' code, not a compile)."""
    import clover.models.static as st

    monkeypatch.setattr(st.torch, "compile", lambda fn, **kw: fn)
    r = peers.run_peers(tiny_dir, prompt_texts=["def f(x):", "x = "], max_new_tokens=6, threads=(1,), batch=2,
                        modes=["ar", "diffusion", "speculative"], engines=["clover"], workdir=tmp_path, compiled=True)
    by = {(x["engine"], x["variant"], x["batch"]): x for x in r["rows"]}
    assert {v for _, v, _ in by} == {"ar", "diffusion", "speculative", "ar+static", "diffusion+static",
                                     "speculative+static"}
    assert by[("clover", "speculative+static", 1)]["matches_clover_mode"] == 1.0
    assert by[("clover", "ar+static", 1)]["matches_clover_mode"] == 1.0
    assert by[("clover", "diffusion+static", 1)]["matches_clover_mode"] == 1.0
    assert by[("clover", "ar+static", 2)]["tokens"] == 12
    assert "clover diffusion+static (1 thread): same tokens as clover diffusion on 100%" in peers.skip_notes(r)


def test_llama_runners_with_fake_binaries(tiny_dir, fake_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "gguf_file", lambda src, work, dtype: tmp_path / "fake.gguf")
    r = peers.run_peers(tiny_dir, prompt_texts=["x = "], max_new_tokens=4, threads=(1, 2), batch=2, modes=["ar"],
                        engines=["clover", "llama.cpp"], llama_dir=fake_llama, workdir=tmp_path)
    _check_schema(r)
    rows = {(x["variant"], x["threads"]): x for x in r["rows"] if x["engine"] == "llama.cpp"}
    assert set(rows) == {("llama-bench tg", 1), ("probe greedy", 1), ("llama-bench tg", 2), ("probe greedy", 2)}
    assert rows[("llama-bench tg", 1)]["tokens_per_second"]["median"] == pytest.approx(400.0)
    assert rows[("probe greedy", 1)]["tokens"] == 4
    assert rows[("probe greedy", 1)]["matches_clover_ar"] in (0.0, 1.0)


def test_broken_engine_is_dropped_with_a_note(tiny_dir, fake_llama, tmp_path, monkeypatch):
    _exe(fake_llama / "build" / "bin" / "llama-bench", "echo boom >&2; exit 3\n")
    monkeypatch.setattr(peers, "gguf_file", lambda src, work, dtype: tmp_path / "fake.gguf")
    r = peers.run_peers(tiny_dir, prompt_texts=["x = "], max_new_tokens=2, threads=(1,), batch=2, batch_rounds=0,
                        modes=["ar"], engines=["clover", "llama.cpp"], llama_dir=fake_llama, workdir=tmp_path)
    assert "llama-bench tg failed" in r["engines"]["llama.cpp"]["note"] and "boom" in r["engines"]["llama.cpp"]["note"]
    assert {x["variant"] for x in r["rows"]} == {"ar", "probe greedy"}


def test_cli(tiny_dir, tmp_path, capsys):
    rc = cli.main(["bench", "peers", "--model", str(tiny_dir), "--prompts", "1", "-n", "2", "--threads", "1",
                   "--batch", "2", "--modes", "ar", "--engines", "clover", "--plot", str(tmp_path / "p.png"), "--json", "-"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    _check_schema(r)
    assert r["settings"]["threads"] == [1] and (tmp_path / "p.png").is_file()
    assert cli.main(["bench", "peers", "--model", str(tiny_dir), "--engines", "clover,ollama"]) != 0
    assert "ollama" in capsys.readouterr().err


def test_cli_pack_reaches_clovers_load(tiny_dir, tmp_path, capsys, monkeypatch):
    """`--pack` is clover's eager weights (`clover.load`'s pack: auto None, on True, rows, off False); the
    result says what clover got."""
    import clover

    seen, real = [], clover.load
    monkeypatch.setattr(clover, "load", lambda *a, **k: seen.append(k.get("pack")) or real(*a, **k))
    for flag, want in (("off", False), ("rows", "rows")):
        assert cli.main(["bench", "peers", "--model", str(tiny_dir), "--prompts", "1", "-n", "2", "--threads", "1",
                         "--batch-rounds", "0", "--modes", "ar", "--engines", "clover", "--pack", flag,
                         "--plot", str(tmp_path / "p.png"), "--json", "-"]) == 0
        r = json.loads(capsys.readouterr().out)
        assert seen[-1] == want and "clover_packing" in r["settings"]
    assert r["settings"]["clover_packing"] in (None, "rows")  # the tiny model's matrices are below the packing floor

# ------------------------------------------------------------------ the real llama.cpp build
def test_real_llama_cpp(tiny_dir, tmp_path):
    found = peers.discover(read_config(tiny_dir))["llama.cpp"]
    if not found["available"]:
        print(f"llama.cpp part skipped: {found['note']}")
        pytest.skip(f"llama.cpp build absent: {found['note']}")
    r = peers.run_peers(tiny_dir, prompt_texts=["def f(x):"], max_new_tokens=4, threads=(1,), batch=2, modes=["ar"],
                        engines=["clover", "llama.cpp"], workdir=tmp_path)
    _check_schema(r)
    rows = {x["variant"]: x for x in r["rows"] if x["engine"] == "llama.cpp"}
    assert "llama-bench tg" in rows or "probe greedy" in rows, r["engines"]["llama.cpp"]
    if "probe greedy" in rows:  # f32 greedy through llama.cpp equals clover AR (docs/gguf.md)
        assert rows["probe greedy"]["matches_clover_ar"] == 1.0


def test_real_llama_clover(tiny_dir, tmp_path):
    """The port through `clover bench peers`: f32 on a tiny random checkpoint, its ar and diffusion
    tokens equal clover's in the same mode (tests/test_llama_port.py pins the port itself)."""
    found = peers.discover(read_config(tiny_dir))["llama-clover"]
    if not found["available"]:
        print(f"llama-clover part skipped: {found['note']}")
        pytest.skip(f"llama.cpp port absent: {found['note']}")
    r = peers.run_peers(tiny_dir, prompt_texts=["def f(x):", "x = "], max_new_tokens=8, threads=(1,), batch=2,
                        batch_rounds=0, modes=["ar", "diffusion"], engines=["clover", "llama-clover"], workdir=tmp_path)
    _check_schema(r)
    rows = {x["variant"]: x for x in r["rows"] if x["engine"] == "llama-clover"}
    assert set(rows) == {"ar", "diffusion"}, r["engines"]["llama-clover"]
    assert rows["ar"]["matches_clover_mode"] == 1.0 and rows["diffusion"]["matches_clover_mode"] == 1.0
    assert rows["ar"]["tokens"] == 16


def test_cli_writes_table_and_json_before_the_plot(tiny_dir, tmp_path, capsys, monkeypatch):
    """The JSON and the table come out first; without matplotlib the plot is one line, not a traceback."""
    def no_matplotlib(result, path):
        assert json.loads((tmp_path / "r.json").read_text())["rows"]  # already written
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr(peers, "plot_peers", no_matplotlib)
    rc = cli.main(["bench", "peers", "--model", str(tiny_dir), "--prompts", "1", "-n", "2", "--threads", "1",
                   "--batch", "2", "--batch-rounds", "0", "--modes", "ar", "--engines", "clover",
                   "--plot", str(tmp_path / "p.png"), "--json", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert rc == 0 and "clover" in out and "json written to" in out
    assert len([ln for ln in err.splitlines() if "plot skipped: matplotlib is not installed" in ln]) == 1
    assert "Traceback" not in err
