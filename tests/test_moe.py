"""MoE dispatch and block expert sharing."""

import pytest
import torch

from clover.models.layers import Experts
import clover.moe as moe
from clover.moe import BlockSharing, grouped_expert_forward, reference_expert_forward, route, static_expert_forward


def _experts(E=16, H=24, I=12, seed=0):
    ex = Experts(E, H, I)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.2)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.2)
    return ex


@pytest.mark.parametrize("N,k", [(1, 2), (5, 2), (33, 4), (64, 1)])
def test_grouped_dispatch_equals_reference(N, k):
    ex = _experts()
    g = torch.Generator().manual_seed(N)
    x = torch.randn(N, 24, generator=g)
    logits = torch.randn(N, 16, generator=g)
    w, idx = route(logits, k)
    with torch.no_grad():
        torch.testing.assert_close(grouped_expert_forward(ex, x, idx, w), reference_expert_forward(ex, x, idx, w), atol=1e-5, rtol=1e-5)
    assert torch.unique(idx).numel() < 16 or N * k >= 16  # some experts receive no token for small N


@pytest.mark.parametrize("N,k", [(1, 2), (5, 2), (33, 4), (64, 1)])
@pytest.mark.parametrize("path", ["gather", "grouped", "grouped-loop"])
def test_static_dispatch_equals_reference(N, k, path, monkeypatch):
    """The compiled steps' dispatch (no host read) on each of its paths: weights gathered per slot
    (small AR steps), torch's grouped matmul, and the per-expert loop used where torch lacks it."""
    ex = _experts()
    g = torch.Generator().manual_seed(N + k)
    x = torch.randn(N, 24, generator=g)
    w, idx = route(torch.randn(N, 16, generator=g), k)
    if path != "gather":
        monkeypatch.setattr(moe, "GATHER_BYTES", -1)
    if path == "grouped-loop":
        monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    with torch.no_grad():
        torch.testing.assert_close(static_expert_forward(ex, x, idx, w), reference_expert_forward(ex, x, idx, w),
                                   atol=1e-5, rtol=1e-5)


def test_route_is_softmax_topk_renormalised():
    logits = torch.randn(7, 10)
    w, idx = route(logits, 3)
    p = logits.softmax(-1)
    top = p.topk(3, -1)
    torch.testing.assert_close(idx, top.indices)
    torch.testing.assert_close(w, top.values / top.values.sum(-1, keepdim=True))


def test_block_sharing_limits_experts_and_is_identity_when_budget_covers_all():
    B, Tc, Bd, E, k = 2, 3, 8, 16, 2
    logits = torch.randn(B * (Tc + Bd), E)
    w0, i0 = route(logits, k)
    w1, i1 = route(logits, k, BlockSharing(budget=E, rows=B, denoise_from=Tc))  # budget == number of experts: sharing is a no-op
    torch.testing.assert_close(w0, w1)
    assert torch.equal(i0, i1)
    for m in (k, 3, 5):
        w, idx = route(logits, k, BlockSharing(budget=m, rows=B, denoise_from=Tc))
        idx = idx.view(B, Tc + Bd, k)
        assert torch.equal(idx[:, :Tc], i0.view(B, Tc + Bd, k)[:, :Tc])  # commit tokens route freely
        for b in range(B):
            assert torch.unique(idx[b, Tc:]).numel() <= m
        torch.testing.assert_close(w.sum(-1), torch.ones(B * (Tc + Bd)))


def test_expert_budget_in_generation(tiny_llm):
    E, k = tiny_llm.config.num_experts, tiny_llm.config.num_experts_per_tok
    kw = dict(mode="diffusion", max_new_tokens=16, block_size=8, threshold=0.5, ignore_eos=True)
    off = tiny_llm.generate([1, 2, 3], **kw)
    full = tiny_llm.generate([1, 2, 3], expert_budget=E, **kw)
    assert off.token_ids == full.token_ids
    small = tiny_llm.generate([1, 2, 3], expert_budget=k, **kw)
    assert small.stats.experts_touched is not None
    assert small.stats.experts_touched < off.stats.experts_touched
    with pytest.raises(ValueError, match="expert_budget"):
        tiny_llm.generate([1, 2, 3], expert_budget=E + 1, **kw)


def test_block_routing_by_max_keeps_an_expert_one_token_needs():
    """Sum ranking keeps the experts the block wants on average; max ranking (LLaDA2.2) keeps an
    expert that a single token wants strongly. Hand-built router probabilities, one row, 3 tokens."""
    from clover.moe import BlockSharing, route

    p = torch.tensor([[0.40, 0.35, 0.05, 0.20],   # the commit token (column 0): never restricted
                      [0.40, 0.35, 0.05, 0.20],
                      [0.40, 0.35, 0.05, 0.20],
                      [0.05, 0.05, 0.85, 0.05]])  # one denoise token needs expert 2 badly
    logits = p.log()
    _, idx_sum = route(logits, 1, BlockSharing(2, 1, 1, "sum"))  # sums: e0 .85, e1 .75, e2 .95 -> {2, 0}
    _, idx_max = route(logits, 1, BlockSharing(2, 1, 1, "max"))  # maxes: e0 .40, e1 .35, e2 .85 -> {2, 0}
    assert idx_sum[:, 0].tolist() == [0, 0, 0, 2] and idx_max[:, 0].tolist() == [0, 0, 0, 2]
    q = torch.tensor([[0.40, 0.35, 0.05, 0.20],
                      [0.32, 0.38, 0.00, 0.30],
                      [0.32, 0.38, 0.00, 0.30],
                      [0.30, 0.00, 0.45, 0.25]])
    logits = q.clamp_min(1e-6).log()
    # sums over the block: e0 .94, e1 .76, e2 .45, e3 .85 -> budget 2 keeps {0, 3}: the last token loses e2
    _, idx_sum = route(logits, 1, BlockSharing(2, 1, 1, "sum"))
    # maxes: e0 .32, e1 .38, e2 .45, e3 .30 -> keeps {2, 1}: the last token keeps its e2
    _, idx_max = route(logits, 1, BlockSharing(2, 1, 1, "max"))
    assert idx_sum[3, 0].item() == 0 and idx_max[3, 0].item() == 2
    assert idx_max[1, 0].item() == 1 and idx_sum[1, 0].item() == 0
