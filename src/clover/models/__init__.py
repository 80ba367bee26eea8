"""The architectures, keyed by `model_type`.

Each architecture is one module that defines `MODEL_TYPES` and `model_class(config)`; its model
class owns its layers (from the shared `layers.py`), `make_cache` and its checkpoint `key_layout`.
`ARCHITECTURES` maps every model_type to its module, which is imported on first use.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType

import torch
from torch import nn

from ..config import CloverConfig, ConfigError

ARCHITECTURES: dict[str, str] = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "llama": "llama",
    "clover": "clover",
}


def architecture(model_type: str) -> ModuleType:
    """The module implementing `model_type`."""
    try:
        name = ARCHITECTURES[model_type]
    except KeyError:
        raise ConfigError(f"model_type {model_type!r} is not supported; expected one of {', '.join(ARCHITECTURES)}") from None
    return importlib.import_module(f"{__name__}.{name}")


def model_class(config: CloverConfig) -> type[nn.Module]:
    return architecture(config.model_type).model_class(config)


@contextlib.contextmanager
def _meta_normal_init():
    """`nn.init.normal_` on a meta tensor is a no-op here: torch routes it through a Python
    decomposition that imports torch._dynamo (~2-3 s at load) to draw numbers that do not exist.
    Other tensors get the real init (the patch checks each call, so other threads are unaffected)."""
    real = nn.init.normal_

    def normal_(tensor, *args, **kwargs):
        return tensor if tensor.is_meta else real(tensor, *args, **kwargs)

    nn.init.normal_ = normal_
    try:
        yield
    finally:
        nn.init.normal_ = real


def build_model(config: CloverConfig, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build the module tree; on `meta` nothing is allocated (weights arrive via `load_state_dict(assign=True)`)."""
    cls = model_class(config)
    with torch.device(device), _meta_normal_init():
        model = cls(config)
    if str(device) != "meta":
        model.to(dtype)
    return model


def parameter_counts(config: CloverConfig) -> dict[str, int]:
    """Total parameters and those active per token (every routed expert counted at top-k / E),
    read off a model built on `meta`."""
    model = build_model(config, device="meta")
    total = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    idle = 0
    for module in model.modules():
        n_experts = getattr(module, "num_experts", 0)
        if n_experts and hasattr(module, "gate_up_proj"):
            per_expert = (module.gate_up_proj.numel() + module.down_proj.numel()) // n_experts
            idle += per_expert * (n_experts - config.num_experts_per_tok)
    return {"total": total, "active": total - idle}
