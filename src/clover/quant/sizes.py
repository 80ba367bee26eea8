"""The weight footprint of any config (e.g. the full 35B-A3B) at fp32 / bf16 / int8 / int4: bytes on
disk and in memory, computed from the shapes alone (docs/quantization.md)."""

from __future__ import annotations

from .ops import INT4_SCALE_DTYPE, INT8_SCALE_DTYPE, padded_k


def footprint(config, *, bits: int | None = None, group_size: int = 64, include_embeddings: bool = False,
              float_bytes: int = 2, skip: tuple[str, ...] = ()) -> dict:
    """Weight bytes of `config` at a precision: bits None = everything in `float_bytes`; 8/4 = the
    modules `clover quantize` converts (with these options) in int8/int4, the rest in `float_bytes`.

    Returns {"params", "quantized_params", "disk_bytes", "memory_bytes"}; memory assumes a 16-bit
    compute dtype for the int8 scales and the int4 scales/zeros (as the kernels hold them) and
    counts weights only (no KV/GDN cache, no activations)."""
    from .format import quantizable, select_modules

    from ..models import parameter_counts

    total = parameter_counts(config)["total"]
    if bits is None:
        b = total * float_bytes
        return {"params": total, "quantized_params": 0, "disk_bytes": b, "memory_bytes": b}
    targets = quantizable(config)
    qparams = disk = mem = 0
    for name in select_modules(config, include_embeddings=include_embeddings, skip=skip):
        for shape in targets[name].weight_shapes().values():
            *lead, n, k = shape
            rows = n
            for d in lead:
                rows *= d
            qparams += rows * k
            if bits == 8:
                disk += rows * k + rows * INT8_SCALE_DTYPE.itemsize
                mem += rows * k + rows * 2
            else:
                kp = padded_k(k, group_size)
                sz = 2 * rows * (kp // group_size) * INT4_SCALE_DTYPE.itemsize
                disk += rows * kp // 2 + sz
                mem += rows * kp // 2 + sz
    if qparams > total:
        raise AssertionError("quantized more parameters than the model has")
    rest = (total - qparams) * float_bytes
    return {"params": total, "quantized_params": qparams, "disk_bytes": disk + rest, "memory_bytes": mem + rest}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def footprint_table(config=None) -> str:
    """A markdown table of the weight footprint at bf16 / int8 / int4 (default: the full 35B-A3B)."""
    from ..models.qwen3_5_moe import full_size_config

    config = config or full_size_config()
    rows = [
        ("fp32", dict(bits=None, float_bytes=4)),
        ("bf16", dict(bits=None)),
        ("int8 (embeddings bf16)", dict(bits=8)),
        ("int8 + embeddings", dict(bits=8, include_embeddings=True)),
        ("int4 g128 (embeddings bf16)", dict(bits=4, group_size=128)),
        ("int4 g64 (embeddings bf16)", dict(bits=4, group_size=64)),
        ("int4 g32 (embeddings bf16)", dict(bits=4, group_size=32)),
        ("int4 g64 + embeddings", dict(bits=4, group_size=64, include_embeddings=True)),
    ]
    out = ["| precision | quantized params | disk | weights in memory | bits / param |", "|---|---:|---:|---:|---:|"]
    for label, kw in rows:
        f = footprint(config, **kw)
        out.append(f"| {label} | {f['quantized_params'] / 1e9:.2f} B of {f['params'] / 1e9:.2f} B | {_gib(f['disk_bytes'])} | "
                   f"{_gib(f['memory_bytes'])} | {8 * f['disk_bytes'] / f['params']:.2f} |")
    return "\n".join(out)


PLAN_PRECISIONS = (("bf16", dict(bits=None)), ("int8", dict(bits=8)), ("int4 g64", dict(bits=4, group_size=64)))


def memory_plan(config, *, context: int, batch: int = 1, kv_elem: int = 2) -> dict:
    """What decoding `config` holds: its parameters (total, active per token), and per weight precision
    the weights in memory plus the K/V cache of `batch` rows of `context` tokens (`kv_elem` bytes a
    value; `clover.cache.kv_bytes`). From the shapes alone (the model built on `meta`); activations
    and the allocator's slack are left out."""
    from ..cache import kv_bytes
    from ..models import parameter_counts

    if context < 1 or batch < 1:
        raise ValueError(f"context and batch must be positive, got {context} and {batch}")
    counts = parameter_counts(config)
    kv = kv_bytes(config, context, elem=kv_elem) * batch
    rows = {}
    for label, kw in PLAN_PRECISIONS:
        w = footprint(config, **kw)["memory_bytes"]
        rows[label] = {"weights_bytes": w, "kv_bytes": kv, "total_bytes": w + kv}
    return {"model_type": config.model_type, "parameters": counts, "context": context, "batch": batch,
            "kv_bytes_per_token": kv_bytes(config, 1, elem=kv_elem), "precisions": rows}


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.1f} KiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def format_memory_plan(plan: dict, name: str) -> str:
    p = plan["parameters"]
    out = [f"{name} ({plan['model_type']}): {_count(p['total'])} parameters, {_count(p['active'])} active per token; "
           f"K/V {_size(plan['kv_bytes_per_token'])} a token",
           f"memory at {plan['context']:,} tokens x {plan['batch']} row(s) (weights + bf16 K/V; activations not counted):",
           "| weights | weights in memory | K/V cache | total |", "|---|---:|---:|---:|"]
    for label, r in plan["precisions"].items():
        out.append(f"| {label} | {_size(r['weights_bytes'])} | {_size(r['kv_bytes'])} | {_size(r['total_bytes'])} |")
    return "\n".join(out)
