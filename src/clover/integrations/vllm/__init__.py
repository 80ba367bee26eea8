"""Serve Clover checkpoints with vLLM: `vllm serve CLOVER_DIR`, `vllm.LLM(model=CLOVER_DIR)`.

Install (`scripts/install-vllm.sh` does it in its own venv, CPU build; docs/scale-out.md for GPUs):
clover in the same environment as vLLM. vLLM finds this plugin through the `vllm.general_plugins`
entry point (`clover = "clover.integrations.vllm:register"`, pyproject.toml) and calls `register()`
in every process it starts, before it reads a model's config. `register()`:

- registers `CloverVLLMConfig` with transformers' `AutoConfig` for `model_type: "clover"` (so no
  `trust_remote_code` is needed, also for `clover export-hf` directories);
- registers the architectures `CloverForCausalLM` (MoE backbone) and `CloverDenseForCausalLM` (dense)
  with vLLM's `ModelRegistry`, lazily (`"module:Class"`), so vLLM imports `.model` only when a Clover
  checkpoint is loaded.

What runs: the commit (AR) mode, on vLLM's own Qwen3.5 layers. Block diffusion inside vLLM is not
here; docs/scale-out.md says what it needs and what this vLLM build lacks.

This module imports neither vLLM nor torch at import time: clover without vLLM imports it freely.
"""

from __future__ import annotations

MODEL_MODULE = "clover.integrations.vllm.model"


def model_classes() -> dict[str, str]:
    """vLLM architecture -> class in MODEL_MODULE (the names CloverVLLMConfig writes into
    `architectures`): one per backbone the registry serves (`clover.models`, `VLLMSupport`)."""
    from .config import served

    return {s.architecture: s.architecture for s in served().values()}


def register() -> None:
    """The `vllm.general_plugins` entry point: teach transformers and vLLM the Clover checkpoint.
    Idempotent (vLLM calls it once per process, tests may call it again)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from .config import CloverVLLMConfig

    AutoConfig.register("clover", CloverVLLMConfig, exist_ok=True)
    supported = set(ModelRegistry.get_supported_archs())
    for arch, cls in model_classes().items():
        if arch not in supported:
            ModelRegistry.register_model(arch, f"{MODEL_MODULE}:{cls}")


__all__ = ["register", "model_classes"]
