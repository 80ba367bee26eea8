"""vLLM model classes for Clover checkpoints: commit (AR) mode on vLLM's own Qwen3.5 layers.

A Clover checkpoint is in transformers' Qwen3.5 key layout (`model.layers.N...`, fused experts
`mlp.experts.gate_up_proj` / `down_proj`, `lm_head.weight`) plus four tensors per GDN layer that only
the denoise mode reads (docs/architecture.md). In commit mode a Clover model *is* the backbone, so the
classes here are vLLM's own (`Qwen3_5MoeForCausalLM` / `Qwen3_5ForCausalLM`, as each architecture's
`VLLMSupport` in clover's registry names them) — tensor / expert / pipeline
parallelism, paged attention, the GDN state cache, prefix caching and continuous batching all come
from vLLM — with one change: the weight mapper drops the Clover-only tensors.

Imports vLLM: load it through `clover.integrations.vllm.register()` (the `vllm.general_plugins` entry
point), which vLLM calls in every process before it reads a config.
"""

from __future__ import annotations

import importlib

from vllm.model_executor.models.utils import WeightsMapper

from ...models.layers import CLOVER_PARAMETERS
from .config import served

# Tensors of the denoise mode (clover.models.clover), unused by the commit mode vLLM runs: the
# right-side conv branch, the intra-block attention logit scale and the block-size calibration gains.
CLOVER_ONLY_SUFFIXES = tuple(f".linear_attn.{n}" for n in CLOVER_PARAMETERS)
DROP_CLOVER_ONLY = WeightsMapper(orig_to_new_suffix={s: None for s in CLOVER_ONLY_SUFFIXES})


def _served_class(support) -> type:
    """vLLM's model class of a backbone with the Clover-only tensors dropped at load."""
    module, name = support.vllm_class.split(":")
    base = getattr(importlib.import_module(module), name)
    doc = f"A Clover checkpoint over {name}'s backbone, commit mode (AR decoding) in vLLM."
    return type(support.architecture, (base,), {"hf_to_vllm_mapper": base.hf_to_vllm_mapper | DROP_CLOVER_ONLY,
                                                 "__doc__": doc, "__module__": __name__})


# one class per backbone the registry serves (`CloverForCausalLM`, `CloverDenseForCausalLM`, ...)
for _support in served().values():
    globals()[_support.architecture] = _served_class(_support)
