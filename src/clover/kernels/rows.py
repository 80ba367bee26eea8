"""Float32 matmuls of a few rows that read each weight once at a GEMV's speed (`rows.c`, built here).

`linear(x, weight, bias)` is `F.linear` for x of 1…`MAX_ROWS` rows and a row-major weight [N, K] as
`nn.Linear` stores it: a tile of several weight rows × up to 8 activation rows keeps its
accumulators in registers, so each weight vector is loaded once from memory and used for every row
(docs/kernels.md, "Few-row matmuls"). `experts` runs a block's routed SwiGLU experts in one call:
each touched expert once, on the rows of the tokens routed to it.

The C source is compiled on first use with the system compiler (`$CC`, else `cc`; `-O3 -march=native`,
so AVX-512 or AVX2 where the CPU has them, else a scalar loop) into the user cache
(`$CLOVER_KERNELS`, else `${XDG_CACHE_HOME:-~/.cache}/clover/kernels/`), keyed by the source, the
compiler and the CPU's flags, and loaded with ctypes. Where there is no compiler or the build fails,
`library()` is None (one warning, once) and callers keep their torch path. The kernel is
single-threaded: callers use it only while torch runs one thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from ..paths import user_cache

SOURCE = Path(__file__).with_name("rows.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
MAX_ROWS = 16  # above this the tiles re-read each weight row from cache for every 8 rows: oneDNN's GEMM wins

_lib: ctypes.CDLL | bool | None = None  # None: not tried yet; False: no compiler, or the build failed


def library() -> ctypes.CDLL | None:
    """The built kernel (built and loaded on the first call), or None where it cannot be built."""
    global _lib
    if _lib is None:
        try:
            _lib = _load()
        except (OSError, subprocess.SubprocessError) as e:
            msg = " ".join(str(e).split())[:300]
            warnings.warn(f"clover.kernels.rows: the few-row matmul kernel could not be built ({msg}); "
                          "using torch's matmuls", RuntimeWarning, stacklevel=2)
            _lib = False
    return _lib or None


def isa() -> str | None:
    """The vector ISA the kernel was built for ("avx512", "avx2", "scalar"), None where it is not built."""
    lib = library()
    return lib.clover_rows_isa().decode() if lib else None


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise OSError(f"no C compiler: {cc!r} is not on PATH (set $CC)")
    return path


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _load(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """Build (unless the cache has it) and load the kernel with compiler `flags`."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join(s.encode() for s in (SOURCE.read_text(), cc, version, _cpu_flags(),
                                                          platform.machine(), *flags))).hexdigest()[:16]
    out = user_cache("kernels", env="CLOVER_KERNELS") / f"rows-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise OSError(f"{cc} exited with {r.returncode}: {r.stderr.strip()}")
            os.replace(tmp, out)  # atomic: a concurrent build writes the same bytes
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(out))
    P, I = ctypes.c_void_p, ctypes.c_ssize_t
    lib.clover_rows_isa.restype = ctypes.c_char_p
    lib.clover_rows_linear.argtypes = [P, I, P, I, P, P, I, I, I, I]
    lib.clover_rows_linear.restype = None
    lib.clover_rows_experts.argtypes = [P, I, I, P, P, I, P, P, I, I, P, P, P, P]
    lib.clover_rows_experts.restype = None
    return lib


def _check(name: str, t: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"clover.kernels.rows: {name} must be a contiguous {dtype} CPU tensor "
                         f"(got {t.dtype}, {t.device}, strides {tuple(t.stride())})")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through the kernel: x [..., K] (at most `MAX_ROWS` rows in all),
    weight [N, K], bias [N], contiguous float32 CPU tensors (a ValueError otherwise). The caller
    checks `library()` first."""
    lib = library()
    if lib is None:
        raise RuntimeError("clover.kernels.rows: the kernel is not built (see the warning)")
    _check("x", x)
    _check("weight", weight)
    if bias is not None:
        _check("bias", bias)
    N, K = weight.shape
    M = x.numel() // K if K else 0
    if x.shape[-1] != K or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"clover.kernels.rows: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not match")
    if not 0 < M <= MAX_ROWS:
        raise ValueError(f"clover.kernels.rows: {M} rows (1…{MAX_ROWS})")
    y = x.new_empty(*x.shape[:-1], N)
    lib.clover_rows_linear(x.data_ptr(), K, weight.data_ptr(), K, bias.data_ptr() if bias is not None else None,
                           y.data_ptr(), N, M, N, K)
    return y


def experts(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts through the kernel: x [N, H] (N ≥ 1 tokens), top_idx [N, k]
    (int64) / top_w [N, k]; gate_up [E, 2I, H] (gate rows first), down [E, H, I] -> [N, H], the sum
    over each token's experts of its weight × the expert's output (`moe.reference_expert_forward`)."""
    lib = library()
    if lib is None:
        raise RuntimeError("clover.kernels.rows: the kernel is not built (see the warning)")
    for name, t in (("x", x), ("top_w", top_w), ("gate_up", gate_up), ("down", down)):
        _check(name, t)
    _check("top_idx", top_idx, torch.int64)
    N, H = x.shape
    E, I2, H2 = gate_up.shape
    k = top_idx.shape[-1]
    if H2 != H or down.shape != (E, H, I2 // 2) or top_idx.shape != (N, k) or top_w.shape != (N, k):
        raise ValueError(f"clover.kernels.rows: experts of x {tuple(x.shape)}, top_idx {tuple(top_idx.shape)}, "
                         f"top_w {tuple(top_w.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
    if N <= 0:
        raise ValueError(f"clover.kernels.rows: {N} tokens (at least 1)")
    lo, hi = torch.aminmax(top_idx)
    if int(lo) < 0 or int(hi) >= E:
        raise ValueError(f"clover.kernels.rows: expert ids outside 0…{E - 1}")
    out = torch.zeros_like(x)
    scratch = x.new_empty(N * (2 * H + 3 * (I2 // 2)))
    rows = top_idx.new_empty(N)
    row_w = x.new_empty(N)
    lib.clover_rows_experts(x.data_ptr(), N, H, top_idx.data_ptr(), top_w.data_ptr(), k, gate_up.data_ptr(),
                            down.data_ptr(), E, I2 // 2, out.data_ptr(), scratch.data_ptr(), rows.data_ptr(),
                            row_w.data_ptr())
    return out
