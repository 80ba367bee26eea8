"""Clover's INT8/INT4 weights as GGUF block types (`clover export-gguf` on a `clover quantize` directory).

The codes are carried over; nothing is quantized again:

- INT8 (one scale per output row, `W = q * scale`) -> **Q8_0** (blocks of 32 inputs, a float16 scale
  `d` and 32 int8 codes, `W = q * d`): every block of a row gets the row's scale and the row's codes.
  `clover quantize` rounds INT8 scales up to float16 values (`quant.ops.fp16_scale_at_least`), so the
  Q8_0 weights equal clover's bit for bit; a directory quantized before that rounding existed gets
  its scales rounded to nearest float16 (relative change <= 2^-11; the export says how many rows).
- INT4 (groups of G inputs, bfloat16 `scale` and `zero`, `W = (q - 8) * scale + zero`, q in 0..15)
  -> **Q4_1** (blocks of 32, float16 `d` and `m`, `W = q * d + m`): `d = scale` (exact: a bfloat16
  value inside float16's normal range is a float16 value) and `m = zero - 8 * scale` rounded to
  float16, the one rounding of the mapping (at most a few thousandths of one quantization step; the
  export reports the largest). A group of 64 or 128 is 2 or 4 Q4_1 blocks with the same `d`, `m`.
  Q4_0 (`W = (q - 8) * d`) has no zero point: it could hold clover's INT4 only where every zero is 0.

A weight whose rows are not a multiple of 32 inputs (or an INT4 group size that is not a multiple
of 32) has no such block form: it is written as float32, dequantized exactly as clover does.

A quantized weight travels through the export's tensor mapping as three planes of its float shape
(codes, scale, offset), each rearranged by the same transform, so a row or column reordering moves
codes and their scales together; a block that would straddle two scales is refused, never rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..quant.ops import unpack_int4

BLOCK = 32  # inputs per Q8_0 / Q4_1 block
Q8_0_BYTES, Q4_1_BYTES = 2 + BLOCK, 2 + 2 + BLOCK // 2


@dataclass
class QuantPlanes:
    """W = (codes - code_offset) * scale (+ offset), element-wise, all of W's float shape."""

    bits: int
    codes: torch.Tensor  # int8 in [-127, 127] (INT8) or uint8 in [0, 15] (INT4)
    scale: torch.Tensor  # float32
    offset: torch.Tensor | None  # float32 (INT4's zero), None for INT8

    @property
    def code_offset(self) -> int:
        return 0 if self.bits == 8 else 8

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def planes(self) -> list[torch.Tensor]:
        return [self.codes, self.scale] + ([self.offset] if self.offset is not None else [])

    def like(self, planes: list[torch.Tensor]) -> "QuantPlanes":
        return QuantPlanes(self.bits, planes[0], planes[1], planes[2] if self.offset is not None else None)

    def dequantize(self) -> torch.Tensor:
        """Float32, computed as clover's `dequantize_int8` / `dequantize_int4` do."""
        w = (self.codes.float() - float(self.code_offset)) * self.scale
        return w if self.offset is None else w + self.offset


def planes_from_parts(parts: dict[str, torch.Tensor], bits: int, group_size: int | None, k: int) -> QuantPlanes:
    """The on-disk tensors of one quantized weight ({"qweight", "scales"(, "zeros")}, see
    `quant.format`) -> planes of the float shape [..., N, K]."""
    if bits == 8:
        q = parts["qweight"]
        return QuantPlanes(8, q, parts["scales"].float()[..., None].expand(q.shape), None)
    codes = unpack_int4(parts["qweight"])[..., :k]

    def per_input(t: torch.Tensor) -> torch.Tensor:
        return t.float().repeat_interleave(group_size, dim=-1)[..., :k]

    return QuantPlanes(4, codes, per_input(parts["scales"]), per_input(parts["zeros"]))


def block_type_fits(bits: int, group_size: int | None, k_out: int, column_chunk: int | None) -> bool:
    """Whether a weight whose mapped rows have `k_out` inputs can be written as Q8_0 / Q4_1: rows of
    whole blocks, and (INT4) every block inside one group, also after a transform that moves
    columns in chunks of `column_chunk`."""
    if k_out % BLOCK:
        return False
    if bits == 8:
        return True  # one scale per row: any block of a row has it
    return group_size % BLOCK == 0 and (column_chunk is None or column_chunk % BLOCK == 0)


