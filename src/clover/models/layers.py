"""The building blocks every architecture of the hybrid family shares: norms, partial RoPE, gated
attention, the Gated DeltaNet (with Clover's bidirectional denoise branch), the dense SwiGLU MLP and
the sparse MoE.

Layers take explicit arguments and return what they produce. The layout of a forward is a
`Segments`: per row a *commit* part `[B, Tc]` (causal; appended to the cache; right-padded,
`n_commit[b]` valid tokens) and a *denoise* part `[B, Bd]` (one block, bidirectional inside, reading
the cache after the commit part), or, in block-diffusion training, `[clean L | noisy k*L]` with
blocks of `block_size`. A layer's cache entry is its own state object (`clover.cache`), declared by
`make_state`. MLPs return `(y, ExpertStats | None)`: router logits and experts touched are outputs.

Parameter names follow the Hugging Face Qwen3.5 / Qwen3.5-MoE state dicts so checkpoints map 1:1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import AttentionState, DeltaNetState, conv_window_tail, scatter_kv
from ..config import CloverConfig, log2_block_ratio
from ..kernels import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_with_states,
    one_chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from ..kernels.packed import EXPERT_MAX_ROWS, experts as packed_experts, linear as packed_linear
from ..moe import BlockSharing, dispatch_experts, grouped_expert_forward, route
from .step import Live, Segments  # noqa: F401  (a forward's layout: the layers read it; imported from here too)


@dataclass
class ExpertStats:
    """What one MoE layer reports about its routing in a forward."""

    router_logits: torch.Tensor  # [N, E], for the load-balancing loss
    experts_touched: torch.Tensor | None = None  # 0-d: unique experts that received a token (when counted)


# --------------------------------------------------------------------------- norms & rope
def _rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, in fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms_normalise(x, self.eps) * (1.0 + self.weight.float())).type_as(x)


class PlainRMSNorm(nn.Module):
    """Plain-weight RMSNorm: y = w * (x * rsqrt(mean(x^2) + eps)), normalised in fp32, w initialised to 1
    (Llama's and Qwen3's norm, and the GDN output norm before its gate)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _rms_normalise(x, self.eps).to(x.dtype)


@torch.no_grad()
def init_plain_weights(module: nn.Module, seed: int | None, std: float, *, on_device: bool = False) -> None:
    """The plain-weight families' initialisation (Llama, the DFlash drafter): normal(0, std) for
    matrices and embeddings, zero biases, norms at 1, drawn in parameter order from `seed`.
    `on_device`: drawn where the parameters live, in their dtype (a full-size model on a GPU: no
    float32 copy on the host; the values then depend on the device's generator)."""
    device = next(module.parameters()).device if on_device else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    for name, p in module.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        elif on_device:
            p.normal_(0.0, std, generator=gen)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * std)


class GatedRMSNorm(PlainRMSNorm):
    """PlainRMSNorm followed by a SiLU gate, for the GDN output."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) * F.silu(gate.float())).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Partial RoPE (rotate-half convention) on the first `rotary_dim` dims of each head."""

    def __init__(self, dim: int, theta: float) -> None:
        super().__init__()
        self.dim, self.theta = dim, theta
        self._inv_freq: torch.Tensor | None = None  # not a buffer: nothing to load, nothing left on `meta`

    @classmethod
    def from_config(cls, config) -> "RotaryEmbedding":
        return cls(config.rotary_dim, config.rope_theta)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
            self._inv_freq = 1.0 / (self.theta**exponents)
        return self._inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq(positions.device)  # [B, T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, rot]. Rotates the first `rot` dims, leaves the rest."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    out = xr * cos + rotated * sin
    return out if rot == x.shape[-1] else torch.cat((out, xp), dim=-1)  # full rotary: no copy of an empty tail


