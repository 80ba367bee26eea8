"""Float32 matmuls of a few rows on a CPU: the row kernel on the plain weight, or oneDNN on a packed copy.

`F.linear` of M = 2…32 rows (a denoise block, a block commit, a verify) on a CPU runs MKL's sgemm
with a transposed weight, which repacks the whole weight on every call: at 0.7B's 8192 × 2048
projection, cold in memory, 8 rows cost 13.7 ms against 4.4 ms for one (3.1×). oneDNN with the
weight reordered once into its blocked layout costs 5.9 ms (1.33×; 4.8 ms at 4 rows, 7.5 ms at 16);
the row kernel (`clover.kernels.rows`, built on first use; single-threaded) reads the plain weight
once at ~1.0–1.05× a GEMV at 4 rows and ~1.05–1.25× at 8 (docs/kernels.md, "Few-row float32
matmuls"). A packed layer runs 2…8 rows (`DENSE_ROWS`) through the row kernel where it is built and
torch runs one thread, else (and 9…`MAX_ROWS` rows) through oneDNN; packed routed experts of 1…16
tokens run in one call of the row kernel. One row (an AR step's GEMV) stays on `F.linear`, which
neither beats, and so do more than `MAX_ROWS` rows. The price is a second copy of every packed
weight, kept beside the plain one. Routed experts of at least `ROW_EXPERT_BYTES` a matrix, packed or
not, run through the row kernel in one call up to `ROW_EXPERT_SLOTS` routed slots per expert (a
denoise block of a few rows per expert: no copy needed, it reads the plain weights).

`pack_model` packs a model's linear layers (`PackedLinear`) and routed experts (`Experts.packs`); a
pack is used only at inference (no autograd, not while compiling), on a CPU, for float32 activations,
and only while its weight is the one it was packed from (same storage, same version: an in-place
update, `load_state_dict` or `.to()` makes the layer fall back to `F.linear` until packed again).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from .rows import MAX_ROWS as ROW_KERNEL_ROWS, experts as rows_experts, library as rows_library, linear as rows_linear

PACK_ROWS = 8  # the row count oneDNN is told to expect when it lays the weight out (a width-8 block)
MAX_ROWS = 32  # above this MKL's own GEMM amortises its repack (a 64-token prompt): plain again
EXPERT_MAX_ROWS = 16  # the same for an expert's smaller matrices (plain already wins at 32 rows: docs/kernels.md)
DENSE_ROWS = 8  # a layer's rows through the row kernel; at 9…16 it and oneDNN are even in a 0.7B forward of 16 rows
ROW_EXPERT_SLOTS = 64  # routed slots per expert (on average) up to which the row kernel runs a forward's experts
ROW_EXPERT_BYTES = 512 << 10  # ... for experts whose gate_up matrix takes at least this (measured there; docs/kernels.md)
MIN_BYTES = 2 << 20  # smaller matrices stay plain: MKL's repack of a weight that fits in a core's L2 is cheap
MIN_MODEL_BYTES = 256 << 20  # the default packs a model whose large weights stream from memory each forward


def available() -> bool:
    """Whether this torch has oneDNN's linear with a prepacked weight (a CPU build with mkldnn)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version  # an inference tensor has no version (nor in-place updates outside inference)


class Pack:
    """A weight [N, K] in oneDNN's blocked layout (`source`, or its `index`-th matrix), with what it
    was packed from, to notice a change of `source`. `copy=False`: no oneDNN copy (`packed` None),
    the row kernel alone on the plain weight (`pack_model(copies=False)`)."""

    __slots__ = ("packed", "ptr", "version")

    def __init__(self, source: torch.Tensor, index: int | None = None, copy: bool = True) -> None:
        w = source.detach() if index is None else source.detach()[index]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS) if copy else None
        self.ptr, self.version = source.data_ptr(), _version(source)

    def fresh(self, source: torch.Tensor) -> bool:
        return source.data_ptr() == self.ptr and _version(source) == self.version and source.dtype == torch.float32


def _inference(x: torch.Tensor) -> bool:
    """Whether activations `x` are a float32 CPU tensor at inference, outside a compiled graph: what
    a pack (`usable`) and the row kernel's experts (`experts`) both ask of them, besides a row count."""
    return (x.dtype == torch.float32 and x.device.type == "cpu"
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling())


