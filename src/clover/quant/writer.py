"""`clover quantize SRC DST`: a float checkpoint -> a weight-only INT8/INT4 one, shard by shard.

Each source shard is read tensor by tensor from its memory map; a tensor that belongs to a quantized
module is quantized on the spot, the rest are copied as they are, and the shard's output is written
before the next shard is opened, so at most one shard's worth of (mostly already quantized) tensors
is held at a time. Per-expert source weights (`mlp.experts.N.{gate,up,down}_proj.weight`) are
quantized one expert at a time and stacked once a layer's experts are all seen (quantization is
row-wise, so quantizing gate and up separately equals quantizing the fused gate_up rows).
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import CloverConfig
from ..models import read_config
from ..models import build_model
from ..weights import INDEX_FILE, SINGLE_FILE, CheckpointError, expected_shapes, iter_tensors, shard_files, write_safetensors
from .format import (
    EXPERT_PARTS,
    GROUP_SIZES,
    make_quantization_config,
    quantizable,
    quantize_tensor,
    select_modules,
)

WEIGHT_FILES = {INDEX_FILE, "config.json"}


def _float_state_shapes(config: CloverConfig) -> dict[str, torch.Size]:
    return expected_shapes(build_model(config, device="meta"))


def _n_keys(path: Path) -> int:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return len(list(f.keys()))
    except Exception:
        return 0  # iter_tensors reports the file properly


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    bits: int,
    group_size: int | None = 64,
    skip: list[str] | tuple[str, ...] = (),
    include_embeddings: bool = False,
    progress: bool = True,
) -> dict:
    """Write the quantized checkpoint (weights, config.json with `quantization_config`, tokenizer and
    other side files) to `dst`; returns the quantization_config."""
    from tqdm import tqdm

    src, dst = Path(src), Path(dst)
    if bits not in (4, 8):
        raise ValueError(f"--bits: must be 8 or 4, got {bits}")
    if bits == 4 and group_size not in GROUP_SIZES:
        raise ValueError(f"--group-size: must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such model directory")
    if dst.exists() and src.resolve() == dst.resolve():
        raise ValueError("destination must differ from the source directory")
    config = read_config(src)
    if config.quantization_config:
        raise ValueError(f"{src} is already quantized ({config.quantization_config.get('quant_method')}, "
                         f"{config.quantization_config.get('bits')} bits); quantize the float checkpoint")
    modules = select_modules(config, include_embeddings=include_embeddings, skip=skip)
    targets = quantizable(config)
    chosen = {m: targets[m] for m in modules}
    gs = group_size if bits == 4 else None
    # stored weight name -> (module name, expert part or None)
    quant_weights: dict[str, tuple[str, str | None]] = {}
    for m, t in chosen.items():
        for wname in t.weight_shapes():
            quant_weights[wname] = (m, wname.rsplit(".", 1)[1] if t.kind == "experts" else None)
    expected = _float_state_shapes(config)
    layout = build_model(config, device="meta").key_layout
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)

    files = shard_files(src)
    if dst.exists():
        if any(dst.iterdir()) and not (dst / "config.json").exists():
            raise ValueError(f"{dst}: exists, is not empty and is not a model directory; choose a new or empty folder")
        for old in list(dst.glob("*.safetensors")) + [dst / INDEX_FILE]:
            if old.exists():
                old.unlink()
    dst.mkdir(parents=True, exist_ok=True)

    n_out = len(files)
    out_names = [SINGLE_FILE] if n_out == 1 else [f"model-{i + 1:05d}-of-{n_out:05d}.safetensors" for i in range(n_out)]
    weight_map: dict[str, str] = {}
    seen: set[str] = set()
    pending: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(dict)  # per-expert sources
    total_bytes = 0
    E = config.num_experts if config.has_experts else 0  # experts stored one by one are stacked (MoE only)
    bar = tqdm(total=sum(_n_keys(p) for p in files), desc=f"quantize int{bits}", unit="tensor", disable=not progress)
    try:
        for path, out_name in zip(files, out_names):
            out: dict[str, torch.Tensor] = {}

            def emit(tensors: dict[str, torch.Tensor], out: dict[str, torch.Tensor] = out) -> None:
                out.update({k: v.contiguous() for k, v in tensors.items()})

            for key, t in iter_tensors(path, None):
                bar.update(1)
                name = layout.name(key)
                if name is None:
                    continue
                part = layout.expert_part(name)
                if part is not None:
                    prefix, e, proj = part
                    if not 0 <= e < E:
                        raise CheckpointError(f"{path}: key {key!r}: expert index {e} but the config has {E} experts")
                    fused = f"{prefix}.gate_up_proj" if proj != "down_proj" else f"{prefix}.down_proj"
                    want = expected.get(fused)
                    if want is None:
                        raise CheckpointError(f"{path}: unexpected key {key!r} (no such parameter in this model)")
                    per = tuple(want[1:]) if proj == "down_proj" else (want[1] // 2, want[2])
                    if tuple(t.shape) != per:
                        raise CheckpointError(f"{path}: key {key!r} has shape {tuple(t.shape)} but the config implies {per}")
                    q = prefix in chosen
                    pending[prefix].setdefault(e, {})[proj] = quantize_tensor(t, bits, gs) if q else t
                    if len(pending[prefix]) == E and all(len(v) == 3 for v in pending[prefix].values()):
                        _finish_experts(prefix, pending.pop(prefix), q, emit)
                        seen.update({f"{prefix}.gate_up_proj", f"{prefix}.down_proj"})
                    continue
                if name not in expected:
                    if config.tie_word_embeddings and name == "lm_head.weight":
                        continue  # tied: written once, as the embedding
                    raise CheckpointError(f"{path}: unexpected key {key!r} (no such parameter in this model); is config.json the one these weights were saved with?")
                if tuple(t.shape) != tuple(expected[name]):
                    raise CheckpointError(f"{path}: key {key!r} has shape {tuple(t.shape)} but the config implies {tuple(expected[name])}")
                seen.add(name)
                if name in quant_weights:
                    part = quant_weights[name][1]
                    base = name.removesuffix(".weight") if part is None else name
                    emit({f"{base}.{k}": v for k, v in quantize_tensor(t, bits, gs).items()})
                else:
                    out[name] = t
            # per-expert pieces completed in this shard were emitted by _finish_experts
            if out:
                write_safetensors(out, dst / out_name, metadata={"format": "pt", "quant_method": "clover-weight-only", "bits": str(bits)})
                total_bytes += sum(v.numel() * v.element_size() for v in out.values())
                weight_map.update({k: out_name for k in out})
            del out
    finally:
        bar.close()
    if pending:
        prefix = next(iter(pending))
        have = sorted(pending[prefix])
        raise CheckpointError(f"{src}: per-expert weights under {prefix!r} are incomplete ({len(have)} of {E} experts with all of gate/up/down_proj)")
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(repr(k) for k in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{src}: missing key(s) {shown}; the checkpoint is incomplete or for another model")
    written = sorted(set(weight_map.values()))
    if len(written) != 1 or written[0] != SINGLE_FILE:
        # drop empty shards from the naming and keep an index (file names stay as written)
        (dst / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2))

    qc = make_quantization_config(bits, gs, modules, skip)
    config.quantization_config = qc
    config.save(dst)
    for f in src.iterdir():
        if f.is_file() and f.name not in WEIGHT_FILES and f.suffix != ".safetensors" and not f.name.endswith((".bin", ".pt")):
            shutil.copy2(f, dst / f.name)
    return qc


def _finish_experts(prefix: str, experts: dict[int, dict], quantized: bool, emit) -> None:
    n = len(experts)
    if not quantized:
        gate_up = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], 0) for e in range(n)])
        down = torch.stack([experts[e]["down_proj"] for e in range(n)])
        emit({f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down})
        return
    keys = experts[0]["down_proj"].keys()
    for part in EXPERT_PARTS:
        tensors = {}
        for k in keys:
            if part == "gate_up_proj":
                tensors[f"{prefix}.{part}.{k}"] = torch.stack(
                    [torch.cat([experts[e]["gate_proj"][k], experts[e]["up_proj"][k]], 0) for e in range(n)]
                )
            else:
                tensors[f"{prefix}.{part}.{k}"] = torch.stack([experts[e]["down_proj"][k] for e in range(n)])
        emit(tensors)
