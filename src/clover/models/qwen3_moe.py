"""Qwen3-MoE (`Qwen3MoeForCausalLM`, model_type `qwen3_moe`): the Qwen3 stack (`qwen3.py`) with a sparse
MoE in every layer's place of the MLP — router `softmax(x Wᵀ)` in fp32 → top-k, renormalised over the
k when `norm_topk_prob` (Qwen3-30B-A3B's config sets it; transformers' default is off) — and no shared
expert. Experts run through the grouped dispatch (`clover.moe`), stored fused
(`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, transformers' layout) or one by one
(`mlp.experts.N.{gate,up,down}_proj.weight`, the released checkpoints), stacked at load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ConfigError
from .layers import SparseMoE
from .qwen3 import Qwen3Config, Qwen3ForCausalLM
from .qwen3_5_moe import MoeKeyLayout
from .registry import Architecture


@dataclass(kw_only=True)
class Qwen3MoeConfig(Qwen3Config):
    """A Qwen3-MoE `config.json`: Qwen3's, with the sparse MoE's keys. Every layer sparse
    (`decoder_sparse_step` 1, no `mlp_only_layers`), as in every released Qwen3-MoE."""

    MODEL_TYPES = ("qwen3_moe", "sdar_moe")
    HF_ARCHITECTURE = "Qwen3MoeForCausalLM"

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int = 0  # the dense MLP's (unused: every layer is sparse)
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0  # no shared expert (the MoE layer's field; not a config key)

    @property
    def has_experts(self) -> bool:
        return True

    def validate(self) -> None:
        super().validate()
        if self.decoder_sparse_step != 1 or self.mlp_only_layers:
            raise ConfigError(f"{self.model_type}: dense layers among the sparse ones (decoder_sparse_step "
                              f"{self.decoder_sparse_step}, mlp_only_layers {self.mlp_only_layers}) are not supported")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"invalid config: num_experts_per_tok ({self.num_experts_per_tok}) must lie in "
                              f"[1, num_experts ({self.num_experts})]")
        if self.expert_budget is not None and not (self.num_experts_per_tok <= self.expert_budget <= self.num_experts):
            raise ConfigError(f"invalid config: expert_budget must lie in [num_experts_per_tok, num_experts], got {self.expert_budget}")

    @classmethod
    def read_keys(cls, d: dict, shown: dict, source: str) -> None:
        """Also `num_local_experts`: the name transformers >= 5 writes for `num_experts`."""
        super().read_keys(d, shown, source)
        if d.get("mlp_only_layers", []) is None:
            d.pop("mlp_only_layers")
        if "num_experts" not in d and "num_local_experts" in d:
            d["num_experts"] = d["num_local_experts"]
            shown["num_experts"] = "num_local_experts"

    def write_keys(self, d: dict) -> None:
        super().write_keys(d)
        d.pop("shared_expert_intermediate_size")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    mlp_class = SparseMoE
    key_layout = MoeKeyLayout()


ARCHITECTURE = Architecture(name="qwen3_moe", config_class=Qwen3MoeConfig, model_class=Qwen3MoeForCausalLM)
