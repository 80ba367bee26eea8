"""Fast-dLLM v2 (`model_type` "Fast_dLLM_Qwen", the Qwen2.5 stack) against its reference: the golden data
of tests/golden/fastdllm2/, made by scripts/fastdllm2-golden.py running the checkpoints' own remote code
(`Fast_dLLM_QwenForCausalLM` and its `generate`) on a tiny random checkpoint in their layout, which
clover loads here. Full-sequence logits (the block-causal prefill), the logits of every forward of a
generation (denoising steps and commits), and greedy block decoding (prompts ending inside and at the
end of a block, blocks 32 in sub-blocks of 8 and 8 in sub-blocks of 4, two of them ending at a stop
token, alone and batched): identical tokens and forwards per block."""

from __future__ import annotations

import copy
import os
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import clover
from clover.config import BlockSemantics
from clover.models import config_from_dict
from test_sdar import _generate, load_golden

GOLDEN = Path(__file__).parent / "golden" / "fastdllm2"
CASES = json.loads((GOLDEN / "cases.json").read_text())
TENSORS = load_file(str(GOLDEN / "golden.safetensors"))
# float32 against the reference's float32 (its own float32 lies 9e-6 from its float64 on these logits,
# which reach 18); float64 agrees to 1e-10
TOL = dict(atol=1e-5, rtol=0)
SEMANTICS = BlockSemantics(logit_shift=1, block_grid="absolute", commit_attention="block", first_token="commit_argmax")


@pytest.fixture(scope="module")
def fdllm(tmp_path_factory):
    return load_golden(tmp_path_factory, GOLDEN)


def _expected(case) -> list[int]:
    """The reference's tokens as clover reports them: a stop token ends the output without being part of it."""
    toks = case["tokens"]
    return toks[:-1] if toks[-1] == CASES["eos_token_id"] else toks


def _fused(case) -> int:
    """1 where clover runs the reference's prefill with the first denoising step in one forward (the
    prompt's tail opens the first block, so nothing of that step waits for the prefill's logits)."""
    n, b = len(case["prompt"]), case["block_length"]
    return int(n > b and n % b != 0)


def test_reads_the_fastdllm2_layout_with_its_authors_defaults(fdllm):
    c = fdllm.config
    assert type(c).__name__ == "Qwen2Config" and c.model_type == "Fast_dLLM_Qwen"
    assert (c.block_size, c.sub_block, c.mask_token_id, c.threshold, c.policy) == (32, 8, 127, 0.9, "threshold")
    assert c.semantics == SEMANTICS and fdllm.default_mode == "diffusion"
    raw = c.to_dict()  # written back as its own keys
    assert raw["architectures"] == ["Fast_dLLM_QwenForCausalLM"] and raw["bd_size"] == 32 and "block_size" not in raw
    assert raw["rope_theta"] == 1e6 and raw["rope_scaling"] is None and "rope_parameters" not in raw
    assert config_from_dict(json.loads(json.dumps(raw))) == c
    real = json.loads((GOLDEN / "checkpoint" / "config.json").read_text())
    del real["mask_token_id"]  # the real config.json names no mask: the tokenizer's "|<MASK>|", 151665
    real.update(vocab_size=151936)
    assert config_from_dict(real).mask_token_id == 151665


