"""Routing and expert dispatch for the sparse MoE.

`route` turns router logits into top-k weights (softmax in fp32, top-k, renormalised), optionally
with *block expert sharing* (`BlockSharing`) for the denoise part of a forward: the block ranks the
experts by its tokens' router probabilities, summed (`rank="sum"`) or their maximum over the block
(`rank="max"`, LLaDA2.2's block routing: an expert one token needs badly is kept), keeps the `budget`
best, and each token takes its top-k within that shared set (renormalised).

`grouped_expert_forward` runs only the experts that received tokens, with the tokens grouped by
expert (one sort, then per touched expert: gather its tokens, one matmul pair, scatter-add back).
`reference_expert_forward` is the obviously-correct per-token loop it is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BlockSharing:
    """Block expert sharing for the denoise part of a forward: the router logits' rows are laid out
    `[rows, T]`, the denoise block sits at columns `denoise_from:` of each row, and its tokens share
    the `budget` most probable experts of the block."""

    budget: int
    rows: int
    denoise_from: int
    rank: str = "sum"  # how the block ranks experts: "sum" of its tokens' router probabilities, or their "max"


def route(
    logits: torch.Tensor,
    top_k: int,
    sharing: BlockSharing | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, k] fp32, indices [N, k]); with `sharing`, the denoise tokens
    choose only among their block's shared experts."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if sharing is not None:
        B, Tc, m = sharing.rows, sharing.denoise_from, sharing.budget
        E = probs.shape[-1]
        if m < E:
            p = probs.view(B, -1, E)
            block = p[:, Tc:]  # [B, Bd, E]
            score = block.amax(1) if sharing.rank == "max" else block.sum(1)  # [B, E]
            keep = score.topk(m, dim=-1).indices  # [B, m] the shared expert set
            allowed = torch.zeros(B, E, dtype=torch.bool, device=p.device).scatter_(1, keep, True)
            shared = block.masked_fill(~allowed[:, None, :], 0.0)
            probs = torch.cat([p[:, :Tc], shared], dim=1).reshape(-1, E)
    w, idx = probs.topk(top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    return w, idx


def grouped_expert_forward(experts, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    """x [N, H], top_idx/top_w [N, k] -> [N, H]. `experts` has gate_up_proj [E,2I,H], down_proj [E,H,I]
    (or a quantized module with the same `expert_forward(e, x)`)."""
    N, k = top_idx.shape
    flat_idx = top_idx.reshape(-1)
    order = torch.argsort(flat_idx, stable=True)  # slots grouped by expert
    token_of_slot = order // k
    weight_of_slot = top_w.reshape(-1).index_select(0, order).unsqueeze(-1)
    counts = torch.bincount(flat_idx, minlength=experts.num_experts).tolist()
    out = torch.zeros_like(x)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        tok = token_of_slot[start : start + c]
        y = experts.expert_forward(e, x.index_select(0, tok)) * weight_of_slot[start : start + c]
        out.index_add_(0, tok, y.to(x.dtype))  # per expert: no [N*k, H] staging buffer
        start += c
    return out


def reference_expert_forward(experts, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    """Per token, per chosen expert: the definition, with no grouping at all."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(top_idx.shape[1]):
            e = int(top_idx[n, j])
            gate, up = F.linear(x[n], experts.gate_up_proj[e]).chunk(2, dim=-1)
            out[n] += top_w[n, j] * F.linear(F.silu(gate) * up, experts.down_proj[e])
    return out
