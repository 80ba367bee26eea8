"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`, model_type `qwen2`): Llama's stack of pre-norm decoder layers
(plain-weight RMSNorm, grouped-query attention with full RoPE, a SwiGLU MLP) with a bias on the
query, key and value projections only (never on the output projection nor the MLP), no per-head
q/k norm, head_dim = hidden / heads, and Qwen's tensor names (which are our parameter names).

Dream (`models/dream.py`) is this stack read bidirectionally over a whole canvas; what differs is
data on its config.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError
from .core import CausalLM
from .layers import DenseMLP, PlainRMSNorm
from .llama import LlamaAttention, LlamaConfig, LlamaRotaryEmbedding
from .registry import Architecture


@dataclass(kw_only=True)
class Qwen2Config(LlamaConfig):
    """A Qwen2 `config.json`, with Qwen2's defaults (32768 positions); RoPE read as Llama's.
    Sliding-window attention is refused (`use_sliding_window`); `sliding_window` and
    `max_window_layers` are kept as written."""

    MODEL_TYPES = ("qwen2",)
    HF_ARCHITECTURE = "Qwen2ForCausalLM"

    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28

    @property
    def qkv_bias(self) -> bool:
        return True  # Qwen2's q/k/v projections always carry a bias (its config has no key for it)

    def validate(self) -> None:
        if self.use_sliding_window:
            raise ConfigError(f"{self.model_type}: use_sliding_window is not supported (every layer attends to the whole context)")
        super().validate()
        if self.attention_bias or self.mlp_bias:
            raise ConfigError(f"{self.model_type}: attention_bias / mlp_bias are Llama's keys; Qwen2's biases are fixed (q/k/v only)")
        if self.denoise_adapter:
            raise ConfigError(f"{self.model_type}: denoise_adapter is Llama's; not supported here")

    def write_keys(self, d: dict) -> None:
        super().write_keys(d)
        for k in ("mlp_bias", "attention_bias", "denoise_adapter"):
            d.pop(k, None)


class Qwen2ForCausalLM(CausalLM):
    """The Qwen2 stack under the model core (`step`, `forward_block_diffusion`, `make_cache`; its
    identity key layout and plain initialisation)."""

    attention_class = LlamaAttention  # q/k/v biases from the config's `qkv_bias`
    mlp_class = DenseMLP
    norm_class = PlainRMSNorm
    rotary_class = LlamaRotaryEmbedding
    live_positions = False  # its attention computes every position


ARCHITECTURE = Architecture(name="qwen2", config_class=Qwen2Config, model_class=Qwen2ForCausalLM)
