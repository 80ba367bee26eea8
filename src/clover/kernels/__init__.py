"""Linear-attention kernels (Gated Delta Rule) used by the Qwen3.5-MoE port."""

from .gated_delta import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_with_states,
    naive_gated_delta_rule,
    one_chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    state_after,
)

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_with_states",
    "naive_gated_delta_rule",
    "one_chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "state_after",
]
