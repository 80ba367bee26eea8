"""Routing and expert dispatch for the sparse MoE.

`route` turns router logits into top-k weights (softmax in fp32, top-k, renormalised), optionally
with *block expert sharing* (`BlockSharing`) for the denoise part of a forward: the block ranks the
experts by its tokens' router probabilities, summed (`rank="sum"`) or their maximum over the block
(`rank="max"`, LLaDA2.2's block routing: an expert one token needs badly is kept), keeps the `budget`
best, and each token takes its top-k within that shared set (renormalised). `block_experts` is that
shared set, which a family's own router (LLaDA2's sigmoid one) applies likewise.

`grouped_expert_forward` runs only the experts that received tokens, with the tokens grouped by
expert (one sort, then per touched expert: gather its tokens, one matmul pair, scatter-add back).
`reference_expert_forward` is the obviously-correct per-token loop it is tested against.
`dispatch_experts` is where every MoE family's routed tokens meet their experts: the grouped matmul
on the device (`static_expert_forward`) where `grouped_on_device` says, else the experts' own call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kernels.packed import grouped_serves


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
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, k] fp32, indices [N, k]); with `sharing`, the denoise tokens
    choose only among their block's shared experts. `normalize=False` keeps the k probabilities as
    they are (Qwen3-MoE's `norm_topk_prob` off)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    keep = block_experts(probs, sharing) if sharing is not None else None
    if keep is not None:
        p = probs.view(sharing.rows, -1, probs.shape[-1])
        Tc = sharing.denoise_from
        probs = torch.cat([p[:, :Tc], p[:, Tc:].masked_fill(~keep[:, None, :], 0.0)], dim=1).reshape(probs.shape)
    w, idx = probs.topk(top_k, dim=-1)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return w, idx


def block_experts(scores: torch.Tensor, sharing: BlockSharing) -> torch.Tensor | None:
    """Block expert sharing's shared set: scores [N, E] (the router's, laid out as `sharing` says)
    -> [rows, E] bool, each row's block's `budget` best experts, ranked by the sum (or the max) of
    its denoise tokens' scores; None when the budget covers every expert (nothing is restricted)."""
    E = scores.shape[-1]
    if sharing.budget >= E:
        return None
    block = scores.view(sharing.rows, -1, E)[:, sharing.denoise_from:]  # [B, Bd, E]
    score = block.amax(1) if sharing.rank == "max" else block.sum(1)  # [B, E]
    keep = score.topk(sharing.budget, dim=-1).indices  # [B, m]
    return torch.zeros(score.shape, dtype=torch.bool, device=scores.device).scatter_(1, keep, True)


def experts_touched(top_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many distinct experts the routed slots `top_idx` [N, k] touch, counted on the device (a 0-d tensor)."""
    return torch.zeros(num_experts, dtype=torch.long, device=top_idx.device).index_fill_(0, top_idx.reshape(-1), 1).sum()


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


GATHER_BYTES = 4 << 20


def grouped_swiglu(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped SwiGLU experts: rows of `xs` [M, H] sorted by expert, expert e owning rows
    [offsets[e-1], offsets[e]) (int32 cumulative counts); gate_up [E, 2I, H], down [E, H, I] -> [M, H].
    torch's grouped matmul (a loop over the touched experts where it is missing)."""
    if hasattr(torch, "_grouped_mm"):
        gate, up = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)
    out = xs.new_empty(xs.shape)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            gate, up = F.linear(xs[start:end], gate_up[e]).chunk(2, dim=-1)
            out[start:end] = F.linear(F.silu(gate) * up, down[e])
        start = end
    return out


