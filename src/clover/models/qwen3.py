"""Qwen3 (dense; `Qwen3ForCausalLM`, model_type `qwen3`): Llama's stack of pre-norm decoder layers
(plain-weight RMSNorm, grouped-query attention with full RoPE, a SwiGLU MLP) with a per-head RMSNorm
on the queries and keys before RoPE (`q_norm`, `k_norm` over head_dim), `head_dim` its own key
(128 by default, not hidden/heads), and Qwen's tensor names (which are our parameter names).

The block-diffusion families built on it (SDAR / TraDo, `models/sdar.py`) read this stack as it is;
what differs is their decoding, data on their config.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError
from .core import CausalLM
from .layers import DenseMLP, PlainRMSNorm
from .llama import LlamaAttention, LlamaConfig, LlamaRotaryEmbedding
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


class Qwen3Attention(LlamaAttention):
    """Llama's grouped-query attention (no output gate) with q_norm/k_norm (plain RMSNorm over
    head_dim) before RoPE; its cached and live paths are the family's."""

    qk_norm = True


class Qwen3ForCausalLM(CausalLM):
    """The Qwen3 stack under the model core (`step`, `forward_block_diffusion`, `make_cache`; its
    identity key layout and plain initialisation). Its layers take `live` (it has no denoise adapter)."""

    attention_class = Qwen3Attention
    mlp_class = DenseMLP
    norm_class = PlainRMSNorm
    rotary_class = LlamaRotaryEmbedding
    live_positions = True  # an eager cached forward computes only the positions it needs (`core.Live`)


ARCHITECTURE = Architecture(name="qwen3", config_class=Qwen3Config, model_class=Qwen3ForCausalLM)
