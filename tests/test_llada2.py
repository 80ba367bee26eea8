"""LLaDA2.x (`model_type` "llada2_moe", the BailingMoeV2 stack) against its reference: the golden data of
tests/golden/llada2/, made by scripts/llada2-golden.py running LLaDA2's own remote code
(`LLaDA2MoeModelLM` and its `generate`) on a tiny random checkpoint in its layout, which clover loads
here. Full-sequence logits, the logits of every denoising forward, and greedy block decoding (prompts
ending inside and at the end of a block, blocks 4 and 8, one step a position and the quota of 2 at
8 positions in 4 steps, alone and batched): identical tokens and denoising forwards per block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clover.config import BlockSemantics
from test_sdar import TOL, _generate, load_golden

GOLDEN = Path(__file__).parent / "golden" / "llada2"
CASES = json.loads((GOLDEN / "cases.json").read_text())
TENSORS = load_file(str(GOLDEN / "golden.safetensors"))


@pytest.fixture(scope="module")
def llada2(tmp_path_factory):
    return load_golden(tmp_path_factory, GOLDEN)


def _quota(case) -> dict:
    """The reference's quota: block // steps a step; the default (steps = block) is one a step."""
    return {} if case["steps"] == case["block_length"] else dict(fallback="quota", steps=case["steps"])


def test_reads_the_llada2_layout_with_its_authors_defaults(llada2):
    c = llada2.config
    assert type(c).__name__ == "LLaDA2Config" and c.model_type == "llada2_moe"
    assert (c.block_size, c.mask_token_id, c.threshold) == (32, 127, 0.95)
    assert c.semantics == BlockSemantics(logit_shift=0, block_grid="absolute", commit_attention="block")
    assert llada2.default_mode == "diffusion"
    layers = llada2.model.model.layers
    assert type(layers[0].mlp).__name__ == "LLaDA2DenseMLP" and type(layers[1].mlp).__name__ == "LLaDA2MoE"


@pytest.mark.parametrize("block", [4, 8])
def test_full_sequence_logits(llada2, block):
    """float32 within 1e-5 of the reference's. (Its router and expert combination run in float32
    whatever the model's dtype, so a float64 run is no tighter check here.)"""
    ids = torch.tensor([CASES["full_sequence"]])
    m = llada2.model
    with torch.no_grad():
        out = m.step(m.make_cache(1, ids.shape[1]), commit_ids=ids, all_logits=True, commit_block=block)
    torch.testing.assert_close(out.commit_logits[0], TENSORS[f"full_b{block}"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", [c["name"] for c in CASES["cases"] if "forwards" in c])
def test_cached_step_logits(llada2, name):
    """The reference recomputes its whole window every step; clover's cached steps (a finished block
    committed with the next block's first step) give the same logits for the block."""
    case = next(c for c in CASES["cases"] if c["name"] == name)
    B = case["block_length"]
    seq = case["prompt"] + case["tokens"]  # every block before the last lies inside it
    m = llada2.model
    cache, committed = m.make_cache(1, 64), 0
    with torch.no_grad():
        for j, fwd in enumerate(case["forwards"]):
            start = fwd["end"] - B
            commit = torch.tensor([seq[committed:start]]) if start > committed else None
            committed = start
            out = m.step(cache, commit_ids=commit, denoise_ids=torch.tensor([fwd["ids"]]), commit_block=B)
            torch.testing.assert_close(out.denoise_logits[0], TENSORS[f"step_{name}_{j}"], **TOL)


@pytest.mark.parametrize("name", [c["name"] for c in CASES["cases"]])
def test_greedy_block_decoding_alone(llada2, name):
    case = next(c for c in CASES["cases"] if c["name"] == name)
    (g,) = _generate(llada2, [case], **_quota(case))
    assert g.token_ids == case["tokens"]
    assert g.stats.block_steps == case["denoise_forwards_per_block"]


@pytest.mark.parametrize("schedule", ["b4_s4", "b8_s8", "b8_s4"])
def test_greedy_block_decoding_batched(llada2, schedule):
    cases = [c for c in CASES["cases"] if c["name"].endswith(schedule)]
    for g, c in zip(_generate(llada2, cases, **_quota(cases[0])), cases):
        assert g.token_ids == c["tokens"] and g.stats.block_steps == c["denoise_forwards_per_block"], c["name"]
