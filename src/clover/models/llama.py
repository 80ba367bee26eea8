"""Llama (`LlamaForCausalLM`, model_type `llama`): an attention-only stack of pre-norm decoder
layers (plain-weight RMSNorm, grouped-query attention with full RoPE, a SwiGLU MLP), with optional
RoPE scaling (`linear`, `llama3`) and tied or untied embeddings. SmolLM2, TinyLlama and the Llama
3.x family are of this kind.

The Clover denoise mode of an attention-only backbone needs no new parameter: the block attends to
the cached prefix and bidirectionally to itself (`cached_attention_mask`), its masked positions
hold the mask token, and the hidden state at position i predicts token i+1 (shift by one, as in
commit mode), so a converted checkpoint starts from the AR model itself. The cached `step`, the
block-diffusion training forward and `make_cache` are the family's (`qwen3_5.Qwen3_5ForCausalLM`);
this file supplies the layers and reads its own arguments (`LlamaArgs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import CloverConfig, ConfigError
from ..moe import BlockSharing
from .layers import GatedAttention, Segments, apply_rope
from .qwen3_5 import KeyLayout, Qwen3_5ForCausalLM

MODEL_TYPES = ("llama",)
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class LlamaArgs:
    """What a Llama layer reads from the config, with Llama's meaning (full rotary, plain norm weight)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, c: CloverConfig) -> "LlamaArgs":
        scaling = c.rope_scaling or None
        if scaling is not None:
            kind = scaling.get("rope_type", "default")
            if kind not in ROPE_TYPES:
                raise ConfigError(f"llama: rope type {kind!r} is not supported; expected one of {', '.join(ROPE_TYPES)}")
            need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                     "original_max_position_embeddings")}.get(kind, ())
            missing = [k for k in need if k not in scaling]
            if missing:
                raise ConfigError(f"llama: rope type {kind!r} needs {', '.join(missing)} in rope_parameters")
        return cls(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                   c.rms_norm_eps, c.rope_theta, scaling, c.attention_bias, c.mlp_bias)


def rope_inv_freq(args: LlamaArgs, device=None) -> torch.Tensor:
    """[head_dim/2] inverse frequencies, scaled as `rope_scaling` says (transformers' formulas)."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    s = args.rope_scaling or {}
    kind = s.get("rope_type", "default")
    if kind == "linear":
        return inv / s["factor"]
    if kind == "llama3":
        factor, lo, hi, old = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    return inv


class LlamaRotaryEmbedding(nn.Module):
    """Full RoPE (rotate-half) with Llama's scaled frequencies; same call as `layers.RotaryEmbedding`."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self._inv_freq: torch.Tensor | None = None  # not a buffer: nothing to load, nothing left on `meta`

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inv_freq(self.args, positions.device)
        freqs = positions[..., None].float() * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class LlamaRMSNorm(nn.Module):
    """y = w * (x * rsqrt(mean(x^2) + eps)), normalised in fp32, w initialised to 1."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class LlamaAttention(GatedAttention):
    """Grouped-query attention without output gate or q/k norms; the cached path (writing K/V at each
    row's length, attending under the step's mask) is the family's."""

    def __init__(self, args: LlamaArgs) -> None:
        nn.Module.__init__(self)
        a = args
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, a.num_attention_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_key_value_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_key_value_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(a.num_attention_heads * a.head_dim, a.hidden_size, bias=a.attention_bias)

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, None

    def finish(self, out: torch.Tensor, gate: None) -> torch.Tensor:
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        h, i, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """`h = x + attn(input_layernorm(x))`, `out = h + mlp(post_attention_layernorm(h))`."""

    layer_type = "full_attention"

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args)
        self.mlp = LlamaMLP(args)
        self.input_layernorm = LlamaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(args.hidden_size, args.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    def make_state(self, batch: int, capacity: int, *, dtype: torch.dtype, device):
        return self.self_attn.make_state(batch, capacity, dtype=dtype, device=device)

    def forward(self, x, rope, segments: Segments, *, mask=None, state=None, lengths=None,
                sharing: BlockSharing | None = None, count_experts: bool = False, static: bool = False,
                records: list | None = None):
        """-> (x, None): the layer interface of the family (no routing to report)."""
        h = self.self_attn(self.input_layernorm(x), rope, mask=mask, state=state, lengths=lengths,
                           commit_len=segments.commit_len)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), None


class LlamaModel(nn.Module):
    def __init__(self, config: CloverConfig, args: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, args.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(args)


class LlamaForCausalLM(Qwen3_5ForCausalLM):
    """The Llama stack under the family's causal LM: `forward`, `step` (commit and/or denoise),
    `forward_block_diffusion` and `make_cache` work unchanged over attention-only layers."""

    key_layout = KeyLayout()  # HF Llama keys are our parameter names

    def __init__(self, config: CloverConfig) -> None:
        nn.Module.__init__(self)
        if any(t != "full_attention" for t in config.layer_types):
            raise ConfigError("llama: every layer is full attention; layer_types lists other kinds")
        self.config = config
        self.args = LlamaArgs.from_config(config)
        self.model = LlamaModel(config, self.args)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float | None = None) -> None:
        """normal(0, std) for matrices and embeddings, zero biases, norms at 1."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = std if std is not None else self.config.initializer_range
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def model_class(config: CloverConfig) -> type[nn.Module]:
    return LlamaForCausalLM
