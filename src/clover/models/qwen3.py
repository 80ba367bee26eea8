"""Qwen3 (dense; `Qwen3ForCausalLM`, model_type `qwen3`): Llama's stack of pre-norm decoder layers
(plain-weight RMSNorm, grouped-query attention with full RoPE, a SwiGLU MLP) with a per-head RMSNorm
on the queries and keys before RoPE (`q_norm`, `k_norm` over head_dim), `head_dim` its own key
(128 by default, not hidden/heads), and Qwen's tensor names (which are our parameter names).

The block-diffusion families built on it (SDAR / TraDo, `models/sdar.py`) read this stack as it is;
what differs is their decoding, data on their config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import CloverConfig, ConfigError
from .core import CausalLM
from .layers import DenseMLP, GatedAttention, PlainRMSNorm, apply_rope
from .llama import LlamaConfig, LlamaRotaryEmbedding
from .registry import Architecture


# SDAR / TraDo (model_type "sdar"; its MoE "sdar_moe"): Qwen3 trained for block diffusion. What its
# config.json may omit, at its reference's values (docs/checkpoints.md: each checked in its code)
SDAR_DEFAULTS = dict(block_size=4, mask_token_id=151669, threshold=0.9, logit_shift=0, block_grid="absolute",
                     commit_attention="block")
SDAR_TYPES = ("sdar", "sdar_moe")


@dataclass(kw_only=True)
class Qwen3Config(LlamaConfig):
    """A Qwen3 `config.json`, with Qwen3's defaults (head_dim 128, 32768 positions); RoPE read as
    Llama's (`rope_parameters` / `rope_scaling`). Sliding-window attention is refused. An SDAR
    config.json (model_type "sdar") is one too, with its `block_size` and `mask_token_id` and its
    authors' decoding defaults (`SDAR_DEFAULTS`)."""

    MODEL_TYPES = ("qwen3", "sdar")
    HF_ARCHITECTURE = "Qwen3ForCausalLM"

    @property
    def is_sdar(self) -> bool:
        return self.model_type in SDAR_TYPES

    @classmethod
    def read_keys(cls, d: dict, shown: dict, source: str) -> None:
        super().read_keys(d, shown, source)
        if d.get("model_type") in SDAR_TYPES:
            for k, v in SDAR_DEFAULTS.items():
                d.setdefault(k, v)

    head_dim: int | None = 128
    max_position_embeddings: int = 32768
    use_sliding_window: bool = False

    def validate(self) -> None:
        super().validate()
        if self.use_sliding_window:
            raise ConfigError(f"{self.model_type}: use_sliding_window is not supported (every layer attends to the whole context)")
        if self.denoise_adapter:
            raise ConfigError(f"{self.model_type}: denoise_adapter is Llama's; not supported here")

    def write_keys(self, d: dict) -> None:
        super().write_keys(d)
        d.pop("mlp_bias", None)  # Llama's key; Qwen3's MLP has no bias
        if self.is_sdar:  # its diffusion keys (a plain AR config.json drops them)
            d.update({k: getattr(self, k) for k in SDAR_DEFAULTS})
            d["architectures"] = ["SDARForCausalLM"]


class Qwen3Attention(GatedAttention):
    """Grouped-query attention without an output gate; q_norm/k_norm (plain RMSNorm over head_dim)
    before RoPE. The cached path (K/V written at each row's length, attention under the step's mask)
    is the family's."""

    def __init__(self, config: CloverConfig) -> None:
        nn.Module.__init__(self)
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=bias)
        self.q_norm = PlainRMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = PlainRMSNorm(self.head_dim, c.rms_norm_eps)

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, None

    def finish(self, out: torch.Tensor, gate: None) -> torch.Tensor:
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Qwen3ForCausalLM(CausalLM):
    """The Qwen3 stack under the model core (`step`, `forward_block_diffusion`, `make_cache`; its
    identity key layout and plain initialisation)."""

    attention_class = Qwen3Attention
    mlp_class = DenseMLP
    norm_class = PlainRMSNorm
    rotary_class = LlamaRotaryEmbedding
    live_positions = False  # its attention computes every position


ARCHITECTURE = Architecture(name="qwen3", config_class=Qwen3Config, model_class=Qwen3ForCausalLM)
