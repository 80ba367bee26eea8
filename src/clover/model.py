"""The Qwen3.5/3.6-MoE hybrid backbone (Gated DeltaNet + gated attention + MoE) with Clover's
block-diffusion (denoise) mode over the same weights.

One forward can carry two parts per row, laid side by side on the time axis:
- a *commit* part `[B, Tc]` (causal; appended to the cache; right-padded, `n_commit[b]` valid tokens),
- a *denoise* part `[B, Bd]` (one block, bidirectional inside, reading the cache after the commit part;
  never written to the cache).
The prompt prefill, AR decoding, committing a finished block and denoising the next block are all
instances of this one call (`CloverForCausalLM.step`). `CloverForCausalLM.forward(input_ids)` is the
plain causal forward without a cache.

Parameter names follow the Hugging Face `Qwen3_5MoeForCausalLM` state dict so checkpoints map 1:1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .cache import HybridCache
from .config import CloverConfig, log2_block_ratio
from .kernels import chunk_gated_delta_rule, chunk_gated_delta_rule_with_states, recurrent_gated_delta_rule
from .moe import grouped_expert_forward, route


# --------------------------------------------------------------------------- context
@dataclass
class StepContext:
    """What every layer needs to know about the current forward."""

    commit_len: int  # Tc: padded length of the commit part (0 = none)
    denoise_len: int  # Bd: length of the denoise block (0 = none)
    cos: torch.Tensor  # [B, T, rotary_dim]
    sin: torch.Tensor
    n_commit: torch.Tensor | None = None  # [B] valid commit tokens per row; None = all Tc valid
    expert_budget: int | None = None  # block expert sharing in the denoise part
    experts_touched: list[int] = field(default_factory=list)  # per MoE layer, filled when tracking
    track_experts: bool = False
    router_logits: list[torch.Tensor] | None = None  # collected for the load-balancing loss
    train_block_size: int | None = None  # set: x is [clean stream | noisy stream] (block-diffusion training)
    cached_attn_mask: torch.Tensor | None = None  # built by the first attention layer of a cached forward

    @property
    def ragged(self) -> bool:
        return self.n_commit is not None


# --------------------------------------------------------------------------- norms & rope
class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """Plain-weight RMSNorm (w initialised to 1) followed by a SiLU gate, for the GDN output."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        y = self.weight * y
        return (y * F.silu(gate.float())).to(dtype)


