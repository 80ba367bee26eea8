"""The transformers config class vLLM gets for a Clover `config.json` (`model_type: "clover"`).

A Clover config is a flat Qwen3.5 text config plus the diffusion fields (`clover.config`). vLLM's
Qwen3.5 layers read `hf_text_config` and pick the MLP by its `model_type` (`qwen3_5_moe_text` or
`qwen3_5_text`), so this class is composite, like transformers' multimodal `Qwen3_5MoeConfig`: the
outer config keeps `model_type: "clover"` and the diffusion fields (`mask_token_id`, `block_size`,
`threshold`, `policy`, `expert_budget`), and `text_config` is transformers' own text config of the
backbone (`backbone`, default `qwen3_5_moe_text`), built from the same keys. vLLM resolves
`hf_text_config` through `get_text_config()`, which returns it.

`architectures` is set to the vLLM class for the backbone (`CloverForCausalLM` over the MoE backbone,
`CloverDenseForCausalLM` over the dense one) whatever the file says (`CloverForBlockDiffusion` from
`clover convert` / `clover train`, `CloverForCausalLM` from `clover export-hf`): one name per backbone.

Which backbones are served, and by which class: clover's registry (`clover.models`, each
architecture's `VLLMSupport`). Imports transformers and (when used) clover, no vLLM: testable in
clover's own environment.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

# keys of config.json that describe the file, not the text model
OUTER_ONLY = ("model_type", "architectures", "auto_map", "clover_version", "transformers_version", "quantization_config")


def served() -> dict[str, object]:
    """backbone (a text model_type) -> its `VLLMSupport` (the vLLM architecture registered for Clover
    checkpoints over it), from clover's registry (`clover.models`)."""
    from clover.models import TEXT_MODEL_TYPES

    return {t: a.vllm for t, a in TEXT_MODEL_TYPES.items() if a.vllm is not None}


def default_backbone() -> str:
    from clover.models import DEFAULT_BACKBONE

    return DEFAULT_BACKBONE


def text_config_class(backbone: str):
    """transformers' config class for a backbone's text model."""
    import importlib

    support = served().get(backbone)
    if support is None:
        raise ValueError(f"clover config: backbone {backbone!r} is not one of {', '.join(served())}")
    module, name = support.text_config_class.split(":")
    return getattr(importlib.import_module(module), name)


def check_with_clover(d: dict[str, Any]) -> None:
    """Read a flat Clover config.json as clover does (`clover.models.config_from_dict`: required
    keys, JSON types, head and layer counts that fit), so a broken file stops here with clover's
    message instead of loading as transformers' defaults (the 35B shapes) and failing at the weights."""
    from clover.config import ConfigError
    from clover.models import config_from_dict

    try:
        config_from_dict({**d, "model_type": "clover"}, source="clover config (vLLM plugin)")
    except ConfigError as e:
        raise ValueError(str(e)) from None


class CloverVLLMConfig(PretrainedConfig):
    """`model_type: "clover"` for transformers' `AutoConfig` (registered by the vLLM plugin)."""

    model_type = "clover"

    def __init__(self, text_config: Any = None, **kwargs: Any) -> None:
        from clover.config import CLOVER_FIELDS

        backbone = kwargs.pop("backbone", None) or default_backbone()
        cls = text_config_class(backbone)
        clover = {k: kwargs.pop(k) for k in CLOVER_FIELDS if k in kwargs}
        quant = kwargs.get("quantization_config")
        if isinstance(quant, dict) and quant.get("quant_method") == "torchao" and text_config is None:
            raise ValueError("clover config: the torchao INT8 export (`clover export-hf` of a `clover quantize` directory) "
                             "does not load in vLLM: its torchao support quantizes linear layers only, and its fused-MoE "
                             "loader cannot split the experts' Int8Tensor (aten.split); serve the unquantized "
                             "checkpoint (docs/scale-out.md)")
        if quant and text_config is None:
            raise ValueError("clover config: a `clover quantize` checkpoint (its own INT4/INT8 format) does not load in "
                             "vLLM; serve the unquantized checkpoint (docs/scale-out.md)")
        for k in OUTER_ONLY:
            kwargs.pop(k, None)
        if "torch_dtype" in kwargs:  # the older name, as clover writes it
            kwargs.setdefault("dtype", kwargs.pop("torch_dtype"))
        if isinstance(text_config, dict):
            text_config = {k: v for k, v in text_config.items() if k != "model_type"}
            text = cls(**text_config)
        elif text_config is None:
            if kwargs:  # a config.json (CloverVLLMConfig() with no arguments is transformers' defaults probe)
                check_with_clover({**kwargs, **clover, "backbone": backbone})
            fields = set(getattr(cls, "__dataclass_fields__", {})) - {"model_type"}
            text = cls(**{k: v for k, v in kwargs.items() if k in fields})
        else:
            text = text_config
        if text.model_type != backbone:
            raise ValueError(f"clover config: text_config has model_type {text.model_type!r}, backbone says {backbone!r}")
        outer = {k: kwargs[k] for k in ("dtype", "eos_token_id", "pad_token_id", "bos_token_id", "tie_word_embeddings")
                 if k in kwargs}
        super().__init__(**outer)
        self.text_config = text
        self.backbone = backbone
        self.mask_token_id = clover.get("mask_token_id")
        self.block_size = clover.get("block_size", 32)
        self.threshold = clover.get("threshold", 0.95)
        self.policy = clover.get("policy")
        self.expert_budget = clover.get("expert_budget")
        self.architectures = [served()[backbone].architecture]

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if hasattr(d.get("text_config"), "to_dict"):
            d["text_config"] = d["text_config"].to_dict()
        return d
