"""Model configuration: what every architecture's config shares, and what Clover adds.

Each architecture owns its arguments: a dataclass subclassing `CloverConfig` in its own module
(`models/qwen3_5.py` `Qwen3_5Config`, `models/qwen3_5_moe.py` `Qwen3_5MoeConfig`,
`models/llama.py` `LlamaConfig`), with the keys of its `config.json`, its own defaults, its checks
and how it reads and writes its RoPE settings. So a key missing from a checkpoint of one family
gets that family's default, never another's. This module keeps what they share: the fields every
model has (vocabulary, width, depth, token ids, dtype, the quantization metadata) and Clover's own
(`backbone`, the mask token, the block size and widths, the acceptance defaults, the expert
budget, the block semantics: `BlockSemantics`), the JSON type checks and the (de)serialisation. Which class reads a config.json (its
model_type, a multimodal wrapper's `text_config`, a Clover file's `backbone`) is the registry's:
`clover.models.read_config(path)` / `config_from_dict(raw)`.

A Clover config (`model_type: "clover"`) is an instance of its backbone's class with the Clover
fields set. Field names mirror the keys of `config.json` verbatim so a config round-trips through
`from_dict`/`to_dict`. Unknown keys are ignored; missing required ones (the fields without a
default) raise `ConfigError`. Every field's JSON type is checked against its annotation (an int is
accepted where a float goes, never a string or a bool for a number), and the error names the file
and the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .decoding.sampling import LIMITS

# Clover's own fields: on a Clover config only (an AR config.json never carries them)
CLOVER_FIELDS = ("backbone", "mask_token_id", "block_size", "block_sizes", "block_tokens_per_forward", "threshold",
                 "policy", "sub_block", "expert_budget", "logit_shift", "block_grid", "commit_attention", "first_token")


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


@dataclass(frozen=True)
class BlockSemantics:
    """How a block-diffusion checkpoint decodes, on the axes where released families differ
    (docs/design.md §7), with Clover's values as defaults. Each field acts in one place:

    - `logit_shift` — 1: the hidden state at position i predicts token i+1 (Clover, Fast-dLLM v2,
      Dream), so block position 0 is predicted by the last committed position; 0: it predicts the
      token at i itself (SDAR/TraDo, LLaDA2). Acts where an engine reads a block's logits
      (`DiffusionEngine._block_logits`, `_read_positions`);
    - `block_grid` — "prompt": blocks start at the end of the prompt; "absolute": blocks are aligned
      at multiples of the block size from position 0, so the prompt's last partial block is
      denoised together with the first masks (SDAR, LLaDA2, Fast-dLLM v2). Acts where the first
      block is placed (`DiffusionEngine._place_prompt`);
    - `commit_attention` — "causal": a finished block is committed causally; "block": its K/V are
      computed with attention bidirectional inside the block (SDAR, LLaDA2); "full": there is no
      commit, every position attends to every other over the whole sequence (the whole-sequence
      diffusion models, Dream and LLaDA, decoded by the canvas mode). Acts where a forward builds its
      attention mask (`core.CausalLM.attention_mask`, `training_mask`, `forward_mask`);
    - `first_token` — "denoise": every block position is denoised; "commit_argmax": the block's
      first token is the commit forward's argmax (Fast-dLLM v2). Acts where the commit's logits
      reach a row (`DiffusionEngine._first_token`).

    Only Clover's values run today; a component meeting another one refuses it in one line
    (`require`, `refuse`)."""

    logit_shift: int = 1
    block_grid: str = "prompt"
    commit_attention: str = "causal"
    first_token: str = "denoise"

    CHOICES: ClassVar[dict[str, tuple]] = {
        "logit_shift": (1, 0),
        "block_grid": ("prompt", "absolute"),
        "commit_attention": ("causal", "block", "full"),
        "first_token": ("denoise", "commit_argmax"),
    }

    def __post_init__(self) -> None:
        for name, choices in self.CHOICES.items():
            value = getattr(self, name)
            if value not in choices or isinstance(value, bool):
                raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")

    @classmethod
    def of(cls, config: Any) -> "BlockSemantics":
        """The semantics a config states (its fields of these names)."""
        return cls(**{name: getattr(config, name) for name in cls.CHOICES})

    def refuse(self, name: str, where: str) -> ConfigError:
        """The one-line error of `where` meeting this value of `name`, which it does not implement."""
        return ConfigError(f"{name}={getattr(self, name)!r}: not implemented in {where} yet (only {self.CHOICES[name][0]!r}, "
                           f"Clover's, is)")

    def require(self, where: str, implemented: dict[str, tuple] | None = None) -> None:
        """Raise `refuse` for the first field whose value is neither Clover's nor in `implemented`
        (field -> the other values `where` implements)."""
        for name, choices in self.CHOICES.items():
            value = getattr(self, name)
            if value != choices[0] and value not in (implemented or {}).get(name, ()):
                raise self.refuse(name, where)


@dataclass(kw_only=True)
class CloverConfig:
    """The fields every architecture's config has, Clover's, and the machinery; subclassed by each
    architecture (which sets `MODEL_TYPES`, `HF_ARCHITECTURE` and its own fields)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ()  # the text model_types this class reads (the first: its default)
    HF_ARCHITECTURE: ClassVar[str] = ""  # transformers' class, written into config.json's "architectures"

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    model_type: str = ""
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    # --- Clover (diffusion) fields; None/defaults for a plain AR checkpoint ---
    backbone: str | None = None  # clover: the text model_type underneath
    mask_token_id: int | None = None
    block_size: int = 32
    block_sizes: list[int] | None = None  # the block sizes it was trained on (block_size="auto" picks among them)
    block_tokens_per_forward: dict | None = None  # width -> measured tokens per forward (auto's prior)
    threshold: float = 0.95
    policy: str = "threshold"  # the default acceptance policy (clover.decoding.acceptance)
    sub_block: int | None = None  # the default sub-block a block is denoised in, left to right (None: the whole block)
    expert_budget: int | None = None
    # the block semantics (`BlockSemantics`: what each value means, where it acts), Clover's by default
    logit_shift: int = BlockSemantics.logit_shift
    block_grid: str = BlockSemantics.block_grid
    commit_attention: str = BlockSemantics.commit_attention
    first_token: str = BlockSemantics.first_token
    # the decoding mode front ends use when none is named (`clover.decoding.modes.default_mode`); None:
    # diffusion for a Clover checkpoint, ar for an AR one. A checkpoint states the mode its model card
    # measured best (clover-smol: ar; with a drafter, dflash)
    default_mode: str | None = None
    # quantization metadata, passed through untouched (see clover.quant)
    quantization_config: dict | None = None

    def __post_init__(self) -> None:
        if not self.MODEL_TYPES:
            raise TypeError("CloverConfig is the base of the architectures' configs: build one with "
                            "clover.models.config_from_dict / read_config, or an architecture's config class")
        annotations = _annotations(type(self))
        check_types({k: getattr(self, k) for k in annotations}, annotations)
        if not self.model_type:
            self.model_type = self.MODEL_TYPES[0]
        if self.model_type == "clover":
            if self.backbone is None:
                self.backbone = self.MODEL_TYPES[0]
        else:
            self.backbone = None
        if self.base_model_type not in self.MODEL_TYPES:
            what = f"backbone {self.backbone!r}" if self.is_clover else f"model_type {self.model_type!r}"
            raise ConfigError(f"invalid config: {what} is not one of {', '.join(self.MODEL_TYPES)} "
                              f"({type(self).__name__}) or 'clover'")
        # what the derived fields divide by, before they are derived
        for name in self.required_keys():
            if getattr(self, name) <= 0:
                raise ConfigError(f"invalid config: {name} must be positive, got {getattr(self, name)}")
        self.derive()
        self.validate()

    def derive(self) -> None:
        """Fill the fields computed from others (an architecture's `head_dim`, `layer_types`, ...)."""

    def derive_full_attention(self) -> None:
        """`derive` of an attention-only stack: `head_dim` hidden / heads where unset, and every layer
        "full_attention" where `layer_types` is unset (Llama's family, LLaDA2)."""
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """The checks every config gets; architectures add theirs (calling this one)."""
        def bad(msg: str) -> None:
            raise ConfigError(f"invalid config: {msg}")

        for name in self.required_keys():
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive, got {getattr(self, name)}")
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
        if self.sub_block is not None:
            try:
                LIMITS["sub_block"].check("sub_block", self.sub_block)
            except ValueError as e:
                bad(str(e))
        if self.mask_token_id is not None and not (0 <= self.mask_token_id < self.vocab_size):
            bad(f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")
        if self.expert_budget is not None and not self.has_experts:
            bad("expert_budget needs a mixture-of-experts backbone; this model's MLP is dense")
        try:
            self.semantics
        except ConfigError as e:
            bad(str(e))
        if self.default_mode is not None:
            from .decoding.modes import get_mode

            try:
                get_mode(self.default_mode)
            except ValueError as e:
                bad(f"default_{e}")

    # -------------------------------------------------------------- properties
    @property
    def is_clover(self) -> bool:
        return self.model_type == "clover"

    @property
    def semantics(self) -> BlockSemantics:
        """How this model's blocks decode (`BlockSemantics`)."""
        return BlockSemantics.of(self)

    @property
    def base_model_type(self) -> str:
        """The text model's model_type: this one's, or for Clover the backbone underneath."""
        return self.backbone if self.is_clover else self.model_type

    # ------------------------------------------------------------ capabilities
    # What an architecture has beyond full attention and one dense MLP per layer. Generic code (info,
    # the benchmarks, the planner, the trainer) asks these before it reads the fields that come with
    # them, which only the architectures having them define: a missing field is an AttributeError,
    # never a silent 0. An architecture with experts, linear attention or an attention gate overrides them.
    @property
    def has_experts(self) -> bool:
        """A sparse mixture-of-experts MLP (`num_experts`, `num_experts_per_tok`,
        `moe_intermediate_size`, `shared_expert_intermediate_size`)."""
        return False

    @property
    def has_linear_attention(self) -> bool:
        """Gated DeltaNet layers, "linear_attention" in `layer_types` (`linear_num_key_heads`,
        `linear_num_value_heads`, `linear_key_head_dim`, `linear_value_head_dim`, `linear_conv_kernel_dim`)."""
        return False

    @property
    def has_gated_attention(self) -> bool:
        """Full attention with a sigmoid output gate (q_proj yields q and the gate) and q/k norms."""
        return False

    @property
    def fills_after_eos(self) -> bool:
        """Whether a denoise step that accepts an EOS fills the block's later positions with EOS (Clover's
        training pads answers so); a family whose reference leaves them to be decoded says no."""
        return True

    @classmethod
    def required_keys(cls) -> tuple[str, ...]:
        """The keys a config.json of this architecture must hold (the fields without a default)."""
        return tuple(f.name for f in dataclasses.fields(cls)
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    # ---------------------------------------------------------------- (de)ser
    @classmethod
    def read_keys(cls, d: dict[str, Any], shown: dict[str, str], source: str) -> None:
        """Bring the keys of a text config.json `d` into this class's fields, in place (an
        architecture reads its RoPE settings here); `shown` maps a field to the key as written."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config", shown: dict[str, str] | None = None) -> "CloverConfig":
        """A text config.json (already unwrapped from a multimodal one) as this class. Which class
        reads a given file: `clover.models.config_from_dict`."""
        if not cls.MODEL_TYPES:
            raise TypeError("CloverConfig.from_dict: use clover.models.config_from_dict (it picks the architecture)")
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        d = dict(raw)
        shown = dict(shown or {})  # field -> the key as written in the file, when it differs
        if "dtype" in d and "torch_dtype" not in d:
            d["torch_dtype"] = d["dtype"]
            shown["torch_dtype"] = shown.get("dtype", "dtype")
        cls.read_keys(d, shown, source)
        missing = [k for k in cls.required_keys() if k not in d]
        if missing:
            raise ConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
        annotations = _annotations(cls)
        kwargs = {k: v for k, v in d.items() if k in annotations}
        try:
            check_types(kwargs, annotations, shown)
            return cls(**kwargs)
        except TypeError as e:  # wrong value types
            raise ConfigError(f"{source}: {e}") from None
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def write_keys(self, d: dict[str, Any]) -> None:
        """`to_dict`'s architecture part: turn the fields in `d` into config.json's keys, in place."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.is_clover:
            d["architectures"] = ["CloverForBlockDiffusion"]
        else:
            d["architectures"] = [self.HF_ARCHITECTURE]
            for k in CLOVER_FIELDS:
                d.pop(k)
        for k in ("quantization_config", "block_sizes", "block_tokens_per_forward", "default_mode", "sub_block"):
            if d.get(k, 0) is None:
                d.pop(k)
        self.write_keys(d)
        return d

    def save(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> "CloverConfig":
        return dataclasses.replace(self, **changes)


_ANNOTATIONS: dict[type, dict[str, str]] = {}


def _annotations(cls: type) -> dict[str, str]:
    """field -> its annotation ("int | None", ...): the JSON types config.json may hold there."""
    if cls not in _ANNOTATIONS:
        _ANNOTATIONS[cls] = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    return _ANNOTATIONS[cls]


def read_json(path: str | Path) -> tuple[Any, Path]:
    """A model directory's (or a file's) config.json -> (its JSON, the file), or ConfigError."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"{path}: no config.json found; a model directory needs config.json next to its safetensors")
    if not path.is_file():  # a FIFO would block the read forever
        raise ConfigError(f"{path}: not a regular file; config.json must be a plain JSON file")
    try:
        return json.loads(path.read_text(encoding="utf-8")), path
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def log2_block_ratio(block_size: int) -> float:
    """log2(B/32): the argument of the block-size calibration gain."""
    return math.log2(block_size / 32.0)


@dataclass(kw_only=True)
class CanvasConfig:
    """The whole-sequence diffusion families' part of a config (Dream, LLaDA, LLaDA-MoE, RND1; listed
    before the backbone's config in the bases): the canvas mode by default, attention bidirectional over
    the whole canvas, and `mask_token_id` written back under the family's own key. Each family says how
    the canvas mode paces the unmasking (`canvas_schedule`) and draws above temperature 0
    (`canvas_sampler`); `decoding/canvas.py` reads both."""

    canvas_schedule: ClassVar[str]
    canvas_sampler: ClassVar[str]

    default_mode: str | None = "canvas"
    commit_attention: str = "full"

    def write_keys(self, d: dict) -> None:
        super().write_keys(d)  # the backbone's config, next in the MRO
        d["mask_token_id"] = self.mask_token_id

