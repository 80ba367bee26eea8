"""LLaDA2.x (inclusionAI; model_type `llada2_moe`): the BailingMoeV2 (Ling 2.0) stack trained for block
diffusion. Per layer a pre-norm attention with one fused `query_key_value` projection, per-head q/k
RMSNorm (`query_layernorm`, `key_layernorm`), partial RoPE (`partial_rotary_factor`, 0.5) and an
output projection `dense` (with a bias when `use_bias`); then the first `first_k_dense_replace`
layers a dense SwiGLU MLP, the others a sparse MoE: router logits in fp32, `sigmoid`, experts chosen
on the scores plus `expert_bias` by group-limited top-k (`n_group` groups ranked by their two best
scores, the `topk_group` best kept, top-k among their experts), weighted by the plain scores
renormalised over the k and times `routed_scaling_factor`, plus `num_shared_experts` shared experts
(one SwiGLU of that many times the expert width). Its tensors: `model.word_embeddings`,
`model.layers.N.attention.*`, `mlp.gate.weight` / `mlp.gate.expert_bias`, `mlp.experts.N.*` (stacked
at load), `mlp.shared_experts.*`.

Its decoding is SDAR's (no logit shift, the absolute block grid, a block-causal commit), with its
reference's defaults: block 32, threshold 0.95, mask 156895 (docs/checkpoints.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import CloverConfig, ConfigError
from ..moe import BlockSharing, block_experts, dispatch_experts
from .core import CausalLM
from .layers import MLP, DenseMLP, ExpertStats, Experts, GatedAttention, PlainRMSNorm, RotaryEmbedding, apply_rope
from .qwen3_5_moe import MoeKeyLayout
from .registry import Architecture

LLADA2_DEFAULTS = dict(block_size=32, mask_token_id=156895, threshold=0.95, logit_shift=0, block_grid="absolute",
                       commit_attention="block")


@dataclass(kw_only=True)
class LLaDA2Config(CloverConfig):
    """A LLaDA2 `config.json` (`LLaDA2MoeConfig`'s keys and defaults), with its authors' decoding
    defaults (`LLADA2_DEFAULTS`) where the file omits them."""

    MODEL_TYPES = ("llada2_moe",)
    HF_ARCHITECTURE = "LLaDA2MoeModelLM"

    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int = 0  # the first_k_dense_replace dense layers' MLP
    head_dim: int | None = None
    num_shared_experts: int | None = 0
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 0
    use_qkv_bias: bool = False
    use_qk_norm: bool = True
    use_bias: bool = True
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 16384
    hidden_act: str = "silu"
    layer_types: list[str] | None = None  # every layer "full_attention"

    def derive(self) -> None:
        self.derive_full_attention()

    def validate(self) -> None:
        super().validate()
        bad = lambda msg: ConfigError(f"llada2_moe: {msg}")  # noqa: E731
        if self.rope_scaling:
            raise bad(f"rope_scaling {self.rope_scaling!r} is not supported (the default RoPE only)")
        if not self.use_qk_norm:
            raise bad("use_qk_norm false is not supported")
        if self.hidden_act != "silu":
            raise bad(f"hidden_act {self.hidden_act!r} is not supported (silu only)")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise bad(f"num_experts ({self.num_experts}) must split into n_group ({self.n_group}) groups, "
                      f"topk_group ({self.topk_group}) of them at most")
        if self.num_experts_per_tok > self.num_experts // self.n_group * self.topk_group:
            raise bad("num_experts_per_tok exceeds the experts of the topk_group groups")
        if self.first_k_dense_replace and self.intermediate_size <= 0:
            raise bad(f"first_k_dense_replace {self.first_k_dense_replace} needs intermediate_size for those layers")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise bad(f"partial_rotary_factor {self.partial_rotary_factor} gives an odd or too large rotary dim")

    @property
    def has_experts(self) -> bool:
        return True

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size * (self.num_shared_experts or 0)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def read_keys(cls, d: dict, shown: dict, source: str) -> None:
        for k, v in LLADA2_DEFAULTS.items():
            d.setdefault(k, v)

    def write_keys(self, d: dict) -> None:
        d.update({k: getattr(self, k) for k in LLADA2_DEFAULTS})
        d.pop("layer_types")


class LLaDA2Attention(GatedAttention):
    """Fused `query_key_value` ([q heads | k heads | v heads] x head_dim), per-head q/k RMSNorm, partial
    RoPE, output `dense`; the cached path is the family's."""

    def __init__(self, config: CloverConfig) -> None:
        nn.Module.__init__(self)
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.query_key_value = nn.Linear(c.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                                         bias=c.use_qkv_bias)
        self.query_layernorm = PlainRMSNorm(self.head_dim, c.rms_norm_eps)
        self.key_layernorm = PlainRMSNorm(self.head_dim, c.rms_norm_eps)
        self.dense = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=c.use_bias)

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        B, T, _ = x.shape
        qkv = self.query_key_value(x).view(B, T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        q = self.query_layernorm(q).transpose(1, 2)
        k = self.key_layernorm(k).transpose(1, 2)
        cos, sin = rope
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.transpose(1, 2), None

    def finish(self, out: torch.Tensor, gate: None) -> torch.Tensor:
        B, _, T, _ = out.shape
        return self.dense(out.transpose(1, 2).reshape(B, T, -1))

    # the live path (`core.Live`): K/V at its kv positions, queries at its out positions, each from
    # its rows of the fused projection (no position computes a part it does not use)
    def _fused(self, x: torch.Tensor, part: slice) -> torch.Tensor:
        lin = self.query_key_value
        if isinstance(lin, nn.Linear):
            return F.linear(x, lin.weight[part], None if lin.bias is None else lin.bias[part])
        return lin(x)[:, part]  # a quantized projection: the whole, then its part

    def live_kv(self, xk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        N, H, Hkv, D = xk.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        k, v = self._fused(xk, slice(H * D, None)).view(N, 2 * Hkv, D).split([Hkv, Hkv], dim=1)
        return apply_rope(self.key_layernorm(k)[:, :, None], cos, sin)[:, :, 0], v

    def live_q(self, xo: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q = self._fused(xo, slice(0, self.num_heads * self.head_dim)).view(xo.shape[0], self.num_heads, self.head_dim)
        return apply_rope(self.query_layernorm(q)[:, :, None], cos, sin)[:, :, 0], None

    def live_finish(self, o: torch.Tensor, gate: None) -> torch.Tensor:
        return self.dense(o)


class LLaDA2Router(nn.Module):
    """The sigmoid router with its expert bias and group-limited top-k (`mlp.gate`). With block expert
    sharing, a denoise token chooses among its block's shared experts (`moe.block_experts`, ranked on
    the scores plus the bias, the values the router chooses by) in place of its groups: both limit a
    token to a subset, and a group limit inside a set of `budget` experts could leave it fewer than k."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        c = config
        self.top_k, self.n_group, self.topk_group, self.scale = (c.num_experts_per_tok, c.n_group, c.topk_group,
                                                                 c.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))
        self.expert_bias = nn.Parameter(torch.zeros(c.num_experts), requires_grad=False)  # a buffer in the reference

    def forward(self, x: torch.Tensor, sharing: BlockSharing | None = None):
        """x [N, H] -> (weights [N, k] fp32, indices [N, k], logits [N, E] fp32)."""
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        routing = scores + self.expert_bias.float()
        N, E = routing.shape
        groups = routing.view(N, self.n_group, E // self.n_group).topk(2, dim=-1).values.sum(-1)  # [N, n_group]
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(self.topk_group, dim=-1).indices, 1.0)
        allowed = keep[:, :, None].expand(N, self.n_group, E // self.n_group).reshape(N, E).bool()
        shared = block_experts(routing, sharing) if sharing is not None else None
        if shared is not None:
            allowed = allowed.view(sharing.rows, -1, E).clone()
            allowed[:, sharing.denoise_from:] = shared[:, None, :]
            allowed = allowed.view(N, E)
        idx = routing.masked_fill(~allowed, float("-inf")).topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.top_k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scale, idx, logits


class LLaDA2MoE(nn.Module):
    """The sparse MoE layer: `gate` (the router), routed `experts` (dispatched as every MoE family's,
    `moe.dispatch_experts`) and the shared experts. Same call as the family's MLPs."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        c = config
        self.num_experts = c.num_experts
        self.gate = LLaDA2Router(c)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size)
        self.shared_experts = MLP(c.hidden_size, c.shared_expert_intermediate_size) if c.num_shared_experts else None

    def forward(self, x: torch.Tensor, sharing: BlockSharing | None = None, count_experts: bool = False,
                static: bool = False):
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        w, idx, logits = self.gate(flat, sharing)
        out, touched = dispatch_experts(self.experts, flat, idx, w.to(x.dtype), count_experts, static)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(B, T, H), ExpertStats(logits, touched)


class LLaDA2DenseMLP(DenseMLP):
    """The first `first_k_dense_replace` layers' MLP (the dense backbone's SwiGLU)."""


class LLaDA2KeyLayout(MoeKeyLayout):
    """`model.word_embeddings` -> `model.embed_tokens`, `model.layers.N.attention.*` -> `.self_attn.*`;
    experts stored one by one are stacked (`MoeKeyLayout`)."""

    def name(self, key: str) -> str | None:
        key = key.replace("model.word_embeddings.", "model.embed_tokens.", 1).replace(".attention.", ".self_attn.", 1)
        return super().name(key)


class LLaDA2ForCausalLM(CausalLM):
    attention_class = LLaDA2Attention
    mlp_class = LLaDA2MoE
    norm_class = PlainRMSNorm
    rotary_class = RotaryEmbedding  # partial: config.rotary_dim
    key_layout = LLaDA2KeyLayout()

    @classmethod
    def mlp_class_for(cls, config: CloverConfig, layer_idx: int) -> type[nn.Module]:
        return LLaDA2DenseMLP if layer_idx < config.first_k_dense_replace else LLaDA2MoE


ARCHITECTURE = Architecture(name="bailing_moe_v2", config_class=LLaDA2Config, model_class=LLaDA2ForCausalLM)
