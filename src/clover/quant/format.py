"""What a quantized checkpoint holds: which modules are quantized, the `quantization_config` block of
config.json, and the exact keys/dtypes/shapes each quantized module has on disk.

Keys, for a quantized module M (a linear layer, the embedding or lm_head):
    M.qweight, M.scales (+ M.zeros for int4) (+ M.bias when the layer has one, in high precision)
and for the routed experts of a layer (M = model.layers.i.mlp.experts), per part P in
{gate_up_proj, down_proj}:
    M.P.qweight, M.P.scales (+ M.P.zeros), stacked over experts [E, ...].
Everything else is stored as in a float checkpoint, under its usual name and dtype.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from ..config import CloverConfig
from .ops import (
    GROUP_SIZES,
    INT4_SCALE_DTYPE,
    INT8_SCALE_DTYPE,
    padded_k,
    quantize_int4,
    quantize_int8,
)

QUANT_METHOD = "clover-weight-only"
FORMAT_VERSION = 1

# the linear layers that are quantized by default (suffixes of module names)
LINEAR_SUFFIXES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.out_proj",
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
    "mlp.gate_proj",  # the dense backbone's MLP
    "mlp.up_proj",
    "mlp.down_proj",
    "self_attn.query_key_value",  # LLaDA2 (BailingMoeV2): fused QKV, output `dense`, `shared_experts`
    "self_attn.dense",
    "mlp.shared_experts.gate_proj",
    "mlp.shared_experts.up_proj",
    "mlp.shared_experts.down_proj",
)
EXPERTS_SUFFIX = "mlp.experts"
EMBEDDING = "model.embed_tokens"
LM_HEAD = "lm_head"
EXPERT_PARTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Target:
    """A quantizable module: kind "linear" (N out, K in), "embedding" (N = vocab, K = hidden) or
    "experts" (N = experts, K = hidden, inter = expert intermediate size)."""

    name: str
    kind: str
    n: int
    k: int
    bias: bool = False
    inter: int = 0

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """{stored weight name: float shape} for the tensors this module quantizes."""
        if self.kind == "experts":
            return {
                f"{self.name}.gate_up_proj": (self.n, 2 * self.inter, self.k),
                f"{self.name}.down_proj": (self.n, self.k, self.inter),
            }
        return {f"{self.name}.weight": (self.n, self.k)}


def quantizable(config: CloverConfig) -> dict[str, Target]:
    """Every module the format can quantize, in model order (embeddings included): per layer the
    linear layers named by `LINEAR_SUFFIXES` that this architecture has, then its routed experts;
    the shapes are those of the model the config builds (on `meta`, nothing allocated)."""
    modules = _modules(config)
    c = config
    out: dict[str, Target] = {EMBEDDING: Target(EMBEDDING, "embedding", c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        for suffix in LINEAR_SUFFIXES:
            name = f"model.layers.{i}.{suffix}"
            if name in modules and isinstance(modules[name], torch.nn.Linear):
                m = modules[name]
                out[name] = Target(name, "linear", m.out_features, m.in_features, m.bias is not None)
        name = f"model.layers.{i}.{EXPERTS_SUFFIX}"
        if name in modules:
            out[name] = Target(name, "experts", modules[name].num_experts, c.hidden_size, inter=modules[name].inter)
    if not c.tie_word_embeddings:
        out[LM_HEAD] = Target(LM_HEAD, "linear", c.vocab_size, c.hidden_size)
    return out


_MODULES: dict[str, dict] = {}  # repr(config) -> its meta model's modules (footprint tables ask again and again)


def _modules(config: CloverConfig) -> dict:
    key = repr(config)
    if key not in _MODULES:
        from ..models import build_model

        _MODULES.clear()
        _MODULES[key] = dict(build_model(config, device="meta").named_modules())
    return _MODULES[key]


def select_modules(config: CloverConfig, *, include_embeddings: bool = False, skip: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The module names `clover quantize` converts. `skip` holds shell-style patterns matched against
    full module names (e.g. '*.self_attn.*', 'model.layers.0.*'); a pattern that matches nothing is an error."""
    all_targets = quantizable(config)
    names = [n for n in all_targets if include_embeddings or n not in (EMBEDDING, LM_HEAD)]
    for pat in skip:
        if not any(fnmatch.fnmatchcase(n, pat) for n in names):
            raise ValueError(f"--skip {pat!r} matches no quantizable module (e.g. {names[0]!r}); patterns are shell-style, matched against full module names")
    return [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in skip)]


