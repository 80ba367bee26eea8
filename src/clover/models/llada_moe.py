"""LLaDA-MoE (LLaDA-MoE-7B-A1B-Base / -Instruct; `LLaDAMoEModelLM`, model_type `lladamoe`, or `llada`
as its released config.json writes it): an OLMoE-style stack that is Qwen3-MoE's under Qwen3-MoE's
tensor names — per-head q/k RMSNorm before full RoPE, a softmax router over every layer's experts,
no shared expert — except that the router's top-k weights are never renormalised (its
`LLaDAMoESparseMoeBlock` fixes `norm_topk_prob` False whatever the config says). Read as LLaDA is:
attention both ways over the whole canvas (`commit_attention` "full"), position i predicts the token
at i (`logit_shift` 0), the mask token 156895, LLaDA's `generate` as its decoding (the canvas mode's
"even" schedule, low-confidence remasking, Gumbel noise above temperature 0).

Its modeling code's options that the released checkpoints leave off (a shared expert, a router expert
bias, dense layers in `moe_layer_freq`, partial RoPE, q/k clipping, no q/k norm) are refused with the
key named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..config import CanvasConfig, ConfigError
from .qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from .registry import Architecture

# LLaDA-MoE's config key -> ours
RENAMED = {"expert_intermediate_size": "moe_intermediate_size", "dense_intermediate_size": "intermediate_size"}
# its options the released checkpoints leave at these values (None: absent or null), the only ones built here
FIXED = {"shared_expert_intermediate_size": None, "moe_router_enable_expert_bias": (None, False), "clip_qkv": None,
         "partial_rotary_factor": (None, 1, 1.0), "qk_layernorm": (None, True)}


@dataclass(kw_only=True)
class LLaDAMoEConfig(CanvasConfig, Qwen3MoeConfig):
    """A LLaDA-MoE `config.json` (configuration_lladamoe.py's keys), read into Qwen3-MoE's fields
    (`RENAMED`; `head_dim` hidden / heads; `norm_topk_prob` always off, as its MoE block has it)."""

    MODEL_TYPES = ("lladamoe",)
    HF_ARCHITECTURE = "LLaDAMoEModelLM"
    canvas_schedule: ClassVar[str] = "even"  # LLaDA's generate: semi-AR blocks, the masks split evenly
    canvas_sampler: ClassVar[str] = "gumbel"  # its draw above temperature 0 (add_gumbel_noise, float64)

    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    mask_token_id: int | None = 156895
    logit_shift: int = 0

    @classmethod
    def read_keys(cls, d: dict, shown: dict, source: str) -> None:
        for key, allowed in FIXED.items():
            value = d.pop(key, None)
            if value not in (allowed if isinstance(allowed, tuple) else (allowed,)):
                raise ConfigError(f"{source}: lladamoe: {key}={value!r} is not supported (the released checkpoints "
                                  f"leave it off)")
        freq = d.pop("moe_layer_freq", None)
        if freq and not all(freq):
            raise ConfigError(f"{source}: lladamoe: moe_layer_freq {freq} has dense layers (not supported: every "
                              "layer sparse, as released)")
        for theirs, ours in RENAMED.items():
            if theirs in d:
                d[ours] = d.pop(theirs)
                shown[ours] = theirs
        if d.get("head_dim") is None and d.get("hidden_size") and d.get("num_attention_heads"):
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        d["norm_topk_prob"] = False  # LLaDAMoESparseMoeBlock: `self.norm_topk_prob = False`, the key unread
        super().read_keys(d, shown, source)

    def write_keys(self, d: dict) -> None:
        super().write_keys(d)
        for theirs, ours in RENAMED.items():
            d[theirs] = d.pop(ours)
        d.update(qk_layernorm=True, moe_layer_freq=[1] * self.num_hidden_layers)


class LLaDAMoEModelLM(Qwen3MoeForCausalLM):
    """The Qwen3-MoE stack, bidirectional over the canvas (its config's `commit_attention`)."""


# its released config.json says model_type "llada" (LLaDA's) with this architecture
ARCHITECTURE = Architecture(name="llada_moe", config_class=LLaDAMoEConfig, model_class=LLaDAMoEModelLM,
                            claims={"llada": "LLaDAMoEModelLM"})