def depthwise_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise conv, no padding: window [B, C, K-1+T], weight [C, 1, K] -> [B, C, T].

    For short inference windows, K shifted multiply-adds beat conv1d's per-call overhead on CPU
    (measured -11% per AR and denoise step; docs/benchmarks.md); identical results in fp32."""
    K = weight.shape[-1]
    T = window.shape[-1] - K + 1
    if torch.is_grad_enabled() or window.numel() > 1 << 16 or window.device.type != "cpu":
        return F.conv1d(window, weight, groups=weight.shape[0])
    out = window[:, :, :T] * weight[:, :, 0]
    for j in range(1, K):
        out.addcmul_(window[:, :, j : j + T], weight[:, :, j])
    return out


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)



# --------------------------------------------------------------------------- attention
class GatedAttention(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def make_state(self, batch: int, capacity: int, *, dtype: torch.dtype, device) -> AttentionState:
        return AttentionState.empty(batch, self.num_kv_heads, capacity, self.head_dim, dtype=dtype, device=device)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        *,
        mask: torch.Tensor | None = None,
        state: tuple[torch.Tensor, torch.Tensor] | None = None,
        lengths: torch.Tensor | None = None,
        commit_len: int = 0,
        live: Live | None = None,
    ) -> torch.Tensor:
        """x [B, T, H]. Without `state`: attention over x itself (causal, or `mask`). With `state`
        (this layer's K/V buffers `[B, H_kv, capacity, D]`, `AttentionState.tensors()`): the first
        `commit_len` positions are written at `lengths`, and every query attends to the cached keys
        and the new block keys under `mask` (`cached_attention_mask`). `live`: K/V only at its `kv`
        positions (frozen ones from its memo), queries and the output only at its `out` positions
        -> [len(out), hidden]."""
        if live is not None:
            return self._forward_live(x, rope, mask, state, lengths, commit_len, live)
        q, k, v, gate = self.project(x, rope)
        gqa = self.num_kv_heads != self.num_heads
        if state is None:
            if mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            out = self.attend_cached(q, k, v, state, lengths, commit_len, mask)
        return self.finish(out, gate)

    def _forward_live(self, x, rope, mask, state, lengths, commit_len: int, live: Live) -> torch.Tensor:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        flat = x.reshape(B * T, -1)
        cos, sin = (r.reshape(B * T, 1, -1) for r in rope)
        k, v = self.live_kv(flat[live.kv], cos[live.kv], sin[live.kv])  # [N, Hkv, D] each
        memo = live.memo or (None, None)
        K, V = live.place(k, memo[0]), live.place(v, memo[1])  # [B, T, Hkv, D]
        live.remember(K, V)
        q, gate = self.live_q(flat[live.out], cos[live.out], sin[live.out])  # [M, H, D]
        Q = q.new_zeros(B * T, H, D).index_copy_(0, live.out, q).view(B, T, H, D)
        out = self.attend_cached(Q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2), state, lengths,
                                 commit_len, mask)
        return self.live_finish(out.transpose(1, 2).reshape(B * T, H * D)[live.out], gate)

    def heads(self, y: torch.Tensor, n: int, norm: nn.Module | None = None) -> torch.Tensor:
        """A projection's output [..., n*D] -> its `n` heads [..., n, D], each normed by `norm` where
        the family norms them (None: as they are)."""
        y = y.view(*y.shape[:-1], n, self.head_dim)
        return y if norm is None else norm(y)

    # the live path's per-position pieces (`_forward_live`): x [N, hidden], cos/sin [N, 1, rot]; `live_kv`
    # serves every family with separate k/v projections (its `k_norm` None where keys are not normed)
    def live_kv(self, xk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> k (normed, RoPE applied), v [N, H_kv, D]."""
        k = self.heads(self.k_proj(xk), self.num_kv_heads, self.k_norm)
        return apply_rope(k[:, :, None], cos, sin)[:, :, 0], self.heads(self.v_proj(xk), self.num_kv_heads)

    def live_q(self, xo: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> q [M, H, D] (normed, RoPE applied) and the output gate [M, H*D]."""
        M = xo.shape[0]
        q, gate = self.q_proj(xo).view(M, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        return apply_rope(self.q_norm(q)[:, :, None], cos, sin)[:, :, 0], gate.reshape(M, self.num_heads * self.head_dim)

    def live_finish(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The attention output at the live positions [M, H*D] -> gated, projected [M, hidden]."""
        return self.o_proj(o * torch.sigmoid(gate))

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """x [B, T, H] -> q [B, H, T, D], k/v [B, H_kv, T, D] (normed, RoPE applied) and the output gate [B, T, H*D]."""
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(B, T, -1)
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, D]
        k = self.heads(self.k_proj(x), self.num_kv_heads, self.k_norm).transpose(1, 2)
        v = self.heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        cos, sin = rope
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def finish(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Attention output [B, H, T, D] -> gated, projected [B, T, hidden]."""
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate))

    def attend_cached(self, q, k, v, state: tuple[torch.Tensor, torch.Tensor], lengths: torch.Tensor, commit_len: int,
                      mask: torch.Tensor) -> torch.Tensor:
        """q/k/v [B, H, T, D] after RoPE: scatter the first `commit_len` keys into the buffers `state`
        at each row's length, attend under `mask`. The mask's columns say how many key slots are
        read (`cached_attention_mask`: the longest row, or the whole capacity for a fixed shape), so
        nothing here reads the host."""
        Tc = commit_len
        keys, vals = state
        if Tc:
            scatter_kv(keys, vals, k[:, :, :Tc], v[:, :, :Tc], lengths)
        slots = mask.shape[-1] - (q.shape[2] - Tc)
        if slots < keys.shape[2]:
            keys, vals = keys[:, :, :slots], vals[:, :, :slots]
        if q.shape[2] > Tc:
            keys = torch.cat([keys, k[:, :, Tc:]], dim=2)
            vals = torch.cat([vals, v[:, :, Tc:]], dim=2)
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)


def step_positions(start: torch.Tensor, n: torch.Tensor, commit_len: int, denoise_len: int) -> torch.Tensor:
    """[B, Tc+Bd] RoPE positions of a cached forward: the commit tokens from each row's length
    `start`, the denoise block after the row's `n` committed tokens."""
    pos = [start[:, None] + torch.arange(commit_len, device=start.device)] if commit_len else []
    if denoise_len:
        pos.append((start + n)[:, None] + torch.arange(denoise_len, device=start.device))
    return torch.cat(pos, dim=1)


def cached_attention_mask(start: torch.Tensor, segments: Segments, key_slots: int | None = None) -> torch.Tensor:
    """[B, 1, Tc+Bd, Lk+Bd] boolean for a cached forward, `start` the lengths before it and
    Lk the cached key slots (`key_slots`, e.g. the whole capacity for a static-shape graph; default
    max(start) + Tc, a host read): commit queries see the prefix and earlier commit tokens (causal);
    block queries see the whole committed prefix (after this forward's commit) and the whole block;
    commit queries never see the block. With `segments.commit_block` B, a commit query at position
    p sees every valid commit key up to the end of its block, ((p // B) + 1) * B - 1 (SDAR's
    block-causal commit). Built once per forward."""
    Tc, Bd = segments.commit_len, segments.denoise_len
    Lk = key_slots if key_slots is not None else int(start.max()) + Tc
    dev = start.device
    j = torch.arange(Lk, device=dev)
    parts = []
    if Tc:
        t = torch.arange(Tc, device=dev)
        p = start[:, None, None] + t[None, :, None]  # [B, Tc, 1] the commit queries' positions
        cb = segments.commit_block
        if cb is None:
            parts.append(j[None, None, :] <= p)
        else:
            n = segments.n_commit if segments.n_commit is not None else torch.full_like(start, Tc)
            end = torch.minimum((p // cb + 1) * cb, (start + n)[:, None, None])
            parts.append((j[None, None, :] < end) | (j[None, None, :] <= p))
    if Bd:
        n = segments.n_commit if segments.n_commit is not None else torch.full_like(start, Tc)
        parts.append((j[None, None, :] < (start + n)[:, None, None]).expand(-1, Bd, -1))
    mask = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    if Bd:
        block_cols = torch.zeros(mask.shape[0], Tc + Bd, Bd, dtype=torch.bool, device=dev)
        block_cols[:, Tc:] = True
        mask = torch.cat([mask, block_cols], dim=2)
    return mask[:, None]


def block_diffusion_mask(L: int, k: int, block_size: int, device) -> torch.Tensor:
    """[1, 1, (k+1)L, (k+1)L] for `[clean L | noisy copy 1 | ... | copy k]`: the clean stream is
    causal; noisy block b of every copy sees the clean prefix before the block and its own block
    bidirectionally; copies never see each other."""
    pos = torch.arange(L, device=device)
    blk = pos // block_size
    causal = pos[None, :] <= pos[:, None]
    clean_before_block = pos[None, :] < (blk * block_size)[:, None]
    same_block = (blk[None, :] == blk[:, None]).to(torch.uint8)
    top = torch.cat([causal, torch.zeros(L, k * L, dtype=torch.bool, device=device)], dim=1)
    own_copy = torch.kron(torch.eye(k, dtype=torch.uint8, device=device), same_block).bool()  # [kL, kL]
    bottom = torch.cat([clean_before_block.repeat(k, 1), own_copy], dim=1)
    return torch.cat([top, bottom], dim=0)[None, None]


# --------------------------------------------------------------------------- gated deltanet
# Clover's parameters, per GDN layer (under `linear_attn.`): the one list of their names; every
# other place (training's freezing, exports, the vLLM plugin, the peer engines) derives from it
CLOVER_PARAMETERS = ("conv1d_right.weight", "intra_scale", "block_gain_a", "block_gain_b")
# an eager commit of up to this many tokens that is recorded (a speculative verify, rolled back to a
# prefix after it) runs as one WY chunk (`one_chunk_gated_delta_rule`: ~20 fewer ops per layer than the
# chunked kernel, ~100 us less at 8 tokens on one CPU thread) and keeps its WY terms, from which the
# rollback reads the state after the kept prefix (`state_after`) instead of running the recurrence again
ONE_CHUNK_RECORDED = 32


def is_clover_parameter(name: str) -> bool:
    """Whether a state-dict key (`model.layers.N.linear_attn.intra_scale`, ...) is one of Clover's
    own parameters, which a plain AR backbone does not have."""
    head, sep, leaf = name.rpartition("linear_attn.")
    return bool(sep) and leaf in CLOVER_PARAMETERS


def denoise_parameters(config: CloverConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Clover's additions to one GDN layer at their initial values (the one place they are defined):
    the right-side conv branch and the block gains at zero, the intra-block logit scale at sqrt(d_k).
    With both branches at zero, denoise mode starts from the AR model's decayed prefix readout."""
    c = config
    hv = c.linear_num_value_heads
    values = {
        "conv1d_right.weight": torch.zeros(c.linear_conv_dim, 1, c.linear_conv_kernel_dim - 1, dtype=dtype),
        "intra_scale": torch.full((hv,), math.sqrt(c.linear_key_head_dim), dtype=dtype),
        "block_gain_a": torch.zeros(hv, dtype=dtype),
        "block_gain_b": torch.zeros(hv, dtype=dtype),
    }
    assert tuple(values) == CLOVER_PARAMETERS
    return values


class GatedDeltaNet(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        c = config
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.kernel_size = c.linear_conv_kernel_dim
        self.conv_dim = c.linear_conv_dim
        self.in_proj_qkv = nn.Linear(c.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, self.hv, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, c.hidden_size, bias=False)
        self.has_denoise_params = c.is_clover
        if c.is_clover:
            # Clover's bidirectional additions; their initial values: `denoise_parameters`
            self.conv1d_right = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size - 1, groups=self.conv_dim, bias=False)
            self.intra_scale = nn.Parameter(torch.empty(self.hv))
            self.block_gain_a = nn.Parameter(torch.empty(self.hv))
            self.block_gain_b = nn.Parameter(torch.empty(self.hv))

    def make_state(self, batch: int, capacity: int, *, dtype: torch.dtype, device) -> DeltaNetState:
        return DeltaNetState.empty(batch, self.conv_dim, self.kernel_size, self.hv, self.dk, self.dv, dtype=dtype, device=device)

    # -- pieces shared by every path
    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = mixed.shape
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.hk, self.dk)
        k = k.reshape(B, T, self.hk, self.dk)
        v = v.reshape(B, T, self.hv, self.dv)
        if self.hv != self.hk:  # each key head serves hv/hk consecutive value heads
            q = q.repeat_interleave(self.hv // self.hk, dim=2)
            k = k.repeat_interleave(self.hv // self.hk, dim=2)
        return q, k, v

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        return g, beta

    def _causal_conv(self, window: torch.Tensor) -> torch.Tensor:
        """window [B, C, K-1+T] (left context then new inputs) -> pre-activation [B, C, T]."""
        return depthwise_conv(window, self.conv1d.weight)

    def forward(self, x: torch.Tensor, segments: Segments, state: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                static: bool = False, records: list | None = None, live: Live | None = None) -> torch.Tensor:
        """x [B, T, H]. Without `state`: causal over x (or, with `segments.block_size`, the clean and
        noisy training streams). With `state` (this layer's conv and recurrent state,
        `DeltaNetState.tensors()`, updated in place): the commit part advances the state, the
        denoise part reads it; `records`, when a list, receives the commit's inputs (what
        `DeltaNetState.record` keeps for a speculative rollback). `static`: a commit of several
        tokens runs as one WY chunk (`one_chunk_gated_delta_rule`, no host read, for a compiled
        step) instead of the chunked kernel. `live`: the projections in only at its `kv` positions
        (frozen ones' pre-conv inputs from its memo), the output gate, norm and projection only at its
        `out` positions -> [len(out), hidden]."""
        B, T, _ = x.shape
        Tc, Bd = (segments.commit_len, segments.denoise_len) if state is not None else (T, 0)
        mixed, z, g, beta = self.project(x) if live is None else self._project_live(x, live)
        K1 = self.kernel_size - 1
        if segments.block_size is not None:
            o = self._train_streams(mixed, g, beta, segments.block_size, segments.commit_len)
            return self.finish(o, z)
        outs = []
        conv, recurrent = state if state is not None else (mixed.new_zeros(B, self.conv_dim, K1), None)
        causal = None
        if Tc and Bd and segments.n_commit is None and segments.denoise_valid is None and mixed.dtype == torch.float32:
            # the block's conv context is the commit's last K-1 inputs: one causal conv over both parts
            # (elementwise: in fp32 the same values as two, bit for bit, each part made contiguous as its
            # own conv's output is, so that the activation after it takes the same vectorised path; not
            # always in bf16: two rows committing 32 with blocks of 32 differ, where the vectorised bf16
            # paths fall moves with the parts' lengths)
            window = torch.cat([conv.to(mixed.dtype), mixed], dim=2)
            causal = self._causal_conv(window)
        if Tc:
            n = segments.n_commit if state is not None else None
            shared = None if causal is None else (window[:, :, : K1 + Tc], causal[:, :, :Tc].contiguous())
            q, k, v, gc, bc, window = self._commit_inputs(mixed[:, :, :Tc], conv, g[:, :Tc], beta[:, :Tc], n, shared)
            record = (q, k, v, gc, bc, window)
            if Tc == 1 and state is not None:
                o, new_state = recurrent_gated_delta_rule(
                    q, k, v, gc, bc, initial_state=recurrent, output_final_state=True, use_qk_l2norm_in_kernel=True
                )
            elif records is not None and not static and state is not None and Tc <= ONE_CHUNK_RECORDED:
                # a speculative verify's commit: one WY chunk, its terms kept for the rollback after it
                o, new_state, wy = one_chunk_gated_delta_rule(q, k, v, gc, bc, recurrent, wy=True)
                record += (wy,)
            elif static and state is not None:
                o, new_state = one_chunk_gated_delta_rule(q, k, v, gc, bc, recurrent)
            else:  # chunk 32 measured faster than 64 on CPU, same results (docs/kernels.md)
                o, new_state = chunk_gated_delta_rule(
                    q, k, v, gc, bc, initial_state=recurrent, output_final_state=state is not None,
                    use_qk_l2norm_in_kernel=True, chunk_size=32,
                )
            if records is not None:
                records.append(record)
            outs.append(o)
            if state is not None:
                recurrent.copy_(new_state)
                conv.copy_(conv_window_tail(window, K1, n))
        if Bd:
            outs.append(self.denoise_block(mixed[:, :, Tc:], conv, g[:, Tc:], recurrent, width=segments.denoise_width,
                                           valid=segments.denoise_valid,
                                           causal=None if causal is None else causal[:, :, Tc:].contiguous()))
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if live is None:
            return self.finish(o, z)
        o = o.reshape(B * T, self.hv, self.dv)[live.out]
        return self.out_proj(self.norm(o, z).reshape(o.shape[0], self.value_dim))

    def _project_live(self, x: torch.Tensor, live: Live):
        """`project` at the `kv` positions only (the output gate z at the `out` positions, [M, Hv, dv]);
        frozen positions' pre-conv inputs from the memo, their gates zero (a frozen position's own
        output is not computed; the other positions read only its pre-conv inputs)."""
        flat = x.reshape(live.B * live.T, -1)
        xk = flat[live.kv]
        g, beta = self._gates(xk)
        pre = live.place(self.in_proj_qkv(xk), (live.memo or (None,))[0])  # [B, T, C]
        live.remember(pre)
        xo = flat[live.out]
        z = self.in_proj_z(xo).reshape(xo.shape[0], self.hv, self.dv)
        return pre.transpose(1, 2), z, live.place(g), live.place(beta)

    def project(self, x: torch.Tensor):
        """x [B, T, H] -> pre-conv inputs [B, C, T], output gate z [B, T, Hv, dv], decay g and beta [B, T, Hv]."""
        B, T, _ = x.shape
        g, beta = self._gates(x)
        return self.in_proj_qkv(x).transpose(1, 2), self.in_proj_z(x).reshape(B, T, self.hv, self.dv), g, beta

    def finish(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Mixer output [B, T, Hv, dv] -> gated-normed, projected [B, T, hidden]."""
        B, T = o.shape[:2]
        return self.out_proj(self.norm(o, z).reshape(B, T, self.value_dim))

    def _commit_inputs(self, pre: torch.Tensor, conv_state: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       n: torch.Tensor | None, shared: tuple[torch.Tensor, torch.Tensor] | None = None):
        """What the recurrence of a commit takes: pre [B, C, Tc] after `conv_state` -> (q, k, v, g, beta,
        window). Rows committing `n[b]` < Tc tokens: the padded steps' g and beta are zeroed, so they
        neither decay nor write the state. `shared`: the window and its causal conv, already computed."""
        if shared is None:
            window = torch.cat([conv_state.to(pre.dtype), pre], dim=2)
            shared = window, self._causal_conv(window)
        window = shared[0]
        q, k, v = self._split_heads(F.silu(shared[1]).transpose(1, 2))
        if n is not None:
            valid = (torch.arange(pre.shape[2], device=pre.device)[None, :] < n[:, None])[..., None]
            g, beta = g * valid, beta * valid
        return q, k, v, g, beta, window

    def denoise_block(self, pre: torch.Tensor, conv_ctx: torch.Tensor, g: torch.Tensor, state: torch.Tensor,
                      width: int | None = None, valid: torch.Tensor | None = None,
                      causal: torch.Tensor | None = None) -> torch.Tensor:
        """Bidirectional GDN over blocks: decayed prefix readout + intra-block softmax attention.

        pre [M, C, Bs] pre-conv block inputs; conv_ctx [M, C, K-1] the prefix's last pre-conv inputs;
        g [M, Bs, Hv]; state [M, Hv, dk, dv] the prefix recurrent state. Returns [M, Bs, Hv, dv].
        `width`: the block's width when `pre` holds only its first positions (the block gain's).
        `valid [M, Bs]` (bool, a prefix per row): the positions present; the others are read as past the
        block's end (zero conv inputs, no intra-block key), so a row is computed as if its block
        ended there. `causal`: the causal conv of the block after `conv_ctx`, already computed (then
        `conv_ctx` is not read)."""
        Bs = pre.shape[2]
        if valid is not None:
            pre = torch.where(valid[:, None, :], pre, 0.0)
        K1 = self.kernel_size - 1
        conv = causal if causal is not None else self._causal_conv(torch.cat([conv_ctx.to(pre.dtype), pre], dim=2))
        if self.has_denoise_params:
            later = F.pad(pre, (0, K1))[:, :, 1:]  # x_{i+1} ... x_{i+K-1}, zero past the block end
            conv = conv + depthwise_conv(later, self.conv1d_right.weight)
        act = F.silu(conv).transpose(1, 2)
        q, k, v = self._split_heads(act)
        q_hat, k_hat = l2norm(q.float()), l2norm(k.float())
        prefix = torch.einsum("bthk,bhkv->bthv", q_hat * self.dk**-0.5, state) * g.float().exp()[..., None]
        if not self.has_denoise_params:
            return prefix.to(pre.dtype)
        logits = torch.einsum("bihk,bjhk->bhij", q_hat, k_hat) * self.intra_scale.float()[None, :, None, None]
        if valid is not None:
            logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        intra = torch.einsum("bhij,bjhv->bihv", logits.softmax(-1), v.float())
        gain = self.block_gain_a.float() + self.block_gain_b.float() * log2_block_ratio(width or Bs)
        return (prefix + gain[None, None, :, None] * intra).to(pre.dtype)

    def _train_streams(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, Bs: int, L: int) -> torch.Tensor:
        """Block-diffusion training: mixed [B, C, (k+1)L] = [clean | noisy copy 1 | ... | copy k]. The
        clean stream runs causally (chunked with chunk = block size, keeping the state at every block
        boundary); every noisy block of every copy is denoised against the clean prefix before it.
        Returns [B, (k+1)L, Hv, dv]."""
        B, C, T = mixed.shape
        k = T // L - 1
        N, K1 = L // Bs, self.kernel_size - 1
        clean = mixed[:, :, :L]
        padded = F.pad(clean, (K1, 0))  # zeros before the sequence start
        act = F.silu(self._causal_conv(padded)).transpose(1, 2)
        q, kk, v = self._split_heads(act)
        o_clean, states = chunk_gated_delta_rule_with_states(
            q, kk, v, g[:, :L], beta[:, :L], chunk_size=Bs, use_qk_l2norm_in_kernel=True
        )  # states [B, N, Hv, dk, dv]: the state before each block
        # the K-1 clean pre-conv inputs before each block start
        idx = torch.arange(N, device=mixed.device)[:, None] * Bs + torch.arange(K1, device=mixed.device)[None, :]
        ctx_in = padded[:, :, idx].permute(0, 2, 1, 3)  # [B, N, C, K-1]
        M = B * k * N
        conv_ctx = ctx_in[:, None].expand(B, k, N, C, K1).reshape(M, C, K1)
        st = states[:, None].expand(B, k, *states.shape[1:]).reshape(M, self.hv, self.dk, self.dv)
        noisy = mixed[:, :, L:].reshape(B, C, k, N, Bs).permute(0, 2, 3, 1, 4).reshape(M, C, Bs)
        g_noisy = g[:, L:].reshape(M, Bs, self.hv)
        o_noisy = self.denoise_block(noisy, conv_ctx, g_noisy, st).reshape(B, k * L, self.hv, self.dv)
        return torch.cat([o_clean.to(o_noisy.dtype), o_noisy], dim=1)



# --------------------------------------------------------------------------- MLPs
class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """All routed experts, stored fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
    `packs`: each expert's two weights packed for oneDNN (`kernels.packed.pack_model`), or None."""

    packs: list | None = None

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gu, dn = self.packs[e] if self.packs is not None else (None, None)
        gate, up = packed_linear(x, self.gate_up_proj[e], gu, source=self.gate_up_proj,
                                 max_rows=EXPERT_MAX_ROWS).chunk(2, dim=-1)
        return packed_linear(F.silu(gate) * up, self.down_proj[e], dn, source=self.down_proj, max_rows=EXPERT_MAX_ROWS)

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x [N, H]; top_idx/top_w [N, k]. Tokens grouped by expert; only touched experts run
        (where the row kernel takes them, `kernels.packed.rows_take`: in one call of it, `kernels.packed.experts`)."""
        if (out := packed_experts(self, x, top_idx, top_w)) is not None:
            return out
        return grouped_expert_forward(self, x, top_idx, top_w)


class DenseMLP(MLP):
    """The dense backbone's MLP (one SwiGLU per layer); no routing, nothing to report."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, sharing: BlockSharing | None = None, count_experts: bool = False,
                static: bool = False):
        return super().forward(x), None


class SparseMoE(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        c = config
        self.top_k, self.num_experts = c.num_experts_per_tok, c.num_experts
        self.normalize = getattr(c, "norm_topk_prob", True)  # renormalise the top-k (Qwen3-MoE may not)
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)  # the router
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size)
        self.has_shared = c.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(
        self, x: torch.Tensor, sharing: BlockSharing | None = None, count_experts: bool = False, static: bool = False
    ) -> tuple[torch.Tensor, ExpertStats]:
        """x [B, T, H] -> (y, stats). `sharing`: block expert sharing for the denoise part.
        `count_experts`, `static`: as `moe.dispatch_experts`."""
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        logits = self.gate(flat)
        top_w, top_idx = route(logits, self.top_k, sharing, self.normalize)
        out, touched = dispatch_experts(self.experts, flat, top_idx, top_w.to(x.dtype), count_experts, static)
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(B, T, H), ExpertStats(logits, touched)

