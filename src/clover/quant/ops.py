"""The arithmetic of clover's weight-only formats: quantize, pack, dequantize, and the low-bit matmuls.

On-disk layouts (format_version 1), for a weight W [N, K] (N output rows, K inputs):

- INT8, symmetric per output channel: `qweight` int8 [N, K], `scales` fp32 [N];
  W ≈ qweight * scales[:, None], qweight in [-127, 127]; scale = max|row| / 127 rounded up to a
  float16 value where that is a normal float16, so GGUF's Q8_0 (float16 block scales) holds the same
  weights bit for bit.
- INT4, asymmetric per group of G inputs: K is padded with zeros to Kp = ceil(K / G) * G;
  `qweight` uint8 [N, Kp / 2] holds two 4-bit codes per byte, the even input in the high nibble
  (byte = q[2j] << 4 | q[2j + 1]); `scales` and `zeros` bf16 [N, Kp / G];
  W ≈ (q - 8) * scale + zero, q in [0, 15] — the convention of the int4 matmul kernels, where
  `zero` is the group's value at code 8 (= min + 8 * scale). The padded inputs are dropped.

Expert weights stack the same layout per expert: [E, N, ...].

Fast paths (`int8_matmul`, `Int4Weights`): `aten._weight_int8pack_mm` on CPU (K a multiple of 16,
aligned operands);
`aten._convert_weight_to_int4pack_for_cpu` + `aten._weight_int4pack_mm_for_cpu` on CPU (N a multiple
of 16, G in {32, 64, 128, 256}); `aten._convert_weight_to_int4pack` + `aten._weight_int4pack_mm` on
CUDA (bf16 activations, N a multiple of 8, Kp a multiple of 32). Each fast path is checked once
per (device, shape class) against the dequantize reference before it is used; anything that is not
available, not supported for the shape, or fails that check falls back to dequantize-then-matmul.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

INT4_KERNEL_GROUPS = (32, 64, 128, 256)
GROUP_SIZES = (32, 64, 128)  # what `clover quantize` offers
INT4_SCALE_DTYPE = torch.bfloat16
INT8_SCALE_DTYPE = torch.float32
# the CPU int8 kernel crashes on weights or activations that are not 16/32-byte aligned; it is
# only used on ALIGNMENT-aligned operands (weights are copied to fresh, aligned memory at load)
ALIGNMENT = 64
# The CPU int8/int4 kernels are fast with 16-bit activations and an order of magnitude slower with fp32
# ones, slower than the float matmul they replace (docs/quantization.md). With this True, fp32 activations are rounded to bf16 for the
# low-bit matmul only (the output returns in fp32): an error at or below the weight quantization
# error (bf16 keeps 8 bits of mantissa). False = exact fp32 (int8: integer weights cast per call).
FP32_VIA_BF16 = True


# --------------------------------------------------------------------------------------- int8
FP16_MIN_NORMAL = 2.0**-14


def fp16_scale_at_least(s: torch.Tensor) -> torch.Tensor:
    """The smallest float16 value >= each (positive, fp32) scale, as fp32, where that is a normal
    float16 (relative change < 2^-10); elsewhere (rows with max |w| under ~7.8e-3, or past float16's
    range) the scale itself, whose precision a float16 could not keep. A scale rounded this way is
    one GGUF's Q8_0 stores exactly (its block scale is float16); rounding up keeps every code within
    [-127, 127]."""
    h = s.to(torch.float16)
    h = torch.where(h.float() < s, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    return torch.where(torch.isfinite(h) & (h >= FP16_MIN_NORMAL), h.float(), s)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (qweight int8 [..., N, K], scales fp32 [..., N]); scale = max|row| / 127
    rounded up to a float16 value (`fp16_scale_at_least`)."""
    wf = w.float()
    amax = wf.abs().amax(dim=-1)
    scales = torch.where(amax > 0, fp16_scale_at_least(amax / 127.0), torch.ones_like(amax))
    q = torch.round(wf / scales[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scales.to(INT8_SCALE_DTYPE)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """-> fp32 [..., N, K]."""
    return q.float() * scales.float()[..., None]


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGNMENT == 0


def _aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and ALIGNMENT-aligned (a fresh allocation is; a slice or a tensor read from a
    safetensors file may not be)."""
    t = t.contiguous()
    return t if _aligned(t) else t.clone()


def _int8_fast_available(device: torch.device, k: int) -> bool:
    # the CPU kernel reads past the row (wrong results or a crash) unless K is a multiple of 16
    return device.type == "cpu" and k % 16 == 0 and hasattr(torch.ops.aten, "_weight_int8pack_mm")


# The CPU int8 kernel costs about M GEMVs (it re-reads the weight per row); torch's bf16 GEMM reads it
# once. From these many rows, casting the int8 weight to bf16 per call and using the bf16 GEMM is
# faster (`clover bench matmul`, docs/benchmarks.md "Matmul paths"): 32 rows for weights of up to
# INT8_CAST_SMALL elements (experts, shared expert, out projections), 64 rows for larger ones.
INT8_CAST_SMALL = 1 << 22
INT8_CAST_ROWS = (32, 64)


def int8_cast_rows(n: int, k: int) -> int:
    """Row count from which `int8_matmul` on CPU casts the weight and uses the bf16 GEMM."""
    return INT8_CAST_ROWS[0] if n * k <= INT8_CAST_SMALL else INT8_CAST_ROWS[1]


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, *, fast: bool = True) -> torch.Tensor:
    """x [M, K] @ (q * scales)^T -> [M, N] in x.dtype. Per-channel scales factor out of the sum, so the
    fallback multiplies the integer weights (exact in any float dtype) and scales the output. On CPU
    with 16-bit activations and M >= `int8_cast_rows`, that same cast path is also the fast one."""
    if (fast and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[0] >= int8_cast_rows(*q.shape)):
        s = scales if scales.dtype == x.dtype else scales.to(x.dtype)
        return F.linear(x, q.to(x.dtype)) * s
    if fast and x.shape[0] > 0 and _int8_fast_available(x.device, x.shape[-1]) and _aligned(q):
        if x.dtype in (torch.bfloat16, torch.float16):
            s = scales if scales.dtype == x.dtype else scales.to(x.dtype)
            return torch.ops.aten._weight_int8pack_mm(_aligned_copy(x), q, s)
        if x.dtype == torch.float32 and FP32_VIA_BF16:
            s = scales if scales.dtype == torch.bfloat16 else scales.to(torch.bfloat16)
            return torch.ops.aten._weight_int8pack_mm(_aligned_copy(x.to(torch.bfloat16)), q, s).float()
    s = scales if scales.dtype == x.dtype else scales.to(x.dtype)
    return F.linear(x, q.to(x.dtype)) * s


# --------------------------------------------------------------------------------------- int4
def padded_k(k: int, group_size: int) -> int:
    return math.ceil(k / group_size) * group_size


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (qweight uint8 [..., N, Kp/2], scales bf16 [..., N, Kp/G], zeros bf16 [..., N, Kp/G]).

    Per group: scale = (max - min) / 15, zero = min + 8 * scale (both rounded to bf16 first, then the
    codes are computed against the rounded values so the stored triple is self-consistent)."""
    if group_size % 2 or group_size <= 0:
        raise ValueError(f"group size must be a positive even number, got {group_size}")
    *lead, n, k = w.shape
    kp = padded_k(k, group_size)
    wf = w.float()
    if kp != k:
        wf = F.pad(wf, (0, kp - k))
    g = wf.reshape(*lead, n, kp // group_size, group_size)
    mn, mx = g.amin(-1), g.amax(-1)
    scales = ((mx - mn) / 15.0).clamp(min=1e-8)  # constant groups: any positive scale, zero = the value
    zeros = mn + 8.0 * scales
    scales, zeros = scales.to(INT4_SCALE_DTYPE), zeros.to(INT4_SCALE_DTYPE)
    q = torch.round((g - zeros.float()[..., None]) / scales.float()[..., None]) + 8
    q = q.clamp_(0, 15).to(torch.uint8).reshape(*lead, n, kp)
    return pack_int4(q), scales, zeros


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """codes [..., Kp] (0..15) -> uint8 [..., Kp/2], even index in the high nibble."""
    q = q.to(torch.uint8)
    return (q[..., 0::2] << 4) | q[..., 1::2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., Kp/2] -> codes uint8 [..., Kp]."""
    hi, lo = packed >> 4, packed & 0x0F
    return torch.stack([hi, lo], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int) -> torch.Tensor:
    """-> fp32 [..., N, K] (the padding dropped)."""
    q = unpack_int4(packed).float()
    n_groups = scales.shape[-1]
    gs = q.shape[-1] // n_groups
    q = q.reshape(*q.shape[:-1], n_groups, gs)
    w = (q - 8.0) * scales.float()[..., None] + zeros.float()[..., None]
    return w.reshape(*w.shape[:-2], n_groups * gs)[..., :k]


# ------------------------------------------------------------------------- int4 fast-path probe
_PROBED: dict[tuple, bool] = {}
_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _inner_k_tiles(kp: int) -> int | None:
    for t in (8, 4, 2):
        if kp % (16 * t) == 0:
            return t
    return None


def int4_kernel(device: torch.device, n: int, kp: int, group_size: int) -> str | None:
    """Which int4 matmul kernel serves a weight [n, kp] with this group on `device`: "cpu", "cuda" or
    None (dequantize fallback)."""
    if group_size not in INT4_KERNEL_GROUPS or kp % group_size:
        return None
    if device.type == "cpu":
        if n % 16 or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return None
        kind = "cpu"
    elif device.type == "cuda":
        if n % 8 or _inner_k_tiles(kp) is None or not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
            return None
        kind = "cuda"
    else:
        return None
    key = (kind, str(device), kp, group_size)
    if key not in _PROBED:
        _PROBED[key] = _probe(device, kind, kp, group_size)
    return kind if _PROBED[key] else None


def _probe(device: torch.device, kind: str, kp: int, group_size: int) -> bool:
    """Run the kernel once on a random weight and compare with the dequantize reference."""
    gen = torch.Generator().manual_seed(1234)
    n = 16
    w = torch.randn(n, kp, generator=gen)
    packed, scales, zeros = quantize_int4(w, group_size)
    x = torch.randn(3, kp, generator=gen)
    dt = torch.bfloat16  # the kernels' native activation dtype; a layout error shows as an O(1) error
    ref = x.to(dt).float() @ dequantize_int4(packed, scales, zeros, kp).t()
    try:
        weights = Int4Weights.pack(packed.to(device), scales.to(device), zeros.to(device), kp, group_size, dt, kernel=kind)
        y = weights.matmul(x.to(device=device, dtype=dt)).float().cpu()
    except Exception as e:  # not compiled for this device/arch, or a signature change
        _warn_once(f"int4 {kind} kernel unavailable ({type(e).__name__}: {e}); using dequantize-then-matmul")
        return False
    tol = 3e-2
    err = (y - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    if not err < tol:
        _warn_once(f"int4 {kind} kernel disagrees with the dequantize reference (rel. err {err:.3g}); using dequantize-then-matmul")
        return False
    return True


class Int4Weights:
    """One int4 weight [N, K] (or a stack [E, N, K]) held in the layout its matmul wants.

    kernel "cpu"/"cuda": `data` is the kernel's packed layout, `sz` the kernel's scales-and-zeros
    [.., Kp/G, N, 2] in the compute dtype; kernel None: `data` is the on-disk layout and `sz` the
    same scales and zeros (dequantized per call)."""

    def __init__(self, data: torch.Tensor, sz: torch.Tensor, k: int, group_size: int, kernel: str | None) -> None:
        self.data, self.sz, self.k, self.group_size, self.kernel = data, sz, k, group_size, kernel

    @property
    def kp(self) -> int:
        return padded_k(self.k, self.group_size)

    @classmethod
    def pack(
        cls,
        packed: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        k: int,
        group_size: int,
        dtype: torch.dtype,
        *,
        kernel: str | None | bool = True,
    ) -> Int4Weights:
        """packed/scales/zeros: the on-disk tensors (already on the target device). kernel=True picks
        the fast path for the device when it is available; False forces the fallback."""
        device = packed.device
        n, kp = packed.shape[-2], packed.shape[-1] * 2
        if kernel is True:
            kernel = int4_kernel(device, n, kp, group_size)
        elif kernel is False:
            kernel = None
        sz = torch.stack([scales, zeros], dim=-1).transpose(-3, -2)  # [.., Kp/G, N, 2]
        if kernel is None:
            return cls(packed, sz.to(dtype).contiguous(), k, group_size, None)
        # kernels: keep the stored bf16 scales/zeros (fp16 activations get fp16 ones); cast per call otherwise
        dtype = torch.float16 if (dtype == torch.float16 and kernel == "cpu") else torch.bfloat16
        flat = packed.reshape(-1, n, kp // 2)
        outs = []
        for i in range(flat.shape[0]):
            if kernel == "cpu":
                codes = unpack_int4(flat[i]).to(torch.int32)
                outs.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1))
            else:
                outs.append(torch.ops.aten._convert_weight_to_int4pack(flat[i].contiguous(), _inner_k_tiles(kp)))
        data = torch.stack(outs).reshape(*packed.shape[:-2], *outs[0].shape)
        return cls(data, sz.to(dtype).contiguous(), k, group_size, kernel)

    def matmul(self, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N] in x.dtype; `index` picks one weight of a stack."""
        data = self.data if index is None else self.data[index]
        sz = self.sz if index is None else self.sz[index]
        kp = self.kp
        if x.shape[0] == 0:
            return x.new_zeros(0, sz.shape[-2])
        if self.kernel is None:
            scales, zeros = sz[..., 0].transpose(0, 1), sz[..., 1].transpose(0, 1)
            w = dequantize_int4(data, scales, zeros, self.k)
            return F.linear(x, w.to(x.dtype))
        if kp != self.k:
            x = F.pad(x, (0, kp - self.k))
        if self.kernel == "cpu":
            if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise TypeError(f"int4 matmul needs a float input, got {x.dtype}")
            if x.dtype == torch.float32 and FP32_VIA_BF16:
                xb = x.to(torch.bfloat16).contiguous()
                s = sz if sz.dtype == torch.bfloat16 else sz.to(torch.bfloat16)
                return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, data, self.group_size, s).to(x.dtype)
            s = sz if sz.dtype == x.dtype else sz.to(x.dtype)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), data, self.group_size, s)
        xb = x.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm(xb, data, self.group_size, sz)
        return y.to(x.dtype)

    def to_tensors(self) -> list[torch.Tensor]:
        return [self.data, self.sz]
