"""Qwen3.5/3.6-MoE: the Qwen3.5 hybrid stack (`qwen3_5.py`) with the sparse MoE in place of the dense
MLP — router `softmax(x Wᵀ)` → top-k → renormalise, routed experts stored fused
(`mlp.experts.gate_up_proj [E, 2I, H]`, gate rows first; `mlp.experts.down_proj [E, H, I]`), and a
shared expert behind a sigmoid gate. model_type `qwen3_5_moe_text` (`Qwen3_5MoeForCausalLM`) or
`qwen3_5_moe` (the multimodal `Qwen3_5MoeForConditionalGeneration`).

Key layout: as Qwen3.5, plus experts stored one by one (`mlp.experts.N.{gate,up,down}_proj.weight`,
older and other exports) are stacked into the fused layout at load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..config import ConfigError
from .layers import SparseMoE
from .qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5KeyLayout
from .registry import Architecture, VLLMSupport

MULTIMODAL = {"qwen3_5_moe": "qwen3_5_moe_text"}


@dataclass(kw_only=True)
class Qwen3_5MoeConfig(Qwen3_5Config):
    """The text part of a Qwen3.5/3.6-MoE `config.json`: Qwen3.5's, with the sparse MoE's keys."""

    MODEL_TYPES = ("qwen3_5_moe_text",)
    HF_ARCHITECTURE = "Qwen3_5MoeForCausalLM"

    UNUSED_KEYS = ("intermediate_size",)

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int = 0  # the dense MLP's

    @property
    def has_experts(self) -> bool:
        return True

    def validate(self) -> None:
        super().validate()
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"invalid config: num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})")
        if self.expert_budget is not None and not (self.num_experts_per_tok <= self.expert_budget <= self.num_experts):
            raise ConfigError(f"invalid config: expert_budget must lie in [num_experts_per_tok, num_experts], got {self.expert_budget}")


def full_size_config() -> Qwen3_5MoeConfig:
    """The Qwen3.5/3.6-35B-A3B text config (used for accounting and meta-device tests)."""
    return Qwen3_5MoeConfig(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=262144,
        rope_theta=10_000_000.0, partial_rotary_factor=0.25,
    )
PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


class MoeKeyLayout(Qwen3_5KeyLayout):
    def expert_part(self, name: str) -> tuple[str, int, str] | None:
        m = PER_EXPERT.match(name)
        return (m.group(1), int(m.group(2)), m.group(3)) if m else None

    def stack_experts(self, prefix: str, experts: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """{expert: {part: weight}} of one layer -> the fused `gate_up_proj` / `down_proj`.
        Raises ValueError naming the first incomplete expert."""
        n = len(experts)
        for e in range(n):
            if e not in experts or set(experts[e]) != set(EXPERT_PARTS):
                raise ValueError(f"expert {e} of {prefix} is incomplete (needs gate_proj, up_proj, down_proj)")
        gate_up = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], 0) for e in range(n)])
        down = torch.stack([experts[e]["down_proj"] for e in range(n)])
        return {prefix + ".gate_up_proj": gate_up, prefix + ".down_proj": down}


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    mlp_class = SparseMoE
    key_layout = MoeKeyLayout()



ARCHITECTURE = Architecture(
    name="qwen3_5_moe", config_class=Qwen3_5MoeConfig, model_class=Qwen3_5MoeForCausalLM, multimodal=MULTIMODAL,
    gguf_arch="qwen35moe",
    vllm=VLLMSupport("CloverForCausalLM", "vllm.model_executor.models.qwen3_5:Qwen3_5MoeForCausalLM",
                     "transformers.models.qwen3_5_moe.configuration_qwen3_5_moe:Qwen3_5MoeTextConfig"),
)
