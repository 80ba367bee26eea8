"""Model configuration: the text part of a Qwen3.5/3.6 `config.json` (MoE or dense), plus Clover's fields.

One dataclass describes the whole family: the hybrid GDN + gated-attention stack is the same, and the
MLP is either the sparse MoE (`qwen3_5_moe_text`: `num_experts`, `num_experts_per_tok`,
`moe_intermediate_size`, `shared_expert_intermediate_size`) or a dense SwiGLU (`qwen3_5_text`:
`intermediate_size`). A Clover config (`model_type: "clover"`) is one of these plus the diffusion
fields, and records which in `backbone`. Which module builds each model_type is `clover.models`.

Field names mirror the keys of `config.json` verbatim so a config round-trips through
`from_dict`/`to_dict`. Unknown keys are ignored; missing required ones raise `ConfigError`. Every
field's JSON type is checked against its annotation (an int is accepted where a float goes, never a
string or a bool for a number), and the error names the file and the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .decoding.sampling import LIMITS

# text model_type -> its MLP ("moe" or "dense"); the text models this config describes
BACKBONES = {"qwen3_5_moe_text": "moe", "qwen3_5_text": "dense", "llama": "dense"}
# what a config.json of that model_type means when it leaves a key out (the architecture's own defaults;
# `clover.models.llama` reads the rest: its RoPE scaling, biases, full rotary)
BACKBONE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10000.0, "partial_rotary_factor": 1.0, "full_attention_interval": 1,
              "max_position_embeddings": 2048},
}
# multimodal model_type -> the text model nested in its `text_config`
MULTIMODAL = {"qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5": "qwen3_5_text"}
SUPPORTED_MODEL_TYPES = (*MULTIMODAL, *BACKBONES, "clover")

# Keys without a sensible default: a config that lacks them describes no model of the family.
COMMON_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
MLP_KEYS = {
    "moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "dense": ("intermediate_size",),
}


class ConfigError(ValueError):
    """A config.json that cannot describe a model we can build."""


# ------------------------------------------------------------------------------ JSON types
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


# annotation piece -> (check, what config.json must hold there)
_JSON_TYPES: dict[str, tuple[Any, str]] = {
    "int": (_is_int, "an integer"),
    "float": (_is_number, "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "None": (lambda v: v is None, "null"),
    "list[str]": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "list[int]": (lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "a list of integers"),
}


def _json_kind(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def check_types(values: dict[str, Any], annotations: dict[str, str], shown: dict[str, str] | None = None) -> None:
    """Raise ConfigError for the first value whose JSON type does not match its field annotation
    ("int | list[int] | None" style strings). `shown` maps a field to the key the user wrote."""
    for name, value in values.items():
        pieces = [p.strip() for p in annotations[name].split("|")]
        if any(_JSON_TYPES[p][0](value) for p in pieces):
            continue
        expected = " or ".join(_JSON_TYPES[p][1] for p in pieces)
        got = f"{value!r} ({_json_kind(value)})"
        if isinstance(value, float) and not math.isfinite(value):
            got = f"{value!r} (a number must be finite)"
        raise ConfigError(f"{(shown or {}).get(name, name)!r} must be {expected}, got {got}")


@dataclass
class CloverConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    # the MLP: sparse MoE (qwen3_5_moe_text) or dense SwiGLU (qwen3_5_text); 0 where it does not apply
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    intermediate_size: int = 0
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    mlp_bias: bool = False  # llama
    rope_scaling: dict | None = None  # llama: the rope_parameters beyond theta ({"rope_type": "llama3", ...})
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    model_type: str = "qwen3_5_moe_text"
    # --- Clover (diffusion) fields; None/defaults for a plain AR checkpoint ---
    backbone: str | None = None  # clover: the text model_type underneath (None = qwen3_5_moe_text)
    mask_token_id: int | None = None
    block_size: int = 32
    block_sizes: list[int] | None = None  # the block sizes it was trained on (block_size="auto" picks among them)
    block_tokens_per_forward: dict | None = None  # width -> measured tokens per forward (auto's prior)
    threshold: float = 0.95
    policy: str = "threshold"  # the default acceptance policy (clover.decoding.acceptance)
    expert_budget: int | None = None
    # llama: low-rank adapters applied in denoise mode only ({"rank", "alpha", "targets"}; clover.models.llama)
    denoise_adapter: dict | None = None
    # quantization metadata, passed through untouched (see clover.quant)
    quantization_config: dict | None = None

    def __post_init__(self) -> None:
        check_types({k: getattr(self, k) for k in _ANNOTATIONS}, _ANNOTATIONS)
        if self.model_type != "clover" and self.model_type not in BACKBONES:
            raise ConfigError(
                f"invalid config: model_type {self.model_type!r} is not a text model; expected one of "
                f"{', '.join(BACKBONES)} or 'clover'"
            )
        if self.model_type == "clover" and self.backbone is None:
            self.backbone = "qwen3_5_moe_text"  # Clover checkpoints written before dense backbones existed
        if self.model_type != "clover":
            self.backbone = None
        if self.base_model_type not in BACKBONES:
            raise ConfigError(f"invalid config: backbone {self.backbone!r} is not one of {', '.join(BACKBONES)}")
        # what the derived fields divide by, before they are derived
        for name in self.required_keys + ("full_attention_interval",):
            if getattr(self, name) <= 0:
                raise ConfigError(f"invalid config: {name} must be positive, got {getattr(self, name)}")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            n = BACKBONE_DEFAULTS.get(self.base_model_type, {}).get("full_attention_interval", self.full_attention_interval)
            self.layer_types = [
                "full_attention" if (i + 1) % n == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"invalid config: {msg}")

        positive = self.required_keys + ("head_dim", "max_position_embeddings", "linear_conv_kernel_dim", "linear_key_head_dim",
                                    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                                    "full_attention_interval", "rms_norm_eps", "rope_theta")
        for name in positive:
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size"):
            if getattr(self, name) < 0:
                bad(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.shared_expert_intermediate_size < 0:
            bad(f"shared_expert_intermediate_size must be >= 0, got {self.shared_expert_intermediate_size}")
        if not (0 < self.partial_rotary_factor <= 1):
            bad(f"partial_rotary_factor must lie in (0, 1], got {self.partial_rotary_factor}")
        if len(self.layer_types) != self.num_hidden_layers:
            bad(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        unknown = set(self.layer_types) - {"full_attention", "linear_attention"}
        if unknown:
            bad(f"unknown layer types {sorted(unknown)}; expected 'full_attention' or 'linear_attention'")
        if self.num_attention_heads % self.num_key_value_heads:
            bad(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            bad(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of linear_num_key_heads ({self.linear_num_key_heads})")
        if self.num_experts_per_tok > self.num_experts:
            bad(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            bad(f"partial_rotary_factor {self.partial_rotary_factor} gives an odd or too large rotary dim {self.rotary_dim}")
        if self.block_sizes is not None and (not self.block_sizes or min(self.block_sizes) <= 0):
            bad(f"block_sizes must be a non-empty list of positive sizes, got {self.block_sizes}")
        for name in ("block_size", "threshold", "policy"):  # the rule a request's value is checked by
            value = getattr(self, name)
            try:
                LIMITS[name].check(name, value)
            except ValueError as e:
                bad(str(e))
            if value is None:
                bad(f"{name}: must be given")
        if self.mask_token_id is not None and not (0 <= self.mask_token_id < self.vocab_size):
            bad(f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")
        if self.expert_budget is not None and not self.is_moe:
            bad("expert_budget needs a mixture-of-experts backbone; this model's MLP is dense")
        if self.expert_budget is not None and not (self.num_experts_per_tok <= self.expert_budget <= self.num_experts):
            bad(f"expert_budget must lie in [num_experts_per_tok, num_experts], got {self.expert_budget}")

    # -------------------------------------------------------------- properties
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_clover(self) -> bool:
        return self.model_type == "clover"

    @property
    def base_model_type(self) -> str:
        """The text model's model_type: this one's, or for Clover the backbone underneath."""
        return self.backbone if self.is_clover else self.model_type

    @property
    def mlp_kind(self) -> str:
        """"moe" (sparse mixture of experts) or "dense" (one SwiGLU MLP)."""
        return BACKBONES[self.base_model_type]

    @property
    def is_moe(self) -> bool:
        return self.mlp_kind == "moe"

    @property
    def required_keys(self) -> tuple[str, ...]:
        return COMMON_KEYS + MLP_KEYS[self.mlp_kind]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    # ---------------------------------------------------------------- (de)ser
    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> "CloverConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        d = dict(raw)
        shown: dict[str, str] = {}  # field -> the key as written in the file, when it differs
        if model_type in MULTIMODAL or ("text_config" in raw and model_type != "clover"):
            if model_type not in MULTIMODAL:
                raise ConfigError(
                    f"{source}: model_type {model_type!r} is not supported; expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
                )
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: model_type {model_type!r} needs a 'text_config' object with the language model's settings")
            d = dict(text)
            shown = {k: f"text_config.{k}" for k in text}
            # token ids sometimes live only at the top level
            for key in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings", "quantization_config"):
                if key not in d and key in raw:
                    d[key] = raw[key]
                    shown.pop(key, None)
            d["model_type"] = MULTIMODAL[model_type]
        elif model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if not isinstance(d.get("model_type", ""), str):
            raise ConfigError(f"{source}: 'model_type' must be a string, got {d['model_type']!r}")
        if "dtype" in d and "torch_dtype" not in d:
            d["torch_dtype"] = d["dtype"]
            shown["torch_dtype"] = shown.get("dtype", "dtype")
        rope_key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
        rope = d.get(rope_key) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: {shown.get(rope_key, rope_key)!r} must be an object, got {rope!r}")
        if rope:
            where = shown.get(rope_key, rope_key)
            for key in ("rope_theta", "partial_rotary_factor"):
                if key in rope and key not in d:
                    d[key] = rope[key]
                    shown[key] = f"{where}.{key}"
        base = d.get("backbone") if d.get("model_type") == "clover" else d.get("model_type")
        d.pop("rope_scaling", None)
        if rope:
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if base in BACKBONE_DEFAULTS:  # the architecture checks its own scaling types
                if rope_type not in ("default", None):
                    d["rope_scaling"] = {"rope_type": rope_type, **{k: v for k, v in rope.items() if k not in (
                        "rope_theta", "partial_rotary_factor", "type", "rope_type")}}
            elif rope_type not in ("default", None):
                raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (only the default RoPE)")
        for key, value in BACKBONE_DEFAULTS.get(base if isinstance(base, str) else "", {}).items():
            d.setdefault(key, value)
        kind = BACKBONES.get(base if isinstance(base, str) else "", "moe")
        missing = [k for k in COMMON_KEYS + MLP_KEYS[kind] if k not in d]
        if missing:
            raise ConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        if d.get("model_type") == "clover":
            kwargs["model_type"] = "clover"
        try:
            check_types(kwargs, _ANNOTATIONS, shown)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        try:
            return cls(**kwargs)
        except TypeError as e:  # wrong value types
            raise ConfigError(f"{source}: {e}") from None
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "CloverConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"{path}: no config.json found; a model directory needs config.json next to its safetensors")
        if not path.is_file():  # a FIFO would block the read forever
            raise ConfigError(f"{path}: not a regular file; config.json must be a plain JSON file")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("full_attention_interval")
        d["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": d.pop("rope_theta"),
            "partial_rotary_factor": d.pop("partial_rotary_factor"),
        }
        scaling = d.pop("rope_scaling")
        if scaling:
            d["rope_parameters"].update(scaling)
        if self.base_model_type in BACKBONE_DEFAULTS:  # fields of the hybrid stack it does not have
            d["rope_parameters"].pop("partial_rotary_factor")
            for k in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                      "linear_num_value_heads", "layer_types"):
                d.pop(k)
        else:
            d.pop("mlp_bias")
        if self.model_type == "clover":
            d["architectures"] = ["CloverForBlockDiffusion"]
        else:
            d["architectures"] = ["LlamaForCausalLM" if self.model_type == "llama" else
                                  "Qwen3_5MoeForCausalLM" if self.is_moe else "Qwen3_5ForCausalLM"]
            for k in ("backbone", "mask_token_id", "block_size", "block_sizes", "block_tokens_per_forward", "threshold",
                      "policy", "expert_budget", "denoise_adapter"):
                d.pop(k)
        unused = ("intermediate_size",) if self.is_moe else (
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "router_aux_loss_coef")
        for k in unused:
            d.pop(k)
        for k in ("quantization_config", "block_sizes", "block_tokens_per_forward", "denoise_adapter"):
            if d.get(k, 0) is None:
                d.pop(k)
        return d

    def save(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> "CloverConfig":
        return dataclasses.replace(self, **changes)


# field -> its annotation ("int | None", ...): the JSON types config.json may hold there
_ANNOTATIONS: dict[str, str] = {f.name: str(f.type) for f in dataclasses.fields(CloverConfig)}


def full_size_config() -> CloverConfig:
    """The Qwen3.5/3.6-35B-A3B text config (used for accounting and meta-device tests)."""
    return CloverConfig(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=262144,
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
    )


def log2_block_ratio(block_size: int) -> float:
    """log2(B/32): the argument of the block-size calibration gain."""
    return math.log2(block_size / 32.0)
