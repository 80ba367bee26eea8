"""What an architecture declares to the registry (`clover.models`): one `Architecture` per module.

An architecture module defines its arguments dataclass (a `CloverConfig` subclass: the keys of its
config.json, its defaults and checks), its model class (its layers, `make_cache`, its checkpoint
`key_layout`), and `ARCHITECTURE = Architecture(...)`, which `models/__init__.py` registers in one
line. Everything that depends on the model type — reading a config.json, building the model, the
weight-name mapping, the GGUF export, the transformers export, the vLLM plugin — asks the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class VLLMSupport:
    """How the vLLM plugin serves a Clover checkpoint over this backbone (commit mode on vLLM's own
    layers): the architecture name it registers, vLLM's model class it derives from and
    transformers' text config class (both "module:Class", imported only inside vLLM)."""

    architecture: str
    vllm_class: str
    text_config_class: str


@dataclass(frozen=True)
class Architecture:
    name: str  # the module's name in clover.models
    config_class: type  # its arguments: `config_class.MODEL_TYPES` are the text model_types it answers to
    model_class: type  # the causal LM built for such a config
    multimodal: dict[str, str] = field(default_factory=dict)  # wrapper model_type -> the text model_type in `text_config`
    gguf_arch: str | None = None  # its llama.cpp architecture: the table in `clover.gguf.names` (None: no GGUF)
    vllm: VLLMSupport | None = None  # the vLLM plugin's class for Clover checkpoints over it (None: not served)
    # another family's model_type -> the transformers architecture that makes such a config.json this one's
    claims: dict[str, str] = field(default_factory=dict)

    @property
    def model_types(self) -> tuple[str, ...]:
        """Every model_type a config.json of this architecture may carry (text and multimodal)."""
        return (*self.config_class.MODEL_TYPES, *self.multimodal)