class RotaryEmbedding(nn.Module):
    """Partial RoPE (rotate-half convention) on the first `rotary_dim` dims of each head."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.dim, self.theta = config.rotary_dim, config.rope_theta
        self._inv_freq: torch.Tensor | None = None  # not a buffer: nothing to load, nothing left on `meta`

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
    return torch.cat((xr * cos + rotated * sin, xp), dim=-1)


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
    def __init__(self, config: CloverConfig, layer_idx: int) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        ctx: StepContext,
        cache: HybridCache | None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(B, T, -1)
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, ctx.cos, ctx.sin)
        k = apply_rope(k, ctx.cos, ctx.sin)

        if cache is None:
            if attn_mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=self.num_kv_heads != self.num_heads)
        else:
            out = self._cached(q, k, v, ctx, cache)
        out = out.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate)
        return self.o_proj(out)

    def _cached(self, q, k, v, ctx: StepContext, cache: HybridCache) -> torch.Tensor:
        Tc, Bd = ctx.commit_len, ctx.denoise_len
        if Tc:
            keys, vals = cache.write_kv(self.layer_idx, k[:, :, :Tc], v[:, :, :Tc])
        else:
            keys, vals = cache.read_kv(self.layer_idx)
        if Bd:
            keys = torch.cat([keys, k[:, :, Tc:]], dim=2)
            vals = torch.cat([vals, v[:, :, Tc:]], dim=2)
        if ctx.cached_attn_mask is None:  # the same for every attention layer of this forward
            ctx.cached_attn_mask = cached_attention_mask(cache.lengths, ctx, keys.shape[2] - Bd)
        return F.scaled_dot_product_attention(
            q, keys, vals, attn_mask=ctx.cached_attn_mask, enable_gqa=self.num_kv_heads != self.num_heads
        )


def cached_attention_mask(start: torch.Tensor, ctx: StepContext, Lk: int) -> torch.Tensor:
    """[B, 1, Tc+Bd, Lk+Bd] boolean: commit queries see the prefix and earlier commit tokens
    (causal); block queries see the whole committed prefix (after this forward's commit) and the
    whole block; commit queries never see the block."""
    Tc, Bd = ctx.commit_len, ctx.denoise_len
    dev = start.device
    j = torch.arange(Lk, device=dev)
    parts = []
    if Tc:
        t = torch.arange(Tc, device=dev)
        parts.append(j[None, None, :] <= (start[:, None, None] + t[None, :, None]))
    if Bd:
        n = ctx.n_commit if ctx.n_commit is not None else torch.full_like(start, Tc)
        parts.append((j[None, None, :] < (start + n)[:, None, None]).expand(-1, Bd, -1))
    mask = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    if Bd:
        block_cols = torch.zeros(mask.shape[0], Tc + Bd, Bd, dtype=torch.bool, device=dev)
        block_cols[:, Tc:] = True
        mask = torch.cat([mask, block_cols], dim=2)
    return mask[:, None]


# --------------------------------------------------------------------------- gated deltanet
class GatedDeltaNet(nn.Module):
    def __init__(self, config: CloverConfig, layer_idx: int) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
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
            # Clover's bidirectional additions, zero-initialised so a converted AR checkpoint starts sane
            self.conv1d_right = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size - 1, groups=self.conv_dim, bias=False)
            self.intra_scale = nn.Parameter(torch.full((self.hv,), math.sqrt(self.dk)))
            self.block_gain_a = nn.Parameter(torch.zeros(self.hv))
            self.block_gain_b = nn.Parameter(torch.zeros(self.hv))

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

    def forward(
        self,
        x: torch.Tensor,
        ctx: StepContext,
        cache: HybridCache | None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        Tc, Bd = (ctx.commit_len, ctx.denoise_len) if cache is not None else (T, 0)
        mixed = self.in_proj_qkv(x).transpose(1, 2)  # [B, C, T]
        z = self.in_proj_z(x).reshape(B, T, self.hv, self.dv)
        g, beta = self._gates(x)
        K1 = self.kernel_size - 1
        if ctx.train_block_size is not None:
            o = self._train_streams(mixed, g, beta, ctx.train_block_size, ctx.commit_len)
            return self.out_proj(self.norm(o, z).reshape(B, T, self.value_dim))
        outs = []
        if Tc:
            pre = mixed[:, :, :Tc]
            conv_state = cache.conv[self.layer_idx] if cache is not None else pre.new_zeros(B, self.conv_dim, K1)
            window = torch.cat([conv_state.to(pre.dtype), pre], dim=2)
            act = F.silu(self._causal_conv(window)).transpose(1, 2)
            q, k, v = self._split_heads(act)
            gc, bc = g[:, :Tc], beta[:, :Tc]
            if ctx.ragged and cache is not None:
                # rows commit different numbers of tokens: padded steps neither decay nor write the state
                valid = torch.arange(Tc, device=x.device)[None, :] < ctx.n_commit[:, None]
                gc = gc * valid[..., None]
                bc = bc * valid[..., None]
            if cache is not None and cache.record is not None:
                cache.record[self.layer_idx] = (q, k, v, gc, bc, window)
            state = cache.recurrent[self.layer_idx] if cache is not None else None
            if Tc == 1 and cache is not None:
                o, new_state = recurrent_gated_delta_rule(
                    q, k, v, gc, bc, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
                )
            else:  # chunk 32 measured faster than 64 on CPU, same results (docs/kernels.md)
                o, new_state = chunk_gated_delta_rule(
                    q, k, v, gc, bc, initial_state=state, output_final_state=cache is not None,
                    use_qk_l2norm_in_kernel=True, chunk_size=32,
                )
            outs.append(o)
            if cache is not None:
                cache.recurrent[self.layer_idx] = new_state
                if ctx.ragged:
                    idx = ctx.n_commit[:, None, None] + torch.arange(K1, device=x.device)[None, None, :]
                    cache.conv[self.layer_idx] = window.gather(2, idx.expand(B, self.conv_dim, K1)).contiguous()
                else:
                    cache.conv[self.layer_idx] = window[:, :, -K1:].contiguous()
        if Bd:
            outs.append(self._denoise(mixed[:, :, Tc:], g[:, Tc:], cache, Bd))
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        o = self.norm(o, z)
        return self.out_proj(o.reshape(B, T, self.value_dim))

    def _denoise(self, pre: torch.Tensor, g: torch.Tensor, cache: HybridCache, Bd: int) -> torch.Tensor:
        """Denoise one block against the cache (prefix conv inputs and recurrent state)."""
        return self.denoise_block(pre, cache.conv[self.layer_idx], g, cache.recurrent[self.layer_idx])

    def denoise_block(self, pre: torch.Tensor, conv_ctx: torch.Tensor, g: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Bidirectional GDN over blocks: decayed prefix readout + intra-block softmax attention.

        pre [M, C, Bs] pre-conv block inputs; conv_ctx [M, C, K-1] the prefix's last pre-conv inputs;
        g [M, Bs, Hv]; state [M, Hv, dk, dv] the prefix recurrent state. Returns [M, Bs, Hv, dv]."""
        Bs = pre.shape[2]
        K1 = self.kernel_size - 1
        window = torch.cat([conv_ctx.to(pre.dtype), pre], dim=2)
        conv = self._causal_conv(window)
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
        intra = torch.einsum("bhij,bjhv->bihv", logits.softmax(-1), v.float())
        gain = self.block_gain_a.float() + self.block_gain_b.float() * log2_block_ratio(Bs)
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


# --------------------------------------------------------------------------- mixture of experts
class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """All routed experts, stored fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x [N, H]; top_idx/top_w [N, k]. Tokens grouped by expert; only touched experts run."""
        return grouped_expert_forward(self, x, top_idx, top_w)


class SparseMoE(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        c = config
        self.top_k, self.num_experts = c.num_experts_per_tok, c.num_experts
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)  # the router
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size)
        self.has_shared = c.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        logits = self.gate(flat)
        if ctx is not None and ctx.router_logits is not None:
            ctx.router_logits.append(logits)
        budget_rows = None
        if ctx is not None and ctx.expert_budget is not None and ctx.denoise_len:
            budget_rows = (B, T, ctx.commit_len, ctx.denoise_len, ctx.expert_budget)
        top_w, top_idx = route(logits, self.top_k, budget_rows)
        if ctx is not None and ctx.track_experts:
            ctx.experts_touched.append(int(torch.unique(top_idx).numel()))
        out = self.experts(flat, top_idx, top_w.to(x.dtype))
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(B, T, H)


