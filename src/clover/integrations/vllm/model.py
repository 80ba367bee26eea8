"""vLLM model classes for Clover checkpoints: commit (AR) mode on vLLM's own Qwen3.5 layers.

A Clover checkpoint is in transformers' Qwen3.5 key layout (`model.layers.N...`, fused experts
`mlp.experts.gate_up_proj` / `down_proj`, `lm_head.weight`) plus four tensors per GDN layer that only
the denoise mode reads (docs/architecture.md). In commit mode a Clover model *is* the backbone, so the
classes here are vLLM's `Qwen3_5MoeForCausalLM` / `Qwen3_5ForCausalLM` — tensor / expert / pipeline
parallelism, paged attention, the GDN state cache, prefix caching and continuous batching all come
from vLLM — with one change: the weight mapper drops the Clover-only tensors.

Imports vLLM: load it through `clover.integrations.vllm.register()` (the `vllm.general_plugins` entry
point), which vLLM calls in every process before it reads a config.
"""

from __future__ import annotations

from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from vllm.model_executor.models.utils import WeightsMapper

from ...models.layers import CLOVER_PARAMETERS

# Tensors of the denoise mode (clover.models.clover), unused by the commit mode vLLM runs: the
# right-side conv branch, the intra-block attention logit scale and the block-size calibration gains.
CLOVER_ONLY_SUFFIXES = tuple(f".linear_attn.{n}" for n in CLOVER_PARAMETERS)
DROP_CLOVER_ONLY = WeightsMapper(orig_to_new_suffix={s: None for s in CLOVER_ONLY_SUFFIXES})


class CloverForCausalLM(Qwen3_5MoeForCausalLM):
    """A Clover checkpoint over the Qwen3.5-MoE backbone, commit mode (AR decoding) in vLLM."""

    hf_to_vllm_mapper = Qwen3_5MoeForCausalLM.hf_to_vllm_mapper | DROP_CLOVER_ONLY


class CloverDenseForCausalLM(Qwen3_5ForCausalLM):
    """A Clover checkpoint over the dense Qwen3.5 backbone, commit mode (AR decoding) in vLLM."""

    hf_to_vllm_mapper = Qwen3_5ForCausalLM.hf_to_vllm_mapper | DROP_CLOVER_ONLY