def usable(x: torch.Tensor, max_rows: int | None = None) -> bool:
    """Whether a pack may serve activations `x` now: `_inference`, of 2…`max_rows` rows (`MAX_ROWS`)."""
    return x.shape[-1] < x.numel() <= (max_rows or MAX_ROWS) * x.shape[-1] and _inference(x)


def linear(x: torch.Tensor, weight: torch.Tensor, pack: Pack | None, bias: torch.Tensor | None = None,
           source: torch.Tensor | None = None, max_rows: int | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through `pack` where it applies (`usable` up to `max_rows`, and
    the pack still matches `source`: the tensor it was packed from, `weight` itself unless given):
    up to `DENSE_ROWS` rows through the row kernel on the plain weight (`row_kernel`), more
    through oneDNN's linear on the packed one; a pack without a copy (`Pack(copy=False)`) up to
    `ROW_KERNEL_ROWS` rows through the row kernel, more through `F.linear`."""
    if pack is None or not usable(x, max_rows) or not pack.fresh(weight if source is None else source):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    rows = DENSE_ROWS if pack.packed is not None else ROW_KERNEL_ROWS
    if x2.shape[0] <= rows and weight.is_contiguous() and row_kernel():
        y = _rows_mm(x2, weight, bias)
    elif pack.packed is not None:
        y = _packed_mm(x2, pack, bias)
    else:
        return F.linear(x, weight, bias)
    return y.view(*x.shape[:-1], y.shape[-1])


def row_kernel() -> bool:
    """Whether the few-row kernel (`clover.kernels.rows`, single-threaded) serves packed layers now:
    torch runs one thread (with more, oneDNN's threaded GEMM), and the kernel is built (else one
    warning, and oneDNN)."""
    return torch.get_num_threads() == 1 and rows_library() is not None


def _rows_mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weightᵀ (+ bias), M ≤ `DENSE_ROWS`: the row kernel on the plain weight."""
    return rows_linear(x, weight, bias)


def experts(mod: nn.Module, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor | None:
    """The routed experts of `mod` (`models.layers.Experts`, packed or not) on tokens x [N, H] with
    their top_idx / top_w [N, k], in one call of the row kernel (each touched expert once, on its
    tokens' rows: no host loop) where it applies: float32 CPU activations at inference, plain
    contiguous float32 weights (not a tensor subclass), `rows_take`, `row_kernel()`, and their packs,
    if any, still fresh. None where it does not (the caller runs its host loop)."""
    gu, dn = mod.gate_up_proj, mod.down_proj
    packs = mod.packs
    if not (x.shape[0] > 0 and _inference(x)
            and all(type(t) in (torch.Tensor, nn.Parameter) and t.dtype == torch.float32 and t.is_contiguous()
                    for t in (gu, dn))
            and rows_take(mod, top_idx) and row_kernel()  # asked last: experts it never takes never build it
            and (packs is None or (packs[0][0].fresh(gu) and packs[0][1].fresh(dn)))):
        return None
    return rows_experts(x.contiguous(), top_idx.contiguous(), top_w.to(x.dtype).contiguous(), gu.detach(), dn.detach())


def rows_take(mod: nn.Module, top_idx: torch.Tensor) -> bool:
    """Whether the row kernel (`experts`) is the path for routed experts `mod` on tokens routed as
    `top_idx` [N, k]: packed experts of 1…`ROW_KERNEL_ROWS` tokens; experts whose gate_up matrix
    takes at least `ROW_EXPERT_BYTES`, packed or not, up to `ROW_EXPERT_SLOTS` routed slots per
    expert on average (at 9 slots an expert, LLaDA2's block of 32 with 4 of 16 experts, the kernel
    ran them 2.3x faster than torch's grouped matmul, and was level with it or ahead up to ~70)."""
    gu = mod.gate_up_proj
    if gu.dtype != torch.float32:  # the kernel is float32's (a bf16 model's experts keep their path)
        return False
    if mod.packs is not None and top_idx.shape[0] <= ROW_KERNEL_ROWS:
        return True
    return gu[0].numel() * gu.element_size() >= ROW_EXPERT_BYTES and top_idx.numel() <= ROW_EXPERT_SLOTS * mod.num_experts


def _packed_mm(x: torch.Tensor, pack: Pack, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ the packed weightᵀ (+ bias): oneDNN's linear."""
    return torch.ops.mkldnn._linear_pointwise(x, pack.packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An `nn.Linear` with its weight also packed for oneDNN (`pack_model` turns a layer into one in
    place; its parameters and state dict are the plain layer's)."""

    pack: Pack | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.pack, self.bias)


def _packable(t: torch.Tensor, matrix_bytes: int) -> bool:
    return (type(t) in (torch.Tensor, nn.Parameter) and t.dtype == torch.float32 and t.device.type == "cpu"
            and matrix_bytes >= MIN_BYTES)


def _targets(model: nn.Module):
    """(module, bytes) for each layer `pack_model` packs: plain float32 CPU linear layers, and routed
    experts (`models.layers.Experts`, known here by its `packs` slot: kernels sit below models and
    import none of them) with plain float32 CPU weights, whose matrices take at least `MIN_BYTES` each."""
    for mod in model.modules():
        if type(mod) in (nn.Linear, PackedLinear) and _packable(mod.weight, mod.weight.numel() * 4):
            yield mod, mod.weight.numel() * 4
        elif (hasattr(mod, "packs") and hasattr(mod, "gate_up_proj") and _packable(mod.gate_up_proj, mod.gate_up_proj[0].numel() * 4)
              and _packable(mod.down_proj, mod.down_proj[0].numel() * 4)):
            yield mod, (mod.gate_up_proj.numel() + mod.down_proj.numel()) * 4


def pack_model(model: nn.Module, copies: bool = True) -> int:
    """Pack `model`'s linear layers and routed experts (`_targets`) in place; the bytes the oneDNN
    copies take. `copies=False`: no copy, the layers marked for the row kernel alone (their weights
    as they are; 0 bytes). Nothing where the path is missing (oneDNN, or the row kernel's build)."""
    if not (available() if copies else rows_library() is not None):
        return 0
    total = 0
    for mod, nbytes in _targets(model):
        if isinstance(mod, nn.Linear):
            mod.__class__ = PackedLinear
            mod.pack = Pack(mod.weight, copy=copies)
        else:
            mod.packs = [(Pack(mod.gate_up_proj, e, copies), Pack(mod.down_proj, e, copies)) for e in range(mod.num_experts)]
        total += nbytes if copies else 0
    return total


def packing(model: nn.Module) -> str | None:
    """How `pack_model` packed `model`: "onednn" (copies, with the row kernel for a few rows), "rows"
    (the row kernel alone), or None (not packed)."""
    for mod in model.modules():
        pack = getattr(mod, "pack", None) or (getattr(mod, "packs", None) or [(None,)])[0][0]
        if pack is not None:
            return "onednn" if pack.packed is not None else "rows"
    return None


def is_packed(model: nn.Module) -> bool:
    """Whether `pack_model` packed any of `model`'s layers."""
    return packing(model) is not None


def grouped_serves(mod: nn.Module, top_idx: torch.Tensor) -> bool:
    """Whether routed experts `mod` (`models.layers.Experts`) leave tokens routed as `top_idx` [N, k]
    to torch's grouped matmul: not where the row kernel takes them in one call (`rows_take`, with
    `row_kernel()`), nor, for packs with oneDNN copies, where those serve a host loop (up to
    `EXPERT_MAX_ROWS` slots per expert); otherwise they do."""
    if rows_take(mod, top_idx) and row_kernel():  # asked second: experts it never takes never build it
        return False
    return mod.packs is None or mod.packs[0][0].packed is None or top_idx.numel() > EXPERT_MAX_ROWS * mod.num_experts


def default_packing(model: nn.Module) -> bool | str:
    """`clover.load`'s `pack=None`. With at least `MIN_MODEL_BYTES` to pack (a small model's weights
    stay in cache, where the plain path costs little more; the bundled model is not packed): oneDNN's
    copies (True) where oneDNN is present and they fit in half the memory available now (the rule
    `clover.load` applies to a float32 copy); else the row kernel alone where it is built ("rows": no
    memory); else not packed (False)."""
    need = sum(n for _, n in _targets(model))
    if need < max(MIN_MODEL_BYTES, 1):
        return False
    avail = available_memory()
    if available() and avail and need <= avail // 2:
        return True
    return "rows" if rows_library() is not None else False


def available_memory() -> int:
    """The bytes of memory available now (0 where the system does not say): what `default_packing` and
    `clover.load`'s float32 copy of a half-precision checkpoint must fit in half of."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
