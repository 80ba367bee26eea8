"""Write a checkpoint as GGUF for llama.cpp (`clover export-gguf SRC DST.gguf`).

The backbone is written as the llama.cpp architecture its registration names (`gguf_arch`):
Clover's hybrid as `qwen35moe`, a Llama model (SmolLM2, clover-smol) as `llama`, so stock llama.cpp
runs it in AR mode; the tensors go through the architecture's table (`names.py`: each tensor's GGUF
name and transform, the ones llama.cpp's own converter applies). A Llama model's denoise adapter
(`models/llama.py`) is not written: llama.cpp and the port run its AR mode (and DFlash on it).

Clover's own tensors (`conv1d_right`, `intra_scale`, `block_gain_a/b`) cannot live in the main file:
llama.cpp refuses a file holding tensors its architecture does not load ("wrong number of
tensors"). By default they go to a sidecar GGUF next to it (`DST.clover.gguf`); `clover_tensors=
"inline"` writes them into the main file for a llama.cpp port that knows them; `"none"` drops them.
The `clover.*` metadata (format version, block size, threshold, mask token, where the extras are)
is in both files. A `clover quantize` directory keeps its codes (`quant.py`: INT8 -> Q8_0, INT4 ->
Q4_1). A DFlash drafter directory is written as its own `dflash` architecture (`export_drafter_gguf`).

Work is shard by shard: a planning pass reads only the safetensors headers (and runs the mapping on
`meta` tensors to learn every output name, shape and type), the writing pass then converts one
tensor at a time. See docs/gguf.md for the table, the tokenizer and the measured agreement with
llama.cpp.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch

from ..checkpoint import CheckpointError, shard_files
from ..config import CloverConfig, ConfigError
from ..models import architecture_of, key_layout, read_config
from ..models.llama import is_adapter_parameter
from .names import (DRAFTER, F32_ALWAYS, FUSED_GATE_UP, LAYER, LLAMA, QWEN35MOE, REARRANGING, SPLIT_EXPERTS,
                    GGUFExportError, Heads, Transform, is_clover_tensor, layer_entry, table_for, v_cols)
from .quant import QuantPlanes, Rounding, block_type_fits, encode_q4_1, encode_q8_0, planes_from_parts
from .tokenizer import TokenizerMetadata, read_tokenizer

ARCH = QWEN35MOE.arch  # Clover's own architecture (a Llama model's: LLAMA.arch)
FORMAT_VERSION = 1
DTYPES = ("f32", "bf16", "f16", "q8_0")
CLOVER_TENSOR_MODES = ("sidecar", "inline", "none")
SIDECAR_SUFFIX = ".clover.gguf"
_PER_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class _Mapper:
    """Our tensors in, (GGUF name, tensor) out. Works the same on real and on `meta` tensors, which
    is how the planning pass learns every output without reading any weights."""

    def __init__(self, config: CloverConfig) -> None:
        self.config = config
        self.table = table_for(config)
        self.heads = Heads.of(config)
        self._experts: dict[int, dict[tuple[int, str], torch.Tensor]] = {}

    def __call__(self, name: str, t: torch.Tensor, origin: str) -> list[tuple[str, torch.Tensor]]:
        if name in self.table.globals:
            gname, fn = self.table.globals[name]
            return [(gname, fn(t, self.heads))]
        m = LAYER.match(name)
        if not m:
            raise GGUFExportError(f"{origin}: unexpected key {name!r}; GGUF export knows the {self.table.arch} parameters only")
        bid, leaf = int(m.group(1)), m.group(2)
        if bid >= self.config.num_hidden_layers:
            raise GGUFExportError(f"{origin}: key {name!r} is past the {self.config.num_hidden_layers} layers in config.json")
        if leaf == FUSED_GATE_UP:
            if t.ndim != 3 or t.shape[1] % 2:
                raise GGUFExportError(f"{origin}: {name!r} has shape {tuple(t.shape)}; expected [experts, 2*intermediate, hidden]")
            n = t.shape[1] // 2
            gate, up = SPLIT_EXPERTS
            return [(f"blk.{bid}.{gate}", t[:, :n]), (f"blk.{bid}.{up}", t[:, n:])]
        pe = _PER_EXPERT.match(leaf)
        if pe:
            return self._per_expert(bid, int(pe.group(1)), pe.group(2), t, origin)
        row = layer_entry(self.table, leaf)
        if row is None:
            raise GGUFExportError(f"{origin}: unexpected key {name!r}; GGUF export knows the {self.table.arch} parameters only")
        gname, fn = row
        return [(f"blk.{bid}.{gname}", fn(t, self.heads))]

    def transform_of(self, name: str) -> Transform | None:
        """The transform a quantized weight's name maps through (None: the fused-experts split, a
        pure slice), or GGUFExportError when it is one that is not a pure rearrangement."""
        if name in self.table.globals:
            fn = self.table.globals[name][1]
        else:
            m = LAYER.match(name)
            leaf = m.group(2) if m else None
            fn = None if leaf == FUSED_GATE_UP else (layer_entry(self.table, leaf) or (None, None))[1]
            if fn is None and leaf != FUSED_GATE_UP:
                raise GGUFExportError(f"{name!r}: quantized, but GGUF export has no mapping for it")
        if fn is not None and fn not in REARRANGING:
            raise GGUFExportError(f"{name!r}: quantized, but its GGUF transform ({fn.__name__}) is arithmetic, not a reordering")
        return fn

    def column_chunk(self, name: str) -> int | None:
        """For a weight whose transform moves columns: the chunk of columns that moves together."""
        return self.heads.dv if self.transform_of(name) is v_cols and self.heads.n_k != self.heads.n_v else None

    def planes(self, name: str, qp: QuantPlanes, origin: str) -> list[tuple[str, QuantPlanes]]:
        """A quantized weight through the same mapping, plane by plane (codes, scale, offset)."""
        self.transform_of(name)
        mapped = [self(name, plane, origin) for plane in qp.planes()]
        return [(gname, qp.like([m[i][1] for m in mapped])) for i, (gname, _) in enumerate(mapped[0])]

    def _per_expert(self, bid: int, e: int, kind: str, t: torch.Tensor, origin: str) -> list[tuple[str, torch.Tensor]]:
        n_exp = self.config.num_experts
        if e >= n_exp:
            raise GGUFExportError(f"{origin}: expert {e} of layer {bid} is past num_experts={n_exp}")
        got = self._experts.setdefault(bid, {})
        got[(e, kind)] = t
        if len(got) < 3 * n_exp:
            return []
        del self._experts[bid]
        out = []
        for kind, gname in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            out.append((f"blk.{bid}.{gname}.weight", torch.stack([got[(i, kind)] for i in range(n_exp)])))
        return out

    def finish(self, src: Path) -> None:
        for bid, got in self._experts.items():
            have = sorted({e for e, _ in got})
            raise GGUFExportError(f"{src}: layer {bid} has per-expert weights for {len(have)} of {self.config.num_experts} experts "
                                  "(each needs gate_proj, up_proj and down_proj); the checkpoint is incomplete")


# ------------------------------------------------------------------------------------ dtypes
def _ggml_type(name: str, shape: tuple[int, ...], dtype: str):
    import gguf

    Q = gguf.GGMLQuantizationType
    if dtype == "f32" or len(shape) <= 1 or F32_ALWAYS.search(name) or not name.endswith(".weight"):
        return Q.F32
    if dtype == "f16":
        return Q.F16
    if dtype == "bf16":
        return Q.BF16
    # q8_0 works on rows of 32; narrower rows fall back to f16 (as llama.cpp's converter does)
    return Q.Q8_0 if shape[-1] % 32 == 0 else Q.F16


def _file_type(dtype: str):
    import gguf

    F = gguf.LlamaFileType
    return {"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16, "q8_0": F.MOSTLY_Q8_0,
            "int8": F.MOSTLY_Q8_0, "int4": F.MOSTLY_Q4_1}[dtype]


def _block_type(bits: int, fits: bool):
    """The GGUF type of a clover-quantized weight (`quant.py`): its block type, or float32 when its
    rows do not split into blocks."""
    import gguf

    Q = gguf.GGMLQuantizationType
    return (Q.Q8_0 if bits == 8 else Q.Q4_1) if fits else Q.F32


def _encode(t: torch.Tensor | QuantPlanes, qtype, rounding: Rounding) -> np.ndarray:
    import gguf

    Q = gguf.GGMLQuantizationType
    if isinstance(t, QuantPlanes):
        if qtype == Q.Q8_0:
            return encode_q8_0(t, rounding)
        if qtype == Q.Q4_1:
            return encode_q4_1(t, rounding)
        t = t.dequantize()
    a = t.detach().to(torch.float32).contiguous().numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return a
    if qtype == gguf.GGMLQuantizationType.F16:
        return a.astype(np.float16)
    return gguf.quants.quantize(a, qtype)


def _nbytes(shape: tuple[int, ...], qtype) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape to declare, numpy dtype to declare, bytes) for add_tensor_info."""
    import gguf

    Q = gguf.GGMLQuantizationType
    n = int(np.prod(shape)) if shape else 1
    if qtype == Q.F32:
        return shape, np.dtype(np.float32), 4 * n
    if qtype == Q.F16:
        return shape, np.dtype(np.float16), 2 * n
    byte_shape = tuple(gguf.quant_shape_to_byte_shape(shape, qtype))
    return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape))


