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


def test_block_expert_sharing_routes_a_block_within_its_shared_experts(llada2):
    """Block expert sharing (`expert_budget`, opt-in) on LLaDA2's sigmoid router: a denoise token
    chooses its k among its block's `budget` best experts (ranked by the block's summed scores plus
    the bias), in place of its groups; the commit part routes as without it."""
    from clover.models.bailing_moe_v2 import LLaDA2MoE
    from clover.moe import BlockSharing

    router = next(layer.mlp.gate for layer in llada2.model.model.layers if isinstance(layer.mlp, LLaDA2MoE))
    E, k = router.weight.shape[0], router.top_k
    rows, Tc, Bd, m = 2, 3, 4, k + 1
    x = torch.randn(rows * (Tc + Bd), router.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        w0, i0, logits = router(x)
        w, i, _ = router(x, BlockSharing(m, rows, Tc))
        routing = (torch.sigmoid(logits) + router.expert_bias).view(rows, Tc + Bd, E)
    i, i0 = i.view(rows, Tc + Bd, k), i0.view(rows, Tc + Bd, k)
    assert torch.equal(i[:, :Tc], i0[:, :Tc]) and torch.equal(w.view(rows, -1, k)[:, :Tc], w0.view(rows, -1, k)[:, :Tc])
    for r in range(rows):
        shared = set(routing[r, Tc:].sum(0).topk(m).indices.tolist())
        assert set(i[r, Tc:].flatten().tolist()) <= shared
        for t in range(Tc, Tc + Bd):  # the token's own k best of the shared set
            best = sorted(shared, key=lambda e: -float(routing[r, t, e]))[:k]
            assert sorted(i[r, t].tolist()) == sorted(best)
    torch.testing.assert_close(w.sum(-1), torch.full((len(x),), router.scale))
    assert router(x, BlockSharing(E, rows, Tc))[1].equal(i0.view(-1, k))  # a budget of every expert: exact


def test_block_expert_sharing_decodes_alone_as_batched(llada2):
    """`expert_budget` through generate: a budget of every expert gives the reference's tokens; a
    smaller one decodes alone as in a batch."""
    cases = [c for c in CASES["cases"] if c["name"].endswith("b8_s8")]
    E = llada2.config.num_experts
    for g, c in zip(_generate(llada2, cases, expert_budget=E), cases):
        assert g.token_ids == c["tokens"], c["name"]
    budget = llada2.config.num_experts_per_tok + 1
    alone = [_generate(llada2, [c], expert_budget=budget)[0] for c in cases]
    batched = _generate(llada2, cases, expert_budget=budget)
    for a, b in zip(alone, batched):
        assert a.token_ids == b.token_ids and len(a.token_ids) == len(cases[0]["tokens"])


def test_live_forward_equals_the_full_forward(llada2):
    """Eagerly LLaDA2's layers compute only what a forward needs (`core.Live`: no batch padding, the
    last layer only where logits are read, each position only its part of the fused projection):
    every output the step returns or writes equals the full forward's (the cache up to each row's
    length: past it, the full forward's batch padding)."""
    model, mask = llada2.model, llada2.config.mask_token_id

    def steps(live: bool):
        saved, model.live_positions = model.live_positions, live
        try:
            g = torch.Generator().manual_seed(5)
            blk = torch.full((2, 8), mask)
            blk[0, :3], blk[1, 5] = torch.tensor([50, 60, 70]), 99
            need = blk == mask
            with torch.inference_mode():
                cache = model.make_cache(2, 64)
                model.step(cache, commit_ids=torch.randint(3, 120, (2, 8), generator=g), n_commit=torch.tensor([8, 5]),
                           commit_block=8)
                out = model.step(cache, commit_ids=torch.randint(3, 120, (2, 8), generator=g),
                                 n_commit=torch.tensor([8, 3]), denoise_ids=blk, denoise_need=need, commit_block=8)
            return out, need, cache
        finally:
            model.live_positions = saved

    (full, need, full_cache), (live, _, live_cache) = steps(False), steps(True)
    torch.testing.assert_close(live.commit_logits, full.commit_logits, **TOL)
    torch.testing.assert_close(live.denoise_logits[need], full.denoise_logits[need], **TOL)
    for a, b in zip(live_cache.layers, full_cache.layers):
        for x, y in zip(a.tensors(), b.tensors()):  # [B, H_kv, capacity, D]; rows of 16 and 8 tokens
            for row, n in enumerate((16, 8)):
                torch.testing.assert_close(x[row, :, :n], y[row, :, :n], **TOL)


def test_golden_with_the_experts_through_the_row_kernel(llada2, monkeypatch):
    """Routed experts through the row kernel (`kernels.packed.rows_take`, here at every expert size and
    up to its slot bound, prompts included): the reference's logits and tokens, alone and batched.
    Every cached step within `TOL` as on torch's grouped matmul; the full sequence within `TOL` too
    (its sums in another order: 1.1e-5 at 4 of 1792 logits of ~8, where the grouped path is within 1e-5)."""
    from clover.kernels import packed, rows

    if rows.library() is None:
        pytest.skip("no C compiler here: the row kernel is not built")
    monkeypatch.setattr(packed, "ROW_EXPERT_BYTES", 0)
    calls = []
    real = packed.rows_experts
    monkeypatch.setattr(packed, "rows_experts", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    ids, m = torch.tensor([CASES["full_sequence"]]), llada2.model
    for block in (4, 8):
        with torch.no_grad():
            out = m.step(m.make_cache(1, ids.shape[1]), commit_ids=ids, all_logits=True, commit_block=block)
        torch.testing.assert_close(out.commit_logits[0], TENSORS[f"full_b{block}"], **TOL)
    for case in CASES["cases"]:
        if "forwards" in case:
            test_cached_step_logits(llada2, case["name"])
        test_greedy_block_decoding_alone(llada2, case["name"])
    for schedule in ("b4_s4", "b8_s8", "b8_s4"):
        test_greedy_block_decoding_batched(llada2, schedule)
    assert calls and max(calls) > rows.MAX_ROWS  # every forward's experts, beyond the packed bound of 16 tokens
