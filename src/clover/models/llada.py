"""LLaDA (LLaDA-8B-Base / -Instruct, LLaDA-1.5; model_type `llada`, `LLaDAModelLM`): a Llama-style
stack (plain-weight RMSNorm, multi-head attention with full RoPE, a SwiGLU MLP, no biases) stored
under OLMo's names (`model.transformer.blocks.N.*`, `wte`, `ln_f`, `ff_out`) and configured with
OLMo's keys (`d_model`, `n_heads`, `n_layers`, `mlp_hidden_size`, ...), read as a whole-sequence
masked diffusion model: every position attends to every other over the whole canvas
(`commit_attention` "full"), position i predicts the token at i itself (`logit_shift` 0), the mask
token is 126336, and the checkpoint decodes with the canvas mode (`clover.decoding.canvas`:
LLaDA's `generate`, low-confidence remasking over semi-autoregressive blocks).

The OLMo options the released checkpoints do not use (ALiBi, sequential blocks, biases, q/k norms,
scaled logits or embeddings, block groups) are refused with the key named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from ..config import CanvasConfig, ConfigError
from .core import CausalLM, KeyLayout
from .layers import DenseMLP, PlainRMSNorm
from .llama import LlamaAttention, LlamaConfig, LlamaRotaryEmbedding
from .registry import Architecture

# LLaDA's config key -> ours
RENAMED = {"d_model": "hidden_size", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
           "n_layers": "num_hidden_layers", "mlp_hidden_size": "intermediate_size",
           "max_sequence_length": "max_position_embeddings", "weight_tying": "tie_word_embeddings"}
# the OLMo options LLaDA's checkpoints leave at these values, and the only ones built here
FIXED = {"block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "rope": True, "alibi": False,
         "include_bias": False, "attention_layer_norm": False, "input_emb_norm": False, "scale_logits": False,
         "block_group_size": 1, "layer_norm_with_affine": True, "bias_for_layer_norm": False,
         "multi_query_attention": None}


@dataclass(kw_only=True)
class LLaDAConfig(CanvasConfig, LlamaConfig):
    """A LLaDA `config.json` (configuration_llada.py's `ModelConfig` keys), read into the Llama fields
    (`RENAMED`; `embedding_size`, the stored vocabulary, is the vocabulary; `n_kv_heads` null: one
    per head); the options in `FIXED` must hold their values; `include_qkv_bias` is kept."""

    MODEL_TYPES = ("llada",)
    HF_ARCHITECTURE = "LLaDAModelLM"
    canvas_schedule: ClassVar[str] = "even"  # how the canvas mode paces the unmasking (semi-AR blocks, even split)
    canvas_sampler: ClassVar[str] = "gumbel"  # its draw above temperature 0 (add_gumbel_noise, float64)

    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    include_qkv_bias: bool = False
    mask_token_id: int | None = 126336
    logit_shift: int = 0

    @property
    def qkv_bias(self) -> bool:
        return self.include_qkv_bias

    @classmethod
    def read_keys(cls, d: dict, shown: dict, source: str) -> None:
        for key, value in FIXED.items():
            if key in d and d[key] != value:
                raise ConfigError(f"{source}: llada: {key}={d[key]!r} is not supported (the released checkpoints' "
                                  f"{value!r} only)")
            d.pop(key, None)
        if d.get("mlp_hidden_size") is None and "d_model" in d:
            d["mlp_hidden_size"] = d.get("mlp_ratio", 4) * d["d_model"]
        if d.get("n_kv_heads") is None and "n_heads" in d:
            d["n_kv_heads"] = d["n_heads"]
        if d.get("embedding_size"):
            d["vocab_size"] = d["embedding_size"]
            shown["vocab_size"] = "embedding_size"
        for theirs, ours in RENAMED.items():
            if theirs in d:
                d[ours] = d.pop(theirs)
                shown[ours] = theirs
        super().read_keys(d, shown, source)

    def write_keys(self, d: dict) -> None:
        super().write_keys(d)
        theta = d.pop("rope_parameters")["rope_theta"]
        for k in ("mlp_bias", "attention_bias", "denoise_adapter", "head_dim", "hidden_act"):
            d.pop(k, None)
        for theirs, ours in RENAMED.items():
            d[theirs] = d.pop(ours)
        d.update(FIXED, rope_theta=theta, embedding_size=d["vocab_size"])

    def validate(self) -> None:
        super().validate()
        if self.rope_scaling is not None:
            raise ConfigError("llada: rope scaling is not part of the family (rope_theta only)")
        if self.attention_bias or self.mlp_bias or self.denoise_adapter:
            raise ConfigError("llada: attention_bias / mlp_bias / denoise_adapter are Llama's keys, not LLaDA's")


class LLaDAKeyLayout(KeyLayout):
    """OLMo's tensor names -> ours (a checkpoint saved by clover, under our names, loads as it is)."""

    BLOCK = {"attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm", "q_proj": "self_attn.q_proj",
             "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj", "attn_out": "self_attn.o_proj",
             "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "ff_out": "mlp.down_proj"}
    TOP = {"model.transformer.wte.weight": "model.embed_tokens.weight", "model.transformer.ln_f.weight": "model.norm.weight",
           "model.transformer.ff_out.weight": "lm_head.weight"}
    PATTERN = re.compile(r"model\.transformer\.blocks\.(\d+)\.(\w+)\.(weight|bias)")

    def name(self, key: str) -> str | None:
        if key in self.TOP:
            return self.TOP[key]
        m = self.PATTERN.fullmatch(key)
        if m and m.group(2) in self.BLOCK:
            return f"model.layers.{m.group(1)}.{self.BLOCK[m.group(2)]}.{m.group(3)}"
        return key


class LLaDAModelLM(CausalLM):
    """The stack under the model core, bidirectional over the canvas (its config's `commit_attention`)."""

    attention_class = LlamaAttention  # q/k/v biases from `include_qkv_bias`
    mlp_class = DenseMLP
    norm_class = PlainRMSNorm
    rotary_class = LlamaRotaryEmbedding  # full RoPE from the config (Llama's frequencies)
    key_layout = LLaDAKeyLayout()
    live_positions = False  # its attention computes every position


ARCHITECTURE = Architecture(name="llada", config_class=LLaDAConfig, model_class=LLaDAModelLM)
