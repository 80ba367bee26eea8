"""The architectures, keyed by `model_type`, and what asks them.

Each architecture is one module: its arguments dataclass (a `clover.config.CloverConfig` subclass
with its keys, defaults and checks), its model class (its layers, `make_cache`, its checkpoint
`key_layout`) and `ARCHITECTURE` (`registry.Architecture`: also its GGUF and vLLM names).
Registering one is one import line below (a static `from .module import ARCHITECTURE as NAME`, which
the transformers remote-code bundle can follow). `config_from_dict` / `read_config` read a config.json
as the class of its architecture (a multimodal wrapper through its `text_config`, a Clover file through
its `backbone`); `model_class`, `build_model`, `key_layout` and `parameter_counts` build on it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import CloverConfig, ConfigError, read_json
from .registry import Architecture

# The registry: one import line per architecture module, in lookup order. REGISTERED collects them in
# that order. (A static import, not importlib: the remote-code export bundles the modules it can see.)
from .qwen3_5_moe import ARCHITECTURE as QWEN3_5_MOE  # noqa: E402
from .qwen3_5 import ARCHITECTURE as QWEN3_5  # noqa: E402
from .llama import ARCHITECTURE as LLAMA  # noqa: E402
from .qwen3 import ARCHITECTURE as QWEN3  # noqa: E402
from .qwen3_moe import ARCHITECTURE as QWEN3_MOE  # noqa: E402
from .qwen2 import ARCHITECTURE as QWEN2  # noqa: E402
from .dream import ARCHITECTURE as DREAM  # noqa: E402
from .llada import ARCHITECTURE as LLADA  # noqa: E402
from .llada_moe import ARCHITECTURE as LLADA_MOE  # noqa: E402
from .rnd1 import ARCHITECTURE as RND1  # noqa: E402
from .bailing_moe_v2 import ARCHITECTURE as BAILING_MOE_V2  # noqa: E402

REGISTERED: tuple[Architecture, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Architecture))

CLOVER = "clover"  # a Clover config.json: its `backbone` names the text model underneath
DEFAULT_BACKBONE = QWEN3_5_MOE.config_class.MODEL_TYPES[0]  # of Clover checkpoints written before `backbone` existed
# text model_type -> its architecture; multimodal model_type -> the text model_type in its `text_config`
TEXT_MODEL_TYPES: dict[str, Architecture] = {t: a for a in REGISTERED for t in a.config_class.MODEL_TYPES}
MULTIMODAL: dict[str, str] = {k: v for a in REGISTERED for k, v in a.multimodal.items()}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (*MULTIMODAL, *TEXT_MODEL_TYPES, CLOVER)
# every model_type -> the architecture that reads it
ARCHITECTURES: dict[str, Architecture] = {
    **{t: TEXT_MODEL_TYPES[t] for t in TEXT_MODEL_TYPES}, **{k: TEXT_MODEL_TYPES[v] for k, v in MULTIMODAL.items()},
}
# keys a multimodal config keeps at the top level that belong to the text model
_LIFTED = ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings", "quantization_config")


def _unsupported(source: str, model_type: Any) -> ConfigError:
    return ConfigError(f"{source}: model_type {model_type!r} is not supported; expected one of {', '.join(SUPPORTED_MODEL_TYPES)}")


def architecture(model_type: str) -> Architecture:
    """The architecture of a text or multimodal `model_type` (a Clover config: its `backbone`)."""
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise ConfigError(f"model_type {model_type!r} is not supported; expected one of {', '.join(SUPPORTED_MODEL_TYPES)}") from None


def architecture_of(config: CloverConfig) -> Architecture:
    return architecture(config.base_model_type)


def config_class(model_type: str) -> type[CloverConfig]:
    """The arguments dataclass of a model_type ("clover": the default backbone's)."""
    return architecture(DEFAULT_BACKBONE if model_type == CLOVER else model_type).config_class


def make_config(**fields: Any) -> CloverConfig:
    """A config from its fields (`model_type`, for Clover `backbone`; default: the MoE backbone)."""
    model_type = fields.get("model_type") or DEFAULT_BACKBONE
    base = (fields.get("backbone") or DEFAULT_BACKBONE) if model_type == CLOVER else model_type
    return config_class(base)(**fields)


def config_from_dict(raw: Any, *, source: str = "config") -> CloverConfig:
    """A config.json's contents as its architecture's config (ConfigError naming `source` and the key)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    d, shown = dict(raw), {}
    if isinstance(model_type, str):  # a family whose config.json carries another's model_type (`Architecture.claims`)
        named = raw.get("architectures") or ()
        model_type = next((a.config_class.MODEL_TYPES[0] for a in REGISTERED if a.claims.get(model_type) in named),
                          model_type)
        d["model_type"] = model_type
    if model_type in MULTIMODAL or ("text_config" in raw and model_type != CLOVER):
        if model_type not in MULTIMODAL:
            raise _unsupported(source, model_type)
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: model_type {model_type!r} needs a 'text_config' object with the language model's settings")
        d = dict(text)
        shown = {k: f"text_config.{k}" for k in text}
        for key in _LIFTED:  # token ids sometimes live only at the top level
            if key not in d and key in raw:
                d[key] = raw[key]
                shown.pop(key, None)
        d["model_type"] = MULTIMODAL[model_type]
    elif model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(source, model_type)
    if not isinstance(d.get("model_type", ""), str):
        raise ConfigError(f"{source}: 'model_type' must be a string, got {d['model_type']!r}")
    d.setdefault("model_type", DEFAULT_BACKBONE)
    base = d["model_type"]
    if base == CLOVER:
        base = d.get("backbone")
        if base is None:
            base = d["backbone"] = DEFAULT_BACKBONE
        if not isinstance(base, str) or base not in TEXT_MODEL_TYPES:
            raise ConfigError(f"{source}: backbone {base!r} is not one of {', '.join(TEXT_MODEL_TYPES)}")
    return TEXT_MODEL_TYPES[base].config_class.from_dict(d, source=source, shown=shown)


def read_config(path: str | Path) -> CloverConfig:
    """A model directory's config.json (or the file itself) as its architecture's config."""
    raw, file = read_json(path)
    return config_from_dict(raw, source=str(file))


def model_class(config: CloverConfig) -> type[nn.Module]:
    return architecture_of(config).model_class


def key_layout(config: CloverConfig):
    """The checkpoint key -> parameter name mapping of the config's architecture."""
    return model_class(config).key_layout


# the initialisers nn.Linear / nn.Embedding / the models call while a module is constructed
_INITS = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def _meta_skip_init():
    """`nn.init.*_` on a meta tensor is a no-op here: under `torch.device(...)` torch routes each call
    through its function-mode dispatch (nn.Linear's kaiming_uniform_ and uniform_: ~0.3 s for the
    bundled model), and `normal_` through a Python decomposition that imports torch._dynamo (~2-3 s),
    to draw numbers that do not exist. Other tensors get the real init (each call is checked, so other
    threads are unaffected)."""
    real = {name: getattr(nn.init, name) for name in _INITS}

    def skip(fn):
        def init(tensor, *args, **kwargs):
            return tensor if tensor.is_meta else fn(tensor, *args, **kwargs)
        return init

    for name, fn in real.items():
        setattr(nn.init, name, skip(fn))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(nn.init, name, fn)


def build_model(config: CloverConfig, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build the module tree; on `meta` nothing is allocated (weights arrive via `load_state_dict(assign=True)`)."""
    cls = model_class(config)
    with torch.device(device), _meta_skip_init():
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