@pytest.mark.parametrize("block", [8, 32])
def test_full_sequence_logits(fdllm, block):
    """The prompt prefill: one commit of the whole sequence, block-causal on the absolute grid."""
    ids = torch.tensor([CASES["full_sequence"]])
    m = fdllm.model
    with torch.no_grad():
        out = m.step(m.make_cache(1, ids.shape[1]), commit_ids=ids, all_logits=True, commit_block=block)
        torch.testing.assert_close(out.commit_logits[0], TENSORS[f"full_b{block}"], **TOL)
        m64 = copy.deepcopy(m).double()
        out = m64.step(m64.make_cache(1, ids.shape[1]), commit_ids=ids, all_logits=True, commit_block=block)
    torch.testing.assert_close(out.commit_logits[0], TENSORS[f"full64_b{block}"], atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", [c["name"] for c in CASES["cases"] if "replay" in c])
def test_cached_step_logits(fdllm, name):
    """Every forward of the reference's generation replayed through the cache: a commit's last position
    (the next block's first token), each denoising step's rows that predict its sub-block."""
    case = next(c for c in CASES["cases"] if c["name"] == name)
    m, block = fdllm.model, case["block_length"]
    cache = m.make_cache(1, 128)
    with torch.no_grad():
        for j, fwd in enumerate(case["replay"]):
            ids = torch.tensor([fwd["ids"]])
            lo, hi = fwd["rows"]
            if fwd["commit"]:
                got = m.step(cache, commit_ids=ids, commit_block=block).commit_logits
            else:
                got = m.step(cache, denoise_ids=ids, commit_block=block).denoise_logits[:, lo:hi]
            torch.testing.assert_close(got[0].reshape(hi - lo, -1), TENSORS[f"step_{name}_{j}"], **TOL)


def _options(case) -> dict:
    return dict(sub_block=case["sub_block"]) if case["block_length"] != 32 else {}


@pytest.mark.parametrize("name", [c["name"] for c in CASES["cases"]])
def test_greedy_block_decoding_alone(fdllm, name):
    case = next(c for c in CASES["cases"] if c["name"] == name)
    (g,) = _generate(fdllm, [case], **_options(case))
    assert g.token_ids == _expected(case)
    assert g.stats.block_steps == case["denoise_forwards_per_block"]
    assert g.stats.forwards == case["forwards"] - _fused(case)


@pytest.mark.parametrize("block", [8, 32])
def test_greedy_block_decoding_batched(fdllm, block):
    """Every prompt of a block size in one batch (the reference's batch needs prompts of one length)."""
    cases = [c for c in CASES["cases"] if c["block_length"] == block]
    assert len(cases) >= 2
    for g, c in zip(_generate(fdllm, cases, **_options(cases[0])), cases):
        assert g.token_ids == _expected(c) and g.stats.block_steps == c["denoise_forwards_per_block"], c["name"]


@pytest.mark.parametrize("block", [8, 32])
def test_naive_recomputation_gives_the_same_tokens(fdllm, block):
    """mode="naive" rebuilds the committed sequence every forward (block-causal, the same grid)."""
    for c in CASES["cases"]:
        if c["block_length"] == block:
            g = fdllm.generate(c["prompt"], mode="naive", max_new_tokens=len(c["tokens"]), block_size=block, **_options(c))
            assert g.token_ids == _expected(c) and g.stats.block_steps == c["denoise_forwards_per_block"], c["name"]


def test_a_prompt_of_whole_blocks_opens_with_the_prefills_argmax(fdllm):
    """The first token after a prompt of whole blocks is the prefill's argmax at any temperature (the
    reference takes it so), and the denoising that follows sees it."""
    case = next(c for c in CASES["cases"] if len(c["prompt"]) % c["block_length"] == 0)
    g = fdllm.generate(case["prompt"], max_new_tokens=1, block_size=case["block_length"], temperature=1.5, seed=3)
    assert g.token_ids == case["tokens"][:1] and g.stats.forwards == 1 and g.stats.block_steps == [0]


def test_modes_that_need_a_causal_commit_are_refused_in_one_line(fdllm):
    """AR and self-speculation verify causally; Fast-dLLM v2 commits block-causally."""
    from test_sdar import assert_causal_modes_refused

    assert_causal_modes_refused(fdllm, r"^(commit_attention='block'|block_grid='absolute'): not implemented in \w+")


def test_info_names_the_family_and_its_decoding(fdllm, capsys):
    from clover.cli import main

    assert main(["info", str(fdllm.path)]) == 0
    out = capsys.readouterr().out
    for needle in ("(Fast_dLLM_Qwen)", "block size       32", "sub-block        8", "threshold        0.9",
                   "mask token       127", "block semantics  block_grid=absolute, commit_attention=block, "
                   "first_token=commit_argmax"):
        assert needle in out, needle


def test_the_checkpoints_by_name_decode_as_their_reference(tmp_path, monkeypatch, capsys):
    """The golden checkpoint as the 1.5B's repo id in an offline hub cache: `clover info` names the
    family and its defaults, and `clover generate --model` with no decoding option gives the
    reference's tokens (blocks of 32 in sub-blocks of 8, threshold 0.9)."""
    from clover import cli
    from test_hub import lay_out
    from test_sdar import _word_tokenizer

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    repo = "Efficient-Large-Model/Fast_dLLM_v2_1.5B"
    _word_tokenizer(lay_out(tmp_path / "hf", repo, GOLDEN / "checkpoint"), 128)
    assert cli.main(["info", repo]) == 0
    out = capsys.readouterr().out
    assert "(Fast_dLLM_Qwen)" in out and "first_token=commit_argmax" in out
    case = next(c for c in CASES["cases"] if c["block_length"] == 32 and c["tokens"][-1] != CASES["eos_token_id"])
    prompt = " ".join(f"t{i}" for i in case["prompt"])
    assert cli.main(["generate", prompt, "--model", repo, "--raw", "-n", str(len(case["tokens"])), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == case["tokens"]


def test_bench_peers_reference_row(tmp_path, monkeypatch):
    """`clover bench peers`' fastdllm2-reference row: skipped with why without the remote code; with it
    (opt-in: CLOVER_FASTDLLM2_REFERENCE, a directory holding modeling.py and configuration.py, and
    CLOVER_REFERENCE_PYTHON with transformers 4.53.1) its generate gives clover's tokens, alone and in turn."""
    from clover.bench.peers import run_peers
    from test_released_peers import PROMPTS, golden_dir

    name, env = "fastdllm2-reference", "CLOVER_FASTDLLM2_REFERENCE"
    have = os.environ.get(env) and os.environ.get("CLOVER_REFERENCE_PYTHON")
    if not have:
        monkeypatch.delenv(env, raising=False)
    # no EOS: the rows decode with no stop, which clover's ignore_eos does by taking EOS out of the
    # distribution and the reference's generate by never matching its stop token (its EOS keeps its probability)
    d = golden_dir("fastdllm2", tmp_path)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(raw | {"eos_token_id": None}))
    r = run_peers(d, prompt_texts=PROMPTS, max_new_tokens=40, threads=[1], batch=3, engines=["clover", name])
    e = r["engines"][name]
    if not have:
        assert not e["available"] and env in e["note"] and "--reference" in e["note"]
        pytest.skip(f"set {env} and CLOVER_REFERENCE_PYTHON to run the reference")
    assert e["available"], e
    rows = {(row["engine"], row["batch"]): row for row in r["rows"]}
    assert rows[(name, 1)]["matches_clover_mode"] == 1.0 and rows[(name, 1)]["compared_with"] == "diffusion"
    assert rows[(name, 3)]["clover_speedup"] is not None


def test_reference_batch_rows_compare_tokens_with_clovers_batch():
    """A reference's batch rows that keep their tokens (`many` -> tokens, seconds, each row's ids) are
    compared row by row with clover's batch of the same round; rows that keep none are not."""
    from clover.bench.peers import summarize

    def run(engine, variant, ids, compare=None, cpu=None):
        return {"engine": engine, "variant": variant, "threads": 1, "batch": 2, "item": 0, "tokens": 4, "seconds": 1.0,
                "tokens_per_second": 4.0, "token_ids": ids, "compare": compare, "cpu_seconds": cpu}

    rows = {(r["engine"], r["variant"]): r for r in summarize([
        run("clover", "diffusion", [[1, 2], [3, 4]]),
        run("fastdllm2-reference", "reference", [[1, 2], [3, 5]], "diffusion"),
        run("fastdllm2-reference", "reference-lockstep", [[1, 2], [3, 4]], "diffusion"),
        run("sdar-reference", "reference", None, "diffusion")])}
    assert rows[("fastdllm2-reference", "reference")]["matches_clover_mode"] == 0.5
    assert rows[("fastdllm2-reference", "reference-lockstep")]["matches_clover_mode"] == 1.0
    assert rows[("fastdllm2-reference", "reference-lockstep")]["clover_speedup"] == 1.0
    assert rows[("sdar-reference", "reference")]["matches_clover_mode"] is None
    assert rows[("fastdllm2-reference", "reference")]["clover_speedup_cpu"] is None  # clover's row has no CPU seconds


def test_reference_rows_give_the_ratio_in_cpu_seconds_too():
    """Where clover's runs and a reference's both report their CPU seconds, the row's ratio is also given in
    them (`clover_speedup_cpu`: another process on a shared core stretches wall time, not CPU time)."""
    from clover.bench.peers import skip_notes, summarize

    def run(engine, variant, seconds, cpu, compare=None):
        return {"engine": engine, "variant": variant, "threads": 1, "batch": 1, "item": 0, "tokens": 8,
                "seconds": seconds, "tokens_per_second": 8 / seconds, "token_ids": [1], "compare": compare,
                "cpu_seconds": cpu}

    rows = summarize([run("clover", "diffusion", 2.0, 1.0), run("fastdllm2-reference", "reference", 3.0, 2.0, "diffusion")])
    ref = next(r for r in rows if r["engine"] == "fastdllm2-reference")
    assert ref["clover_speedup"] == pytest.approx(1.5) and ref["clover_speedup_cpu"] == pytest.approx(2.0)
    notes = skip_notes({"engines": {}, "rows": rows, "settings": {}})
    assert "1.50x its tokens/s (2.00x in CPU seconds)" in notes


def test_reference_lockstep_batch_takes_one_prompt_length():
    """The reference's own batch (`decode_batch`) is one [B, L] tensor: prompts of other lengths are refused
    before its model is touched."""
    from clover.bench.peers.reference import _family

    ref = _family("fastdllm2_reference.py")
    with pytest.raises(ValueError, match="one length"):
        ref.decode_batch(None, [[1, 2, 3], [4, 5]], 8, block=32, steps=32, threshold=0.9, mask_id=127, sub_block=8)


def test_bench_peers_reference_lockstep(tmp_path, monkeypatch):
    """With prompts of one length the fastdllm2-reference row adds its own batch (variant
    `reference-lockstep`: its `generate` on the batch in one call, rows in lockstep) beside the batch in
    turn, on the same worker; both give clover's batched tokens, row by row (opt-in as
    `test_bench_peers_reference_row`)."""
    from clover.bench.peers import run_peers
    from test_released_peers import golden_dir

    name, env = "fastdllm2-reference", "CLOVER_FASTDLLM2_REFERENCE"
    if not (os.environ.get(env) and os.environ.get("CLOVER_REFERENCE_PYTHON")):
        pytest.skip(f"set {env} and CLOVER_REFERENCE_PYTHON to run the reference")
    d = golden_dir("fastdllm2", tmp_path)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(raw | {"eos_token_id": None}))
    prompts = ["t5 t17 t33 t60 t9 t8 t90", "t14 t3 t77 t51 t26 t119 t40", "t30 t7 t84 t66 t12 t2 t99"]
    r = run_peers(d, prompt_texts=prompts, max_new_tokens=40, threads=[1], batch=3, engines=["clover", name])
    assert "reference-lockstep" in r["engines"][name]["note"]
    rows = {(row["engine"], row["variant"], row["batch"]): row for row in r["rows"]}
    for variant in ("reference", "reference-lockstep"):
        row = rows[(name, variant, 3)]
        assert row["matches_clover_mode"] == 1.0 and row["clover_speedup"] is not None, row
        assert row["clover_speedup_cpu"] is not None  # clover and the worker both report CPU seconds
    assert (name, "reference-lockstep", 1) not in rows


def test_block_logits_fill_only_the_rows_a_step_reads():
    """The engine's shift of the denoise logits (position j predicted by position j-1, position 0 by the
    commit) moves only the rows a step reads when it names them, each equal to the whole shift's."""
    from types import SimpleNamespace

    from clover.decoding.diffusion import DiffusionEngine

    eng = SimpleNamespace(shift=1, block_size=6)
    dl = torch.randn(6, 11)
    for first in (None, torch.randn(11)):
        r = SimpleNamespace(state=SimpleNamespace(first_logits=first))
        whole = DiffusionEngine._block_logits(eng, r, dl)
        for rows in ([0, 1, 2], [3, 5], [0]):
            read = torch.zeros(6, dtype=torch.bool)
            read[rows] = True
            got = DiffusionEngine._block_logits(eng, r, dl, read)
            assert got.shape == whole.shape and torch.equal(got[read], whole[read])