# --------------------------------------------------------------------------- stack
class DecoderLayer(nn.Module):
    def __init__(self, config: CloverConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "full_attention":
            self.self_attn = GatedAttention(config, layer_idx)
        else:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        self.mlp = SparseMoE(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, ctx: StepContext, cache: HybridCache | None, attn_mask=None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "full_attention":
            h = self.self_attn(h, ctx, cache, attn_mask)
        else:
            h = self.linear_attn(h, ctx, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), ctx)


class TextModel(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


@dataclass
class StepOutput:
    commit_logits: torch.Tensor | None  # [B, V] at each row's last valid commit token (or [B, Tc, V] if all_logits)
    denoise_logits: torch.Tensor | None  # [B, Bd, V]
    experts_touched: list[int]


class CloverForCausalLM(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- properties
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def make_cache(self, batch_size: int, capacity: int) -> HybridCache:
        return HybridCache(self.config, batch_size, capacity, dtype=self.dtype, device=self.device)

    # -- plain causal forward (no cache): logits [B, T, V]
    def forward(self, input_ids: torch.Tensor, *, router_logits: list | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        ctx = StepContext(commit_len=T, denoise_len=0, cos=cos, sin=sin, router_logits=router_logits)
        for layer in self.model.layers:
            x = layer(x, ctx, None)
        return self.lm_head(self.model.norm(x))

    # -- block-diffusion training forward (clean stream + noisy stream, vectorised over blocks)
    def forward_block_diffusion(
        self,
        clean_ids: torch.Tensor,
        noisy_ids: torch.Tensor,
        block_size: int,
        *,
        router_logits: list | None = None,
        noisy_logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """clean_ids [B, L], noisy_ids [B, k*L] (L a multiple of block_size; k >= 1 noisy copies of the
        sequence, e.g. k = 2 for complementary masks) -> (clean_logits [B, L, V], noisy_logits [B, k*L, V]).
        `noisy_logits_at` (bool [B, k*L]) computes the noisy logits only there: noisy_logits is then
        [N, V], the selected positions in row-major order (the LM head is a large share of training).

        Clean stream: causal, exactly commit mode, computed once however many noisy copies there are.
        Noisy block b of every copy (positions [b*Bs, (b+1)*Bs) of that copy) sees the clean prefix
        before it (attention: clean keys; GDN: the clean state and conv inputs at the block boundary)
        and itself bidirectionally -- exactly what the engine's denoise step computes with that prefix
        committed. Copies never see each other."""
        B, L = clean_ids.shape
        if noisy_ids.shape[0] != B or noisy_ids.shape[1] == 0 or noisy_ids.shape[1] % max(L, 1):
            raise ValueError(
                f"noisy_ids {tuple(noisy_ids.shape)} must be [B, k*L] for clean_ids {tuple(clean_ids.shape)}"
            )
        if L % block_size:
            raise ValueError(f"sequence length {L} is not a multiple of block_size {block_size}")
        k = noisy_ids.shape[1] // L
        dev = clean_ids.device
        pos = torch.arange(L, device=dev)
        positions = pos.repeat(k + 1).expand(B, (k + 1) * L)
        blk = pos // block_size
        causal = pos[None, :] <= pos[:, None]
        clean_before_block = pos[None, :] < (blk * block_size)[:, None]
        same_block = (blk[None, :] == blk[:, None]).to(torch.uint8)
        top = torch.cat([causal, torch.zeros(L, k * L, dtype=torch.bool, device=dev)], dim=1)
        own_copy = torch.kron(torch.eye(k, dtype=torch.uint8, device=dev), same_block).bool()  # [kL, kL]
        bottom = torch.cat([clean_before_block.repeat(k, 1), own_copy], dim=1)
        mask = torch.cat([top, bottom], dim=0)[None, None]  # [1, 1, (k+1)L, (k+1)L]
        x = self.model.embed_tokens(torch.cat([clean_ids, noisy_ids], dim=1))
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        ctx = StepContext(
            commit_len=L, denoise_len=k * L, cos=cos, sin=sin, router_logits=router_logits, train_block_size=block_size
        )
        for layer in self.model.layers:
            x = layer(x, ctx, None, attn_mask=mask)
        clean_x, noisy_x = x[:, :L], x[:, L:]
        if noisy_logits_at is not None:
            noisy_x = noisy_x[noisy_logits_at]
        return self.lm_head(self.model.norm(clean_x)), self.lm_head(self.model.norm(noisy_x))

    # -- the cached step: commit and/or denoise in one forward
    def step(
        self,
        cache: HybridCache,
        commit_ids: torch.Tensor | None = None,
        n_commit: torch.Tensor | None = None,
        denoise_ids: torch.Tensor | None = None,
        *,
        expert_budget: int | None = None,
        all_logits: bool = False,
        track_experts: bool = False,
        denoise_need: torch.Tensor | None = None,
    ) -> StepOutput:
        """One forward. `commit_ids [B, Tc]` (right-padded, `n_commit[b]` valid; None = all valid) are
        appended to `cache`; `denoise_ids [B, Bd]` is one block denoised against the updated cache.
        `denoise_need [B, Bd]` (bool) limits the denoise logits to those positions (others are garbage)."""
        parts = [p for p in (commit_ids, denoise_ids) if p is not None]
        if not parts:
            raise ValueError("step needs commit_ids, denoise_ids or both")
        ids = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        B = ids.shape[0]
        Tc = 0 if commit_ids is None else commit_ids.shape[1]
        Bd = 0 if denoise_ids is None else denoise_ids.shape[1]
        if n_commit is not None and Tc and bool((n_commit == Tc).all()):
            n_commit = None
        n = n_commit if n_commit is not None else torch.full((B,), Tc, dtype=torch.long, device=ids.device)
        start = cache.lengths
        pos = [start[:, None] + torch.arange(Tc, device=ids.device)] if Tc else []
        if Bd:
            pos.append((start + n)[:, None] + torch.arange(Bd, device=ids.device))
        positions = torch.cat(pos, dim=1)
        x = self.model.embed_tokens(ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        ctx = StepContext(
            commit_len=Tc,
            denoise_len=Bd,
            cos=cos,
            sin=sin,
            n_commit=n_commit,
            expert_budget=expert_budget,
            track_experts=track_experts,
        )
        for layer in self.model.layers:
            x = layer(x, ctx, cache)
        if Tc:
            cache.advance(n)
        commit_logits = denoise_logits = None
        if Tc:
            if all_logits:
                commit_logits = self.lm_head(self.model.norm(x[:, :Tc]))
            else:
                last = x[torch.arange(B, device=x.device), n - 1]  # [B, H]
                commit_logits = self.lm_head(self.model.norm(last))
        if Bd:
            if denoise_need is None:
                denoise_logits = self.lm_head(self.model.norm(x[:, Tc:]))
            else:  # only the positions whose predictions are still needed (masked next positions)
                h = x[:, Tc:][denoise_need]
                denoise_logits = x.new_empty(B, Bd, self.config.vocab_size)
                denoise_logits[denoise_need] = self.lm_head(self.model.norm(h))
        return StepOutput(commit_logits, denoise_logits, ctx.experts_touched)

    # -- initialisation for random/tiny models and training from scratch
    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float | None = None) -> None:
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = std if std is not None else self.config.initializer_range

        def normal_(t: torch.Tensor, s: float = std) -> None:
            t.copy_(torch.randn(t.shape, generator=gen) * s)

        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            elif leaf == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif leaf == "dt_bias":
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif leaf == "intra_scale":
                p.fill_(math.sqrt(self.config.linear_key_head_dim))
            elif leaf in ("block_gain_a", "block_gain_b") or "conv1d_right" in name:
                p.zero_()
            elif "conv1d" in name:
                normal_(p, 1.0 / math.sqrt(self.config.linear_conv_kernel_dim))
            else:
                normal_(p)


def build_model(config: CloverConfig, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32) -> CloverForCausalLM:
    """Build the module tree; on `meta` nothing is allocated (weights arrive via `load_state_dict(assign=True)`)."""
    with torch.device(device):
        model = CloverForCausalLM(config)
    if str(device) != "meta":
        model.to(dtype)
    return model