# ---------------------------------------------------------------------------------- metadata
def mrope_sections(rotary_dim: int) -> list[int]:
    """Sections for llama.cpp's interleaved M-RoPE that cover every rotary pair. With text-only
    positions (all streams equal) interleaved M-RoPE is plain NeoX RoPE over `rotary_dim` dims, as
    long as no pair is left to the 4th stream (position 0, no rotation)."""
    n = rotary_dim // 2
    s0 = -(-n // 3)
    s1 = -(-(n - s0) // 2)
    s = [s0, s1, n - s0 - s1, 0]
    covered = [(j % 3 == 0 and j < 3 * s[0]) or (j % 3 == 1 and j < 3 * s[1]) or (j % 3 == 2 and j < 3 * s[2]) for j in range(n)]
    if n < 2 or not all(covered):
        raise GGUFExportError(f"rotary dim {rotary_dim} cannot be expressed as llama.cpp interleaved M-RoPE sections")
    return s


def check_supported(config: CloverConfig, src: Path) -> None:
    c = config
    arch, table = architecture_of(c), table_for(c)
    if table is None or not table.writes:  # the registration names the architecture's table
        raise GGUFExportError(f"{src}: cannot export to GGUF: model_type {c.base_model_type!r} ({arch.name}) has no "
                              f"GGUF export; the writer produces llama.cpp's {', '.join((QWEN35MOE.arch, LLAMA.arch))} "
                              "for the architectures that declare it")
    problems = [f"hidden_act {c.hidden_act!r} is not supported (silu only)"] if c.hidden_act != "silu" else []
    problems += _PER_ARCH[table.arch].problems(c)
    if problems:
        raise GGUFExportError(f"{src}: cannot export to GGUF: " + "; ".join(problems))


def _llama_problems(c: CloverConfig) -> list[str]:
    """What the llama writer cannot express yet."""
    if getattr(c, "rope_scaling", None):
        return [f"rope_scaling {c.rope_scaling} is not written yet (llama.cpp's converter writes llama3's as "
                "rope_freqs.weight; convert with it)"]
    return []


def _qwen35moe_problems(c: CloverConfig) -> list[str]:
    """What llama.cpp's qwen35moe (and the port) cannot run."""
    problems = []
    if c.linear_key_head_dim != c.linear_value_head_dim:
        problems.append(f"llama.cpp's qwen35moe needs linear_key_head_dim == linear_value_head_dim (got {c.linear_key_head_dim} and {c.linear_value_head_dim})")
    if c.attention_bias:
        problems.append("attention_bias=true is not supported by llama.cpp's qwen35moe")
    if c.shared_expert_intermediate_size <= 0:
        problems.append("llama.cpp's qwen35moe requires a shared expert (shared_expert_intermediate_size > 0)")
    checks = (lambda: c.semantics.require("the GGUF export (the llama.cpp port decodes Clover's)"),  # its block semantics
              lambda: mrope_sections(c.rotary_dim))  # sections that cover every rotary pair
    for check in checks:
        try:
            check()
        except (ConfigError, GGUFExportError) as e:
            problems.append(str(e))
    return problems


def _qwen35moe_keys(w, c: CloverConfig) -> None:
    """qwen35moe's keys derived from the config (beyond the table's)."""
    w.add_rope_dimension_sections(mrope_sections(c.rotary_dim))
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_array(f"{QWEN35MOE.arch}.attention.recurrent_layers", [t == "linear_attention" for t in c.layer_types])


class _ArchWriter(NamedTuple):
    """What the writer does per llama.cpp architecture beyond its table: the checks (`problems`: what it
    cannot write, one line each) and the metadata keys derived from the config (`keys`)."""
    problems: Callable[[CloverConfig], list[str]]
    keys: Callable[..., None]


_PER_ARCH = {QWEN35MOE.arch: _ArchWriter(_qwen35moe_problems, _qwen35moe_keys),
             LLAMA.arch: _ArchWriter(_llama_problems, lambda w, c: None)}


def _write_metadata(w, config: CloverConfig, tok: TokenizerMetadata, *, name: str, dtype: str, clover: dict) -> None:
    import gguf

    c = config
    w.add_name(name)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_file_type(_file_type(dtype))
    if dtype in ("q8_0", "int8", "int4"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    table = table_for(c)
    table.write_keys(w, c)
    _PER_ARCH[table.arch].keys(w, c)
    # tokenizer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok.pre)
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.types)
    w.add_token_merges(tok.merges)
    for value, add in ((tok.eos_id, w.add_eos_token_id), (tok.pad_id, w.add_pad_token_id),
                       (tok.bos_id, w.add_bos_token_id), (tok.mask_id, w.add_mask_token_id)):
        if value is not None:
            add(int(value))
    w.add_add_bos_token(False)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
    # clover.*
    for key, value in clover.items():
        if isinstance(value, bool):
            w.add_bool(f"clover.{key}", value)
        elif isinstance(value, int):
            w.add_uint32(f"clover.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"clover.{key}", value)
        elif isinstance(value, list):
            w.add_array(f"clover.{key}", value)
        elif value is not None:
            w.add_string(f"clover.{key}", str(value))


# ------------------------------------------------------------------------------------ export
@dataclass
class ExportResult:
    path: Path
    sidecar: Path | None
    tensors: int
    clover_tensors: int
    bytes: int
    pre_tokenizer: str
    pre_tokenizer_exact: bool
    notes: list[str] = field(default_factory=list)
    types: str = ""  # what the weight matrices are, e.g. "f32" or "int4 group 64 -> Q4_1 (other matrices f32)"
    arch: str = ARCH  # general.architecture (a DFlash drafter's: DRAFTER.arch)


def sidecar_path(dst: Path) -> Path:
    return dst.with_name((dst.name[: -len(".gguf")] if dst.name.endswith(".gguf") else dst.name) + SIDECAR_SUFFIX)


@dataclass
class _QuantSource:
    """Where a `clover quantize` directory keeps each quantized weight (see `quant.format`)."""

    bits: int
    group_size: int | None
    parts: dict[str, tuple[str, str, int]]  # on-disk key -> (weight name, part, K of the float weight)
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]  # on-disk key -> (dtype, shape)

    @property
    def n_parts(self) -> int:
        """On-disk tensors per weight: qweight and scales (INT8), and zeros (INT4)."""
        return 2 if self.bits == 8 else 3

    @property
    def weights(self) -> set[str]:
        return {wname for wname, _, _ in self.parts.values()}

    @classmethod
    def of(cls, config: CloverConfig, src: Path) -> "_QuantSource | None":
        if not config.quantization_config:
            return None
        from ..quant.format import parse_quantization_config, tensor_specs

        try:
            bits, group, targets = parse_quantization_config(config.quantization_config, config, str(src / "config.json"))
        except CheckpointError as e:
            raise GGUFExportError(str(e)) from None
        parts, specs = {}, {}
        for t in targets.values():
            spec = tensor_specs(t, bits, group)
            for wname, shape in t.weight_shapes().items():
                base = wname.removesuffix(".weight")
                for key in spec:
                    if key.rsplit(".", 1)[0] == base:
                        parts[key] = (wname, key.rsplit(".", 1)[1], shape[-1])
                        specs[key] = spec[key]
        return cls(bits, group, parts, specs)


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_TORCH_DTYPE = {torch.int8: "I8", torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _source_tensors(shards: list[Path], config: CloverConfig, *, meta: bool, quant: _QuantSource | None = None,
                    float_shapes: dict[str, tuple[int, ...]] | None = None) -> Iterator[tuple[Path, str, torch.Tensor | QuantPlanes, int]]:
    """(shard, our name, tensor as float32 or on meta, bytes on disk) for every key we keep (named by
    the architecture's key layout). A quantized weight comes once all its parts are read: on meta as
    a float tensor of the float shape (`float_shapes`), otherwise as `QuantPlanes`."""
    from safetensors import safe_open

    layout = key_layout(config)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    pending_bytes: dict[str, int] = {}
    for path in shards:
        try:
            f = safe_open(str(path), framework="pt", device="cpu")
            keys = list(f.keys())
        except Exception as e:  # noqa: BLE001 - truncated or not safetensors
            raise CheckpointError(f"{path}: cannot read safetensors header ({e}); the file is truncated or corrupt") from None
        for key in keys:
            name = layout.name(key)
            if name is None or is_adapter_parameter(name):  # a Llama model's denoise adapter: not exported
                continue
            sl = f.get_slice(key)
            shape = tuple(sl.get_shape())
            nbytes = int(np.prod(shape)) * _ITEMSIZE.get(sl.get_dtype(), 4)
            part = quant.parts.get(name) if quant else None
            if part is not None:
                dtype, want = quant.specs[name]
                if sl.get_dtype() != _TORCH_DTYPE.get(dtype) or shape != tuple(want):
                    raise GGUFExportError(f"{path}: {key!r} is {sl.get_dtype()} {shape} but config.json's quantization_config "
                                          f"(int{quant.bits}) implies {_TORCH_DTYPE.get(dtype)} {tuple(want)}")
            if meta:
                t = torch.empty(shape, dtype=torch.float32, device="meta")
            else:
                try:
                    t = f.get_tensor(key)
                    t = t if part is not None else t.to(torch.float32)
                except Exception as e:  # noqa: BLE001
                    raise CheckpointError(f"{path}: cannot read tensor {key!r} ({e}); the file is truncated or corrupt") from None
            if part is None:
                yield path, name, t, nbytes
                continue
            wname, leaf, k = part
            got = pending.setdefault(wname, {})
            got[leaf] = t
            pending_bytes[wname] = pending_bytes.get(wname, 0) + nbytes
            if len(got) == quant.n_parts:
                del pending[wname]
                if meta:
                    value = torch.empty(float_shapes[wname], dtype=torch.float32, device="meta")
                else:
                    value = planes_from_parts(got, quant.bits, quant.group_size, k)
                yield path, wname, value, pending_bytes.pop(wname)
    if pending:
        wname, got = next(iter(pending.items()))
        raise GGUFExportError(f"{shards[0].parent}: quantized weight {wname!r} has only {sorted(got)} on disk; the checkpoint is incomplete")


def _expected(config: CloverConfig) -> dict[str, tuple[int, ...]]:
    from ..checkpoint import expected_shapes
    from ..models import build_model

    return {k: tuple(v) for k, v in expected_shapes(build_model(config, device="meta")).items() if not is_adapter_parameter(k)}


def _plan(config: CloverConfig, src: Path, shards: list[Path], quant: _QuantSource | None):
    """The planning pass, from the safetensors headers alone: every output tensor's (GGUF name,
    shape) in write order, which quantized outputs keep a block type (True: Q8_0 / Q4_1, False:
    float32), and the bytes read; GGUFExportError for a key, shape or part that does not fit."""
    expected = _expected(config)
    seen: set[str] = set()
    plan: list[tuple[str, tuple[int, ...]]] = []
    block_typed: dict[str, bool] = {}  # quantized outputs: True = Q8_0 / Q4_1, False = float32
    src_bytes = 0
    mapper = _Mapper(config)
    for path, name, t, nbytes in _source_tensors(shards, config, meta=True, quant=quant, float_shapes=expected):
        src_bytes += nbytes
        m = LAYER.match(name)
        if m and _PER_EXPERT.match(m.group(2)):
            seen.update(f"model.layers.{m.group(1)}.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj"))
        elif name not in expected:
            raise GGUFExportError(f"{path}: unexpected key {name!r} (no such parameter in this model); is config.json the one these weights were saved with?")
        elif tuple(t.shape) != expected[name]:
            raise GGUFExportError(f"{path}: {name!r} has shape {tuple(t.shape)} but config.json implies {expected[name]}; the weights and config disagree")
        else:
            seen.add(name)
        outs = [(g, tuple(o.shape)) for g, o in mapper(name, t, str(path))]
        if quant is not None and name in quant.weights:
            chunk = mapper.column_chunk(name)
            block_typed.update({g: block_type_fits(quant.bits, quant.group_size, shape[-1], chunk) for g, shape in outs})
        plan += outs
    mapper.finish(src)
    missing = sorted(set(expected) - seen - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing:
        shown = ", ".join(repr(k) for k in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise GGUFExportError(f"{src}: missing key(s) {shown}; the checkpoint is incomplete or for another model")
    return plan, block_typed, src_bytes


def _clover_metadata(config: CloverConfig, tok: TokenizerMetadata, mode: str, side: Path | None) -> dict:
    """The `clover.*` keys (both files carry them): the block-diffusion settings and where the
    Clover tensors are."""
    return {
        "format_version": FORMAT_VERSION,
        "model_type": config.model_type,
        "block_size": config.block_size if config.is_clover else None,
        "threshold": float(config.threshold) if config.is_clover else None,
        "mask_token_id": tok.mask_id,
        "expert_budget": config.expert_budget,
        "policy": config.policy if config.is_clover else None,  # the default acceptance rule (llama-clover reads it)
        # block_size="auto": the widths it was trained on and their measured tokens per forward (JSON)
        "block_sizes": config.block_sizes if config.is_clover else None,
        "block_tokens_per_forward": (json.dumps(config.block_tokens_per_forward, sort_keys=True)
                                     if config.is_clover and config.block_tokens_per_forward else None),
        "tensors": mode,
        "tensors_file": side.name if side else None,
        "v_head_order": "tiled",
        "pre_tokenizer_exact": tok.pre_exact,
    }


def _notes(tok: TokenizerMetadata, mode: str, dtype: str, kinds: dict, block_typed: dict, quant, target) -> list[str]:
    """What the export could not write exactly as asked, one line each."""
    import gguf

    notes = []
    if not tok.pre_exact:
        notes.append(f"tokenizer: llama.cpp pre-tokenizer {tok.pre!r} is the closest match but not exact; "
                     "see docs/gguf.md (pass prompts as token ids for bit-exact inputs)")
    if tok.placeholder_merge:
        notes.append("tokenizer: no merges; one inert placeholder merge written (llama.cpp requires the array)")
    if mode == "inline":
        notes.append("clover tensors inline: stock llama.cpp refuses this file (it holds tensors qwen35moe does not load)")
    q8_fallback = [g for g, q in kinds.items() if dtype == "q8_0" and q == gguf.GGMLQuantizationType.F16 and g not in block_typed]
    if q8_fallback:
        notes.append(f"q8_0: {len(q8_fallback)} tensor(s) with rows not a multiple of 32 written as f16")
    unblocked = [g for g, fits in block_typed.items() if not fits and target(g) is not None]
    if unblocked:
        notes.append(f"int{quant.bits}: {len(unblocked)} quantized tensor(s) with rows not a multiple of 32 inputs "
                     f"(or groups that are not) written as float32, dequantized (e.g. {unblocked[0]})")
    return notes


def export_gguf(
    src: str | Path,
    dst: str | Path,
    *,
    dtype: str = "f32",
    clover_tensors: str = "sidecar",
    pre_tokenizer: str | None = None,
    progress: bool = True,
) -> ExportResult:
    """Write `src` (a clover / Qwen3.5-MoE model directory) as GGUF `dst`; see the module docstring.
    A DFlash drafter directory goes to `export_drafter_gguf` (the llama.cpp port's `--drafter`)."""
    import gguf
    from tqdm import tqdm

    src, dst = Path(src), Path(dst)
    if is_drafter_dir(src):
        return export_drafter_gguf(src, dst, dtype=dtype)
    if dtype not in DTYPES:
        raise GGUFExportError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if clover_tensors not in CLOVER_TENSOR_MODES:
        raise GGUFExportError(f"unknown clover_tensors {clover_tensors!r}; use one of {', '.join(CLOVER_TENSOR_MODES)}")
    if not src.is_dir():
        raise GGUFExportError(f"{src}: not a directory; pass the folder holding config.json and the safetensors")
    if dst.is_dir():
        raise GGUFExportError(f"{dst}: is a directory; give the GGUF file to write (e.g. {dst / 'model.gguf'})")
    config = read_config(src)
    check_supported(config, src)
    tok = read_tokenizer(src, config, pre_tokenizer=pre_tokenizer)
    shards = shard_files(src)
    quant = _QuantSource.of(config, src)

    plan, block_typed, src_bytes = _plan(config, src, shards, quant)
    has_clover = any(is_clover_tensor(g) for g, _ in plan)

    # -- writers
    mode = clover_tensors if has_clover else "none"
    side = sidecar_path(dst) if mode == "sidecar" else None
    clover_meta = _clover_metadata(config, tok, mode, side)
    name = src.resolve().name
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".partial")
    arch = table_for(config).arch
    writers = {"main": gguf.GGUFWriter(tmp, arch)}
    file_type = dtype if quant is None else f"int{quant.bits}"
    _write_metadata(writers["main"], config, tok, name=name, dtype=file_type, clover=clover_meta)
    if side is not None:
        side_tmp = side.with_name(side.name + ".partial")
        writers["side"] = gguf.GGUFWriter(side_tmp, arch)
        _write_metadata(writers["side"], config, tok, name=name + " (clover tensors)", dtype=file_type, clover=clover_meta)

    def target(gname: str) -> str | None:
        if not is_clover_tensor(gname):
            return "main"
        return {"inline": "main", "sidecar": "side", "none": None}[mode]

    kinds = {}
    total = 0
    counts = {"main": 0, "side": 0}
    for gname, shape in plan:
        where = target(gname)
        if where is None:
            continue
        qtype = _ggml_type(gname, shape, dtype) if gname not in block_typed else _block_type(quant.bits, block_typed[gname])
        kinds[gname] = qtype
        decl_shape, np_dtype, nbytes = _nbytes(shape, qtype)
        writers[where].add_tensor_info(gname, decl_shape, np_dtype, nbytes, raw_dtype=None if qtype in (
            gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else qtype)
        counts["main" if where == "main" else "side"] += 1
        total += nbytes
    try:
        for w in writers.values():
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()

        # -- write: one tensor at a time, in plan order
        mapper = _Mapper(config)
        order = iter(plan)
        bar = tqdm(total=src_bytes, unit="B", unit_scale=True, desc="export-gguf", disable=not progress)
        current = None
        rounding = Rounding()
        for path, name, t, nbytes in _source_tensors(shards, config, meta=False, quant=quant):
            if path != current:
                current = path
                bar.set_postfix_str(f"shard {shards.index(path) + 1}/{len(shards)}: {path.name}")
            mapped = mapper.planes(name, t, str(path)) if isinstance(t, QuantPlanes) else mapper(name, t, str(path))
            for gname, out in mapped:
                want, shape = next(order)
                assert gname == want and tuple(out.shape) == shape, (gname, want)
                where = target(gname)
                if where is not None:
                    writers[where].write_tensor_data(_encode(out, kinds[gname], rounding))
            bar.update(nbytes)
        bar.close()
        for w in writers.values():
            w.close()
        os.replace(tmp, dst)
        if side is not None:
            os.replace(side_tmp, side)
    except BaseException:
        for w in writers.values():
            try:
                w.close()
            except Exception:  # noqa: BLE001
                pass
        for p in (tmp, side.with_name(side.name + ".partial") if side else None):
            if p is not None and p.exists():
                p.unlink()
        raise
    notes = _notes(tok, mode, dtype, kinds, block_typed, quant, target) + rounding.summary()
    types = dtype
    if quant is not None:
        types = ("int8 -> Q8_0" if quant.bits == 8 else f"int4 group {quant.group_size} -> Q4_1") + f" (other matrices {dtype})"
    return ExportResult(dst, side, counts["main"], counts["side"] if side else sum(is_clover_tensor(g) for g in kinds),
                        total, tok.pre, tok.pre_exact, notes, types, arch)



# ------------------------------------------------------------------------------ DFlash drafter
# A DFlash drafter (`clover.models.dflash`) as a GGUF of its own (`names.DRAFTER`), for the llama.cpp
# port's `--mode dflash --drafter FILE`. The hyper-parameters go under `dflash.*` (the table's keys,
# plus the drafter's own).
def is_drafter_dir(src: str | Path) -> bool:
    """Whether `src` holds a DFlash drafter (config.json's architectures name a drafter layout)."""
    from ..models.dflash import LAYOUTS

    path = Path(src) / "config.json"
    try:
        return any(a in LAYOUTS for a in json.loads(path.read_text(encoding="utf-8")).get("architectures") or [])
    except (OSError, ValueError, AttributeError):
        return False


DRAFT_IDS = "draft_ids"  # a reduced draft vocabulary's target token ids [V_d] (int32; `d2t` made absolute)
MASK_EMBD = "mask_embd"  # the vector the target embeds the mask token with, where not its embedding row [H]


def _drafter_name(name: str) -> str:
    if name in DRAFTER.globals:
        return DRAFTER.globals[name][0]
    m = re.match(r"^layers\.(\d+)\.(.+)$", name)
    if not m or m.group(2) not in DRAFTER.layer:
        raise GGUFExportError(f"drafter: unexpected parameter {name!r}; the DFlash GGUF knows the published layout only")
    return f"blk.{m.group(1)}.{DRAFTER.layer[m.group(2)][0]}"


def export_drafter_gguf(src, dst: str | Path, *, dtype: str = "f32", target=None) -> ExportResult:
    """Write the DFlash drafter `src` (its directory, or a loaded `DFlashDrafter`, e.g. an `LLM`'s
    `drafter`) as GGUF `dst` (architecture `dflash`, read by the llama.cpp port's `--drafter`); see
    the section comment above. `target` (the model it drafts for): where that model embeds the mask
    token with a vector of its own (a clover Llama's denoise adapter), the vector goes in as
    `mask_embd` (the target's GGUF holds the plain row; the drafter was trained reading the vector)."""
    import gguf

    from ..checkpoint import load_drafter

    dst = Path(dst)
    if dtype not in DTYPES:
        raise GGUFExportError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if dst.is_dir():
        raise GGUFExportError(f"{dst}: is a directory; give the GGUF file to write (e.g. {dst / 'drafter.gguf'})")
    if isinstance(src, torch.nn.Module):
        drafter, label = src, "dflash-drafter"
    else:
        src = Path(src)
        drafter, label = load_drafter(src, dtype=torch.float32), src.resolve().name
    c = drafter.config
    if c.conv_kernel_size is not None or c.selector_rank is not None:
        raise GGUFExportError(f"{label}: a {c.architecture} drafter (dynamic convolutions, candidate selector) is not "
                              "read by the llama.cpp port's drafter yet; only DFlashDraftModel exports")
    if c.layer_types is not None or c.is_causal:
        raise GGUFExportError(f"{label}: sliding-window or causal drafter layers (layer_types {c.layer_types}) are not "
                              "read by the llama.cpp port's drafter yet")
    if c.attention_bias:
        raise GGUFExportError(f"{label}: attention_bias=true is not supported by the llama.cpp port's drafter")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".partial")
    w = gguf.GGUFWriter(tmp, DRAFTER.arch)
    w.add_name(label)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_file_type(_file_type(dtype))
    if dtype == "q8_0":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    DRAFTER.write_keys(w, c)
    w.add_uint32(f"{DRAFTER.arch}.block_size", c.block_size)
    w.add_uint32(f"{DRAFTER.arch}.mask_token_id", c.mask_token_id)
    w.add_array(f"{DRAFTER.arch}.target_layer_ids", [int(i) for i in c.target_layer_ids])
    if c.num_target_layers is not None:
        w.add_uint32(f"{DRAFTER.arch}.num_target_layers", int(c.num_target_layers))
    w.add_float32(f"{DRAFTER.arch}.input_embedding_scale", float(c.input_embedding_scale))
    w.add_float32(f"{DRAFTER.arch}.output_multiplier", float(c.output_multiplier))
    w.add_float32(f"{DRAFTER.arch}.final_logit_softcapping", float(c.final_logit_softcapping or 0.0))
    total, rounding, count = 0, Rounding(), 0
    try:
        if c.draft_vocab_size is not None:  # the draft vocabulary as absolute token ids (the port gathers the head's rows)
            ids = drafter.draft_ids.to(torch.int32).cpu().numpy()
            w.add_uint32(f"{DRAFTER.arch}.draft_vocab_size", int(c.draft_vocab_size))
            w.add_tensor(DRAFT_IDS, ids)
            total, count = ids.nbytes, 1
        if target is not None:
            from ..models.dflash import mask_embedding

            vec = mask_embedding(target, c.mask_token_id).detach().float().cpu()
            if not torch.equal(vec, target.model.embed_tokens.weight[c.mask_token_id].detach().float().cpu()):
                w.add_tensor(MASK_EMBD, vec.numpy())
                total, count = total + vec.numel() * 4, count + 1
        for name, t in drafter.state_dict().items():
            if name.startswith("rotary_emb.") or name == "d2t":
                continue
            gname = _drafter_name(name)
            qtype = _ggml_type(gname, tuple(t.shape), dtype)
            data = _encode(t.detach().float().cpu(), qtype, rounding)
            total += data.nbytes
            count += 1
            w.add_tensor(gname, data, raw_dtype=None if qtype in (gguf.GGMLQuantizationType.F32,
                                                                   gguf.GGMLQuantizationType.F16) else qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, dst)
    except BaseException:
        w.close()
        if tmp.exists():
            tmp.unlink()
        raise
    return ExportResult(dst, None, count, 0, total, "", True, rounding.summary(), dtype, DRAFTER.arch)