@torch.library.custom_op("clover::expert_swiglu", mutates_args=())
def expert_swiglu(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_swiglu` as one op to a compiled graph (its output shape is the input's), so the token
    grouping needs no host read. Called only while compiling: eagerly a custom op's dispatch imports
    torch._dynamo (seconds at the first call; an eager `clover generate` never imports it)."""
    return grouped_swiglu(xs, gate_up, down, offsets)


@expert_swiglu.register_fake
def _(xs, gate_up, down, offsets):
    return xs.new_empty(xs.shape)


def static_expert_forward(experts, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    """`grouped_expert_forward` with shapes that depend only on the input's and no host read, so a
    compiled step has no graph break: the N*k routed slots sorted by expert, the per-expert offsets
    counted on the device, the experts applied by one grouped op (`expert_swiglu`). A few slots of
    small experts (an AR step of a small model; at most `GATHER_BYTES` of weights) instead gather
    their experts' weights into two batched matmuls, which costs fewer ops (measured 2.2-2.4x vs
    1.8x over eager on the bundled model's AR step, docs/benchmarks.md)."""
    N, k = top_idx.shape
    E = experts.num_experts
    gu_w, dn_w = experts.gate_up_proj, experts.down_proj
    flat_idx = top_idx.reshape(-1)
    if N * k < E and N * k * (gu_w[0].numel() + dn_w[0].numel()) * gu_w.element_size() <= GATHER_BYTES:
        # a few small experts (an AR step): gather their weights and apply them in two batched matmuls
        xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [N*k, H, 1]
        gate, up = torch.bmm(gu_w[flat_idx], xs).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(dn_w[flat_idx], (F.silu(gate) * up)[:, :, None]).squeeze(-1)  # [N*k, H]
        return (y.view(N, k, -1) * top_w[:, :, None].to(y.dtype)).sum(1).to(x.dtype)
    order = torch.argsort(flat_idx, stable=True)
    token_of_slot = order // k
    ends = torch.arange(1, E + 1, device=x.device, dtype=flat_idx.dtype)
    offsets = (flat_idx[None, :] < ends[:, None]).sum(1).to(torch.int32)  # cumulative counts per expert
    swiglu = expert_swiglu if torch.compiler.is_compiling() else grouped_swiglu
    y = swiglu(x.index_select(0, token_of_slot), gu_w, dn_w, offsets)
    y = y * top_w.reshape(-1).index_select(0, order)[:, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token_of_slot, y.to(x.dtype))


def reference_expert_forward(experts, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    """Per token, per chosen expert: the definition, with no grouping at all."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(top_idx.shape[1]):
            e = int(top_idx[n, j])
            gate, up = F.linear(x[n], experts.gate_up_proj[e]).chunk(2, dim=-1)
            out[n] += top_w[n, j] * F.linear(F.silu(gate) * up, experts.down_proj[e])
    return out


def dispatch_experts(experts, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, count_experts: bool = False,
                     static: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The routed experts' output for tokens x [N, H] routed as top_idx / top_w [N, k] (every MoE
    family's router ends here) -> (out [N, H], experts touched or None). `count_experts`: the experts
    touched, counted on the device (a 0-d tensor). `static`: the routed experts grouped on the device
    (`static_expert_forward`: no host read, no data-dependent shape) for a compiled step, and the
    same on a CPU at inference where `grouped_on_device` says; else `Experts` (grouped on the host,
    only the touched experts run; also quantized experts)."""
    touched = experts_touched(top_idx, experts.num_experts) if count_experts else None
    if static or grouped_on_device(experts, top_idx):
        return static_expert_forward(experts, x, top_idx, top_w), touched
    return experts(x, top_idx, top_w), touched


def grouped_on_device(experts, top_idx: torch.Tensor) -> bool:
    """Eagerly: the grouped matmul (`static_expert_forward`) where it beats the host loop over the
    touched experts: on a CPU, at inference (the grouped op has no backward), plain experts (not
    clover's quantized ones, nor a tensor subclass such as torchao's Int8Tensor in the transformers
    export, which the grouped op cannot take), at least as many routed slots as experts (a block, a
    verify, a prompt: one grouped matmul instead of a host loop over ~every expert, 1.65x faster at
    16 tokens on the bundled model, docs/benchmarks.md), where `kernels.packed.grouped_serves` says:
    not where the row kernel takes them (`kernels.packed.rows_take`: a packed block's few tokens,
    or large experts at a few dozen slots each), nor below `EXPERT_MAX_ROWS` slots per expert with
    oneDNN copies, where the host loop runs each expert's rows through oneDNN, faster than the
    grouped op."""
    return (top_idx.device.type == "cpu" and not torch.is_grad_enabled() and hasattr(torch, "_grouped_mm")
            and top_idx.numel() >= experts.num_experts
            and type(getattr(experts, "gate_up_proj", None)) in (torch.Tensor, torch.nn.Parameter)
            and grouped_serves(experts, top_idx))
