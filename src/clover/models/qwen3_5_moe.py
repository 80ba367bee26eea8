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

import torch
from torch import nn

from ..config import CloverConfig
from .layers import SparseMoE
from .qwen3_5 import KeyLayout, Qwen3_5ForCausalLM

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


class MoeKeyLayout(KeyLayout):
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


def model_class(config: CloverConfig) -> type[nn.Module]:
    return Qwen3_5MoeForCausalLM
