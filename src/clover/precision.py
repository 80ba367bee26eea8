"""Whether this machine multiplies half-precision matrices natively.

On a CPU, torch runs bfloat16/float16 GEMMs through oneDNN, which is fast only with AVX-512 BF16/FP16
or AMX. Without them (AVX2-only CPUs, e.g. many AMD EPYC VMs) a bf16 GEMM falls back to a slow path:
measured on a 2-core AVX2 EPYC, one thread, a [2048, 256] x [256, 4096] matmul took 0.26 s in
float32 and 19 s in bfloat16 (74x), and a clover-tiny stage-2 training step 18 s in float32 vs
130-180 s under bf16 autocast (docs/training.md). Matrix-vector products (batch-1 decode) suffer
far less (2.2x). `load()` and the trainer's `run.autocast = "auto"` read this to pick float32 there.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def native_half_matmul(dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> bool:
    """True when `dtype` (bfloat16 or float16) matmuls run natively on `device` ("cpu" or "cuda")."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"native_half_matmul: expected bfloat16 or float16, got {dtype}")
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and (dtype == torch.float16 or torch.cuda.is_bf16_supported())
    if kind != "cpu":
        return True  # other accelerators: trust the user's choice
    try:
        check = torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else torch.ops.mkldnn._is_mkldnn_fp16_supported
        return bool(check())
    except (AttributeError, RuntimeError):  # a torch without these probes: assume native, as before
        return True


def cpu_capability() -> str:
    """torch's name for the CPU's vector ISA (e.g. "AVX2", "AVX512"), for messages and benchmarks."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"
