"""`clover bench matmul`: the CPU matmul paths per dtype and row count, at the 35B-A3B's layer shapes.

For a weight W [N, K] and activations x [M, K] (M = 1 is an AR step's GEMV, M = 32 a denoise block
or an expert's share of a verify forward), each path computes x @ Wᵀ:

- `fp32`: `F.linear` with fp32 x and W;
- `bf16`: `F.linear` with bf16 x and W (torch's oneDNN/mkldnn bf16 GEMM);
- `int8`: `aten._weight_int8pack_mm` (bf16 x, int8 W per output channel) — `Int8Linear`'s path;
- `int4`: `aten._weight_int4pack_mm_for_cpu` (bf16 x, int4 W, group 64) — `Int4Linear`'s path;
- `int4-dq`: dequantize the int4 weight to bf16, then `F.linear` (the fallback path), for reference;
- `fp32-onednn`: oneDNN's linear on the fp32 weight packed once (`clover.kernels.packed`), opt-in;
- `fp32-rows`: the row kernel on the plain fp32 weight (`clover.kernels.rows`, M ≤ 16), opt-in.

Paths run interleaved (every path per repetition, round-robin) after one warm-up; the median is
reported with the weight bytes read per call and the resulting GB/s (bytes of W / time: the
number that bounds batch-1 decoding) and GFLOP/s. `cold` > 1 cycles each path through that many
copies of the weight, one per call, so that a weight whose copies outgrow the last-level cache
comes from memory, as a large model's weights do in a forward (the 0.7B figures use 12). A path
that does not apply (no oneDNN, no row kernel, M above its rows) has no time. `quick=True` uses
small shapes (tests).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from .common import machine
from .kernels import interleaved

SCHEMA = "clover.bench.matmul/1"
PATHS = ("fp32", "bf16", "int8", "int4", "int4-dq")  # the default
FP32_PATHS = ("fp32", "fp32-onednn", "fp32-rows")  # the few-row fp32 paths, opt-in
ALL_PATHS = PATHS + FP32_PATHS[1:]
ROWS = (1, 2, 4, 8, 16, 32, 64)


def slice_shapes(quick: bool = False) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the 35B-A3B's linear layers (the lm_head is a 32k-row slice of its 248k)."""
    if quick:
        return {"expert gate_up": (128, 128), "expert down": (128, 64)}
    return {
        "GDN in_proj_qkv": (8192, 2048),
        "GDN out_proj / attn o_proj": (2048, 4096),
        "expert gate_up": (1024, 2048),
        "expert down": (2048, 512),
        "shared expert up": (512, 2048),
        "lm_head (32k of 248k rows)": (32768, 2048),
    }


