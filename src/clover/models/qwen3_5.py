"""Qwen3.5 (dense): the hybrid stack — Gated DeltaNet and gated full attention, 3:1 by default — with a
dense SwiGLU MLP per layer. model_type `qwen3_5_text` (`Qwen3_5ForCausalLM`) or `qwen3_5` (the
multimodal `Qwen3_5ForConditionalGeneration`, text config in `text_config`).

This file holds the family's own parts on top of the model core (`core.py`: the decoder stack, the
cached `step`, the training forward, `make_cache`): its arguments (`Qwen3_5Config`), its layers
(named as the core's class hooks), its initialisation (zero-centred norms, the GDN decay and step)
and its checkpoint key layout (the multimodal wrapper's prefixes). `qwen3_5_moe.py` swaps the MLP for
the sparse MoE; `clover.py` adds the denoise parameters to either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import CloverConfig, ConfigError
from .core import CausalLM, KeyLayout
from .registry import Architecture, VLLMSupport
from .layers import (
    DenseMLP,
    GatedAttention,
    GatedDeltaNet,
    RMSNorm,
    RotaryEmbedding,
    denoise_parameters,
)

MULTIMODAL = {"qwen3_5": "qwen3_5_text"}  # the multimodal model_type -> the text model in its `text_config`


# --------------------------------------------------------------------------- arguments
@dataclass(kw_only=True)
class Qwen3_5Config(CloverConfig):
    """The text part of a Qwen3.5 `config.json` (the hybrid stack with a dense SwiGLU MLP), with
    Qwen3.5's defaults (partial RoPE at 0.25, theta 1e7, a full-attention layer every 4)."""

    MODEL_TYPES = ("qwen3_5_text",)
    HF_ARCHITECTURE = "Qwen3_5ForCausalLM"

    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    # the sparse MoE's keys (`Qwen3_5MoeConfig` requires them); 0 for the dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    hidden_act: str = "silu"

    def derive(self) -> None:
        if self.full_attention_interval <= 0:
            raise ConfigError(f"invalid config: full_attention_interval must be positive, got {self.full_attention_interval}")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            n = self.full_attention_interval
            self.layer_types = ["full_attention" if (i + 1) % n == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]

    def validate(self) -> None:
        super().validate()

        def bad(msg: str) -> None:
            raise ConfigError(f"invalid config: {msg}")

        for name in ("head_dim", "max_position_embeddings", "linear_conv_kernel_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "full_attention_interval", "rms_norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive, got {getattr(self, name)}")
        for name in self.mlp_fields():
            if getattr(self, name) < 0:
                bad(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (0 < self.partial_rotary_factor <= 1):
            bad(f"partial_rotary_factor must lie in (0, 1], got {self.partial_rotary_factor}")
        if len(self.layer_types) != self.num_hidden_layers:
            bad(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        unknown = set(self.layer_types) - {"full_attention", "linear_attention"}
        if unknown:
            bad(f"unknown layer types {sorted(unknown)}; expected 'full_attention' or 'linear_attention'")
        if self.num_attention_heads % self.num_key_value_heads:
            bad(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            bad(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of linear_num_key_heads ({self.linear_num_key_heads})")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            bad(f"partial_rotary_factor {self.partial_rotary_factor} gives an odd or too large rotary dim {self.rotary_dim}")

    @classmethod
    def mlp_fields(cls) -> tuple[str, ...]:
        return ("intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size")

    # the other MLP's keys, not written into this one's config.json
    UNUSED_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                   "router_aux_loss_coef")

    @property
    def has_linear_attention(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def has_gated_attention(self) -> bool:
        return True  # GatedAttention: the family's full-attention layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def read_keys(cls, d: dict, shown: dict, source: str) -> None:
        """`rope_parameters` (or the older `rope_scaling`): theta and the partial rotary factor;
        only the default RoPE."""
        rope_key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
        rope = d.get(rope_key) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: {shown.get(rope_key, rope_key)!r} must be an object, got {rope!r}")
        where = shown.get(rope_key, rope_key)
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in rope and key not in d:
                d[key] = rope[key]
                shown[key] = f"{where}.{key}"
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (only the default RoPE)")

    def write_keys(self, d: dict) -> None:
        for k in self.UNUSED_KEYS:
            d.pop(k)
        d.pop("full_attention_interval")
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta"),
                                "partial_rotary_factor": d.pop("partial_rotary_factor")}

# --------------------------------------------------------------------------- key layout
class Qwen3_5KeyLayout(KeyLayout):
    """The multimodal checkpoints keep the text model under `model.language_model.*` and carry a
    vision tower and an MTP head, which are skipped."""

    skipped_prefixes = ("model.visual.", "visual.", "mtp.", "model.mtp.")
    text_prefix = "model.language_model."

    def name(self, key: str) -> str | None:
        if key.startswith(self.skipped_prefixes):
            return None
        if key.startswith(self.text_prefix):
            return "model." + key[len(self.text_prefix) :]
        return key


# --------------------------------------------------------------------------- model
class Qwen3_5ForCausalLM(CausalLM):
    # the family's parts (another member swaps any of them)
    attention_class = GatedAttention
    linear_attention_class = GatedDeltaNet
    mlp_class = DenseMLP
    norm_class = RMSNorm  # zero-centred
    rotary_class = RotaryEmbedding  # partial RoPE
    key_layout = Qwen3_5KeyLayout()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float | None = None) -> None:
        """Random weights (normal(0, std) for matrices; the GDN decay and step drawn as in the
        reference; norms at their identity), and Clover's parameters at their initial values.
        Values are drawn on the CPU (reproducible across devices) and copied in place."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = std if std is not None else self.config.initializer_range
        denoise = denoise_parameters(self.config) if self.config.is_clover else {}

        def normal_(t: torch.Tensor, s: float = std) -> None:
            t.copy_(torch.randn(t.shape, generator=gen) * s)

        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            own = name.split("linear_attn.", 1)[-1] if "linear_attn." in name else None
            if own in denoise:
                p.copy_(denoise[own])
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            elif leaf == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif leaf == "dt_bias":
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif "conv1d" in name:
                normal_(p, 1.0 / math.sqrt(self.config.linear_conv_kernel_dim))
            else:
                normal_(p)


ARCHITECTURE = Architecture(
    name="qwen3_5", config_class=Qwen3_5Config, model_class=Qwen3_5ForCausalLM, multimodal=MULTIMODAL,
    vllm=VLLMSupport("CloverDenseForCausalLM", "vllm.model_executor.models.qwen3_5:Qwen3_5ForCausalLM",
                     "transformers.models.qwen3_5.configuration_qwen3_5:Qwen3_5TextConfig"),
)