class Rounding:
    """What the float16 block fields changed, over an export: counts (Q8_0 rows and rows whose
    scale was rounded; Q4_1 blocks, blocks whose m or d was rounded) and the largest changes."""

    def __init__(self) -> None:
        self.count = dict.fromkeys(("q8_rows", "q8_rounded", "q4_blocks", "q4_m_rounded", "q4_d_rounded"), 0)
        self.largest = {"q8_relative": 0.0, "q4_m_steps": 0.0}  # q4: |m16 - m| / d, in quantization steps

    def add(self, key: str, n: int) -> None:
        self.count[key] += n

    def at_least(self, key: str, value: float) -> None:
        self.largest[key] = max(self.largest[key], value)

    def summary(self) -> list[str]:
        c, big = self.count, self.largest
        out = []
        if c["q8_rounded"]:
            out.append(f"q8_0: {c['q8_rounded']} of {c['q8_rows']} row scales were not float16 values (quantized by an "
                       f"older clover, or below float16's normal range) and were rounded to nearest float16 (largest "
                       f"relative change {big['q8_relative']:.1e})")
        if c["q4_m_rounded"]:
            out.append(f"q4_1: m = zero - 8*scale rounded to float16 in {c['q4_m_rounded']} of {c['q4_blocks']} blocks "
                       f"(largest change {big['q4_m_steps']:.1e} of a quantization step)")
        if c["q4_d_rounded"]:
            out.append(f"q4_1: {c['q4_d_rounded']} block scales outside float16's normal range were rounded")
        return out


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [rows * K/32, 32] (contiguous)."""
    return t.reshape(-1, BLOCK)


def _block_field(plane: torch.Tensor, what: str) -> torch.Tensor:
    """The per-block value of a plane that must be constant inside each block -> float32 [n_blocks]."""
    b = _blocks(plane)
    first = b[:, 0]
    if not bool((b == first[:, None]).all()):
        raise ValueError(f"a GGUF block of 32 inputs would hold two different {what}s; the tensor mapping moved "
                         "columns across quantization groups (this should have been written as float32)")
    return first.contiguous()


def encode_q8_0(p: QuantPlanes, rounding: Rounding) -> np.ndarray:
    """INT8 planes -> Q8_0 bytes, shape [..., N, K/32 * 34]."""
    s = _block_field(p.scale, "scale")
    d = s.to(torch.float16)
    changed = d.float() != s
    per_row = p.shape[-1] // BLOCK
    rounding.add("q8_rows", s.numel() // per_row)
    rounding.add("q8_rounded", int(changed.sum()) // per_row)
    if bool(changed.any()):
        rounding.at_least("q8_relative", float(((d.float() - s).abs() / s.abs()).max()))
    codes = _blocks(p.codes).to(torch.int8).numpy().view(np.uint8)
    out = np.concatenate([d.numpy().view(np.uint8).reshape(-1, 2), codes], axis=1)
    return out.reshape(*p.shape[:-1], per_row * Q8_0_BYTES)


def encode_q4_1(p: QuantPlanes, rounding: Rounding) -> np.ndarray:
    """INT4 planes -> Q4_1 bytes, shape [..., N, K/32 * 20]. ggml's block: d, m (float16), then 16
    bytes, byte j = code[j] | code[j + 16] << 4."""
    s = _block_field(p.scale, "scale")
    z = _block_field(p.offset, "zero")
    d = s.to(torch.float16)
    m_exact = z - 8.0 * s
    m = m_exact.to(torch.float16)
    rounding.add("q4_blocks", s.numel())
    rounding.add("q4_d_rounded", int((d.float() != s).sum()))
    dm = (m.float() - m_exact).abs()
    rounding.add("q4_m_rounded", int((dm > 0).sum()))
    if bool((dm > 0).any()):
        rounding.at_least("q4_m_steps", float((dm / s.abs().clamp_min(1e-30)).max()))
    q = _blocks(p.codes).to(torch.uint8)
    packed = (q[:, : BLOCK // 2] | (q[:, BLOCK // 2 :] << 4)).numpy()
    out = np.concatenate([d.numpy().view(np.uint8).reshape(-1, 2), m.numpy().view(np.uint8).reshape(-1, 2), packed], axis=1)
    return out.reshape(*p.shape[:-1], p.shape[-1] // BLOCK * Q4_1_BYTES)