def _fns(N: int, K: int, M: int, paths: tuple[str, ...], gen: torch.Generator, group_size: int = 64, cold: int = 1):
    from ..kernels import packed, rows as row_kernel
    from ..quant.ops import Int4Weights, _aligned_copy, dequantize_int4, quantize_int4, quantize_int8

    w = torch.randn(N, K, generator=gen) * 0.02
    x = torch.randn(M, K, generator=gen)
    xb = _aligned_copy(x.to(torch.bfloat16))
    fns, ref, nbytes = {}, {}, {}
    ws = [w] + [w.clone() for _ in range(cold - 1)]  # one per call, round and round

    def cycled(fn, weights):
        it = itertools.cycle(weights)
        return lambda: fn(next(it))

    if "fp32" in paths:
        fns["fp32"] = cycled(lambda wi: F.linear(x, wi), ws)
        nbytes["fp32"] = w.numel() * 4
    if "fp32-onednn" in paths and packed.available():
        fns["fp32-onednn"] = cycled(lambda p: packed._packed_mm(x, p, None), [packed.Pack(wi) for wi in ws])
        ref["fp32-onednn"], nbytes["fp32-onednn"] = x @ w.t(), w.numel() * 4
    if "fp32-rows" in paths and M <= row_kernel.MAX_ROWS and row_kernel.library() is not None:
        fns["fp32-rows"] = cycled(lambda wi: row_kernel.linear(x, wi), ws)
        ref["fp32-rows"], nbytes["fp32-rows"] = x @ w.t(), w.numel() * 4
    if "bf16" in paths:
        wb = w.to(torch.bfloat16)
        fns["bf16"] = lambda: F.linear(xb, wb)
        nbytes["bf16"] = wb.numel() * 2
    if "int8" in paths:
        q, s = quantize_int8(w)
        q, sb = _aligned_copy(q), s.to(torch.bfloat16)
        fns["int8"] = lambda: torch.ops.aten._weight_int8pack_mm(xb, q, sb)
        ref["int8"] = xb.float() @ (q.float() * s[:, None]).t()
        nbytes["int8"] = q.numel() + s.numel() * 2
    if "int4" in paths or "int4-dq" in paths:
        packed, scales, zeros = quantize_int4(w, group_size)
        ref_w = dequantize_int4(packed, scales, zeros, K)
        if "int4" in paths:
            i4 = Int4Weights.pack(packed, scales, zeros, K, group_size, torch.bfloat16)
            fns["int4"] = lambda: i4.matmul(xb)
            ref["int4"] = xb.float() @ ref_w.t()
            nbytes["int4"] = i4.data.numel() * i4.data.element_size() + i4.sz.numel() * i4.sz.element_size()
        if "int4-dq" in paths:
            fns["int4-dq"] = lambda: F.linear(xb, dequantize_int4(packed, scales, zeros, K).to(torch.bfloat16))
            nbytes["int4-dq"] = packed.numel() + scales.numel() * 4
    return fns, ref, nbytes


def run_matmul(*, quick: bool = False, rows: tuple[int, ...] = ROWS, paths: tuple[str, ...] = PATHS,
               repeat: int | None = None, seed: int = 0, cold: int = 1, progress=None) -> dict:
    repeat = repeat or (3 if quick else 7)
    say = progress or (lambda msg: None)
    gen = torch.Generator().manual_seed(seed)
    results = []
    with torch.inference_mode():
        for name, (N, K) in slice_shapes(quick).items():
            for M in rows:
                say(f"{name} M={M}")
                fns, ref, nbytes = _fns(N, K, M, paths, gen, cold=cold)
                # big weights: fewer inner calls; small ones: several per timing; cold: every copy
                inner = max(cold, min(20, int(4e6 // (N * K))))
                ms = interleaved(fns, repeat=repeat, inner=inner)
                err = {}
                for p, r in ref.items():
                    y = fns[p]().float()
                    err[p] = float((y - r).abs().max() / r.abs().max().clamp(min=1e-6))
                fastest = min(ms, key=ms.get)
                results.append({
                    "shape": name, "N": N, "K": K, "M": M, "ms": ms, "fastest": fastest,
                    "weight_bytes": nbytes,
                    "gbps": {p: nbytes[p] / (t / 1e3) / 1e9 for p, t in ms.items()},
                    "gflops": {p: 2 * M * N * K / (t / 1e3) / 1e9 for p, t in ms.items()},
                    "rel_err_vs_reference": err,
                })
    return {"schema": SCHEMA, "quick": quick, "repeat": repeat, "cold": cold, "paths": list(paths),
            "rows": list(rows), "machine": machine(), "results": results}


def matmul_table(result: dict):
    from rich.table import Table

    paths = result["paths"]
    t = Table(title=(f"clover bench matmul · ms per call (weight GB/s) · {result['machine']['torch_threads']} threads · "
                     "bf16 activations for bf16/int8/int4"), title_justify="left")
    t.add_column("shape (N × K)")
    t.add_column("M", justify="right")
    for p in paths:
        t.add_column(p, justify="right")
    t.add_column("fastest")
    last = None
    for r in result["results"]:
        label = f"{r['shape']} ({r['N']} × {r['K']})" if r["shape"] != last else ""
        last = r["shape"]
        t.add_row(label, str(r["M"]), *[f"{r['ms'][p]:.3f} ({r['gbps'][p]:.1f})" if p in r["ms"] else "—" for p in paths],
                  r["fastest"])
    return t
