"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`, model_type `qwen2`): Llama's stack of pre-norm decoder layers
(plain-weight RMSNorm, grouped-query attention with full RoPE, a SwiGLU MLP) with a bias on the
query, key and value projections only (never on the output projection nor the MLP), no per-head
q/k norm, head_dim = hidden / heads, and Qwen's tensor names (which are our parameter names).

Dream (`models/dream.py`) is this stack read bidirectionally over a whole canvas; what differs is
data on its config. Fast-dLLM v2 (NVlabs; model_type `Fast_dLLM_Qwen`, `Fast_dLLM_QwenForCausalLM`:
Efficient-Large-Model/Fast_dLLM_v2_1.5B and _7B) is this stack trained for block diffusion; its
config.json is read here with its block size under `bd_size` and its authors' decoding
(`FAST_DLLM_DEFAULTS`, docs/checkpoints.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError
from .core import CausalLM
from .layers import DenseMLP, PlainRMSNorm
from .llama import LlamaAttention, LlamaConfig, LlamaRotaryEmbedding
from .registry import Architecture

# Fast-dLLM v2 (model_type "Fast_dLLM_Qwen"): what its config.json omits, at its reference's values (its
# remote modeling.py `generate` and model card: mask "|<MASK>|" 151665, blocks of 32 denoised in
# sub-blocks of 8, a position taken above 0.9 or as its sub-block's most confident; position i predicts
# token i+1; the absolute grid; a finished block committed block-causally, whose last position's
# argmax is the next block's first token)
FAST_DLLM_TYPE = "Fast_dLLM_Qwen"
FAST_DLLM_DEFAULTS = dict(block_size=32, sub_block=8, mask_token_id=151665, threshold=0.9, logit_shift=1,
                          block_grid="absolute", commit_attention="block", first_token="commit_argmax")


@dataclass(kw_only=True)
class Qwen2Config(LlamaConfig):
    """A Qwen2 `config.json`, with Qwen2's defaults (32768 positions); RoPE read as Llama's.
    Sliding-window attention is refused (`use_sliding_window`); `sliding_window` and
    `max_window_layers` are kept as written. A Fast-dLLM v2 config.json (model_type
    "Fast_dLLM_Qwen") is one too: its `bd_size` is the block size, the rest its authors' decoding
    defaults (`FAST_DLLM_DEFAULTS`)."""

    MODEL_TYPES = ("qwen2", FAST_DLLM_TYPE)
    HF_ARCHITECTURE = "Qwen2ForCausalLM"

    @classmethod
    def read_keys(cls, d: dict, shown: dict, source: str) -> None:
        super().read_keys(d, shown, source)
        if d.get("model_type") == FAST_DLLM_TYPE:
            if "bd_size" in d:
                d.setdefault("block_size", d.pop("bd_size"))
                shown["block_size"] = "bd_size"
            for k, v in FAST_DLLM_DEFAULTS.items():
                d.setdefault(k, v)

    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28

    @property
    def qkv_bias(self) -> bool:
        return True  # Qwen2's q/k/v projections always carry a bias (its config has no key for it)

    @property
    def fills_after_eos(self) -> bool:
        return self.model_type != FAST_DLLM_TYPE  # its generate leaves the positions after a stop token as they are

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
        if self.model_type == FAST_DLLM_TYPE:  # its diffusion keys (a plain AR config.json drops them)
            d.update({k: getattr(self, k) for k in FAST_DLLM_DEFAULTS if k != "block_size"})
            d["bd_size"] = self.block_size
            d["architectures"] = ["Fast_dLLM_QwenForCausalLM"]
            rope = d.pop("rope_parameters")  # its configuration.py reads rope_theta / rope_scaling, not rope_parameters
            d["rope_theta"] = rope.pop("rope_theta")
            d["rope_scaling"] = None if rope == {"rope_type": "default"} else rope


class Qwen2ForCausalLM(CausalLM):
    """The Qwen2 stack under the model core (`step`, `forward_block_diffusion`, `make_cache`; its
    identity key layout and plain initialisation). Its layers take `live` (it has no denoise adapter)."""

    attention_class = LlamaAttention  # q/k/v biases from the config's `qkv_bias`
    mlp_class = DenseMLP
    norm_class = PlainRMSNorm
    rotary_class = LlamaRotaryEmbedding
    live_positions = True  # an eager cached forward computes only the positions it needs (`core.Live`)


ARCHITECTURE = Architecture(name="qwen2", config_class=Qwen2Config, model_class=Qwen2ForCausalLM)
