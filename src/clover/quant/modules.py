"""Modules swapped in at load: `Int8Linear`, `Int4Linear`, `QuantExperts`, `QuantEmbedding`.

Each is created empty and filled by `set_quantized(...)` with the on-disk tensors (see `ops`), which
packs them for the device they are on. The kernel layout is device-specific: load the model on the
device it will run on (`clover.load(..., device=...)`) rather than moving it afterwards.

Every module carries a zero-size `weight` buffer in the compute dtype on the module's device, so
`model.dtype` / `model.device` (read from `embed_tokens.weight` / `lm_head.weight`) keep working.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..moe import grouped_expert_forward
from .ops import Int4Weights, dequantize_int4, int8_matmul


def _placeholder(module: nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
    module.register_buffer("weight", torch.empty(0, dtype=dtype, device=device), persistent=False)


class _QuantLinear(nn.Module):
    bits: int

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        _placeholder(self, dtype)
        self.register_buffer("bias", None)

    def _set_bias(self, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        if self.has_bias:
            self.register_buffer("bias", bias.to(dtype))

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self._matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


class Int8Linear(_QuantLinear):
    """y = x @ (qweight * scales)^T (+ bias): symmetric per-output-channel int8 weights."""

    bits = 8

    def set_quantized(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, *, dtype: torch.dtype) -> None:
        device = qweight.device
        _placeholder(self, dtype, device)
        self.register_buffer("qweight", qweight.clone(memory_format=torch.contiguous_format))  # fresh, aligned
        self.register_buffer("scales", scales.to(dtype).contiguous())
        self._set_bias(bias, dtype)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x2, self.qweight, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, int8 per-channel"


class Int4Linear(_QuantLinear):
    """y = x @ W^T (+ bias), W in group-wise asymmetric int4, packed for the device's int4 kernel."""

    bits = 4

    def __init__(self, in_features: int, out_features: int, *, group_size: int, bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.group_size = group_size
        self.kernel: str | None = None

    def set_quantized(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        dtype: torch.dtype,
        kernel: bool | str | None = True,
    ) -> None:
        w = Int4Weights.pack(qweight, scales, zeros, self.in_features, self.group_size, dtype, kernel=kernel)
        _placeholder(self, dtype, qweight.device)
        self.register_buffer("qdata", w.data)
        self.register_buffer("qsz", w.sz)
        self.kernel = w.kernel
        self._set_bias(bias, dtype)

    def _weights(self) -> Int4Weights:
        return Int4Weights(self.qdata, self.qsz, self.in_features, self.group_size, self.kernel)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return self._weights().matmul(x2)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
                f"int4 group {self.group_size}, kernel={self.kernel or 'dequantize'}")


class QuantExperts(nn.Module):
    """The routed experts in int8 or int4: gate_up [E, 2I, H] and down [E, H, I], per expert the same
    layouts as the linear layers. `grouped_expert_forward` needs only `num_experts` and
    `expert_forward(e, x)`."""

    PARTS = ("gate_up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden: int, inter: int, *, bits: int, group_size: int | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.bits, self.group_size = bits, group_size
        self.kernels: dict[str, str | None] = {}
        _placeholder(self, dtype)

    def part_shape(self, part: str) -> tuple[int, int]:
        """(N, K) of one expert's weight."""
        return (2 * self.inter, self.hidden) if part == "gate_up_proj" else (self.hidden, self.inter)

    def set_quantized(self, part: str, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype, kernel: bool | str | None = True) -> None:
        """tensors: {"qweight", "scales"(, "zeros")} of one part, stacked over experts."""
        if part not in self.PARTS:
            raise KeyError(part)
        _placeholder(self, dtype, tensors["qweight"].device)
        if self.bits == 8:
            self.register_buffer(f"{part}_q", tensors["qweight"].clone(memory_format=torch.contiguous_format))
            self.register_buffer(f"{part}_scales", tensors["scales"].to(dtype).contiguous())
        else:
            _, k = self.part_shape(part)
            w = Int4Weights.pack(tensors["qweight"], tensors["scales"], tensors["zeros"], k, self.group_size, dtype, kernel=kernel)
            self.register_buffer(f"{part}_data", w.data)
            self.register_buffer(f"{part}_sz", w.sz)
            self.kernels[part] = w.kernel

    def _mm(self, part: str, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return int8_matmul(x, getattr(self, f"{part}_q")[e], getattr(self, f"{part}_scales")[e])
        _, k = self.part_shape(part)
        w = Int4Weights(getattr(self, f"{part}_data"), getattr(self, f"{part}_sz"), k, self.group_size, self.kernels.get(part))
        return w.matmul(x, index=e)

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._mm("gate_up_proj", e, x).chunk(2, dim=-1)
        return self._mm("down_proj", e, F.silu(gate) * up)

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        return grouped_expert_forward(self, x, top_idx, top_w)

    def extra_repr(self) -> str:
        kind = "int8 per-channel" if self.bits == 8 else f"int4 group {self.group_size}, kernels={self.kernels}"
        return f"num_experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, {kind}"


class QuantEmbedding(nn.Module):
    """Token embedding rows stored like a linear weight [V, H] (int8 per row, or int4 groups along H);
    a lookup dequantizes only the rows it gathers."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, bits: int, group_size: int | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.bits, self.group_size = bits, group_size
        self.dtype = dtype
        _placeholder(self, dtype)

    def set_quantized(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None, *, dtype: torch.dtype) -> None:
        self.dtype = dtype
        _placeholder(self, dtype, qweight.device)
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.contiguous())
        if self.bits == 4:
            self.register_buffer("zeros", zeros.contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        q, s = self.qweight.index_select(0, flat), self.scales.index_select(0, flat)
        if self.bits == 8:
            rows = q.float() * s.float()[:, None]
        else:
            rows = dequantize_int4(q, s, self.zeros.index_select(0, flat), self.embedding_dim)
        return rows.to(self.weight.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        kind = "int8 per-row" if self.bits == 8 else f"int4 group {self.group_size}"
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind}"