def make_quantization_config(bits: int, group_size: int | None, modules: list[str], skip: list[str] | tuple[str, ...] = ()) -> dict:
    return {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "bits": bits,
        "group_size": group_size if bits == 4 else None,
        "scheme": "int8 symmetric per output channel" if bits == 8 else "int4 asymmetric per group along the input dim",
        "modules": list(modules),
        "skip": list(skip),
    }


def parse_quantization_config(qc: dict, config: CloverConfig, source: str) -> tuple[int, int | None, dict[str, Target]]:
    """Validate config.json's quantization_config -> (bits, group_size, {module name: Target})."""
    from ..weights import CheckpointError

    if not isinstance(qc, dict):
        raise CheckpointError(f"{source}: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise CheckpointError(f"{source}: quant_method {method!r} is not supported (expected {QUANT_METHOD!r}, written by `clover quantize`)")
    version = qc.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{source}: quantization format_version {version!r} is not supported (this clover reads {FORMAT_VERSION})")
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise CheckpointError(f"{source}: quantization bits must be 4 or 8, got {bits!r}")
    group = qc.get("group_size")
    if bits == 4 and (not isinstance(group, int) or group <= 0 or group % 2):
        raise CheckpointError(f"{source}: int4 needs a positive even group_size (one of {GROUP_SIZES}), got {group!r}")
    all_targets = quantizable(config)
    if "modules" in qc:
        modules = qc["modules"]
        if not isinstance(modules, list):
            raise CheckpointError(f"{source}: quantization_config.modules must be a list of module names")
        unknown = [m for m in modules if m not in all_targets]
        if unknown:
            raise CheckpointError(f"{source}: quantization_config lists module(s) this config has no quantizable layer for: {unknown[:5]}")
    else:
        try:
            modules = select_modules(config, include_embeddings=bool(qc.get("include_embeddings")), skip=qc.get("skip") or ())
        except ValueError as e:
            raise CheckpointError(f"{source}: {e}") from None
    return bits, (group if bits == 4 else None), {m: all_targets[m] for m in modules}


def tensor_specs(target: Target, bits: int, group_size: int | None) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{on-disk key: (dtype, shape)} of a quantized module (bias excluded: it stays float)."""
    out = {}
    for weight_name, shape in target.weight_shapes().items():
        base = weight_name.removesuffix(".weight")
        *lead, n, k = shape
        if bits == 8:
            out[f"{base}.qweight"] = (torch.int8, (*lead, n, k))
            out[f"{base}.scales"] = (INT8_SCALE_DTYPE, (*lead, n))
        else:
            kp = padded_k(k, group_size)
            out[f"{base}.qweight"] = (torch.uint8, (*lead, n, kp // 2))
            out[f"{base}.scales"] = (INT4_SCALE_DTYPE, (*lead, n, kp // group_size))
            out[f"{base}.zeros"] = (INT4_SCALE_DTYPE, (*lead, n, kp // group_size))
    return out


def quantize_tensor(w: torch.Tensor, bits: int, group_size: int | None, *, chunk_elems: int = 1 << 24) -> dict[str, torch.Tensor]:
    """A float weight [..., N, K] -> {"qweight", "scales"(, "zeros")}. Large weights are done in row
    blocks (rows are independent) so the fp32 temporaries stay small."""
    if w.numel() > chunk_elems and w.shape[-2] > 1:
        rows = max(1, chunk_elems // max(1, w.numel() // w.shape[-2]))
        parts = [quantize_tensor(c, bits, group_size, chunk_elems=chunk_elems) for c in w.split(rows, dim=-2)]
        # qweight and int4 scales/zeros are [..., N, x]: rows on dim -2; int8 scales are [..., N]
        return {k: torch.cat([p[k] for p in parts], dim=-2 if parts[0][k].dim() == w.dim() else -1) for k in parts[0]}
    if bits == 8:
        q, s = quantize_int8(w)
        return {"qweight": q, "scales": s}
    q, s, z = quantize_int4(w, group_size)
    return {"qweight": q, "scales": s, "zeros": z}
