"""Decoding state for the hybrid backbone.

Per sequence (row) of a batch:
- full-attention layers: K and V in preallocated buffers `[B, H_kv, capacity, D]`, written by index;
- Gated DeltaNet layers: the recurrent state `[B, H_v, d_k, d_v]` (fp32) and the conv state, the last
  `K-1` pre-conv inputs `[B, conv_dim, K-1]`.

Rows advance independently: `lengths[b]` is the number of committed tokens of row b, which is also
the RoPE position of its next token. Key slots at or past `lengths[b]` are garbage and masked out,
so truncating a row is just lowering its length (attention) — GDN states cannot be rewound and are
restored from a snapshot instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import CloverConfig
from .kernels import chunk_gated_delta_rule


@dataclass
class CacheSnapshot:
    lengths: torch.Tensor
    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]


class HybridCache:
    def __init__(
        self,
        config: CloverConfig,
        batch_size: int,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.batch_size = batch_size
        self.capacity = int(capacity)
        self.dtype = dtype
        self.device = torch.device(device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        c = config
        for i, t in enumerate(c.layer_types):
            if t == "full_attention":
                shape = (batch_size, c.num_key_value_heads, self.capacity, c.head_dim)
                self.keys[i] = torch.zeros(shape, dtype=dtype, device=self.device)
                self.values[i] = torch.zeros(shape, dtype=dtype, device=self.device)
            else:
                self.conv[i] = torch.zeros(
                    batch_size, c.linear_conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype, device=self.device
                )
                self.recurrent[i] = torch.zeros(
                    batch_size,
                    c.linear_num_value_heads,
                    c.linear_key_head_dim,
                    c.linear_value_head_dim,
                    dtype=torch.float32,
                    device=self.device,
                )
        # while recording, GDN layers keep their commit inputs so a partial accept can be rolled back
        self.record: dict[int, tuple] | None = None

    # ----------------------------------------------------------------- sizing
    def ensure_capacity(self, needed: int, *, exact: bool = False) -> None:
        """Grow the K/V buffers (doubling, or to exactly `needed`) so `needed` slots fit."""
        if needed <= self.capacity:
            return
        new_cap = needed if exact else max(needed, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, buf in store.items():
                grown = buf.new_zeros(buf.shape[0], buf.shape[1], new_cap, buf.shape[3])
                grown[:, :, : self.capacity] = buf
                store[i] = grown
        self.capacity = new_cap

    def nbytes(self) -> int:
        stores = (self.keys, self.values, self.conv, self.recurrent)
        return sum(t.numel() * t.element_size() for s in stores for t in s.values())

    # ------------------------------------------------------- attention layers
    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values `[B, H_kv, T, D]` at each row's current length (lengths are advanced
        separately by `advance`, once per forward, after every layer has written).
        Returns views of the buffers covering every slot any row may attend to."""
        T = k.shape[2]
        end = int(self.lengths.max()) + T
        self.ensure_capacity(end)
        kb, vb = self.keys[layer], self.values[layer]
        if bool((self.lengths == self.lengths[0]).all()):
            start = int(self.lengths[0])
            kb[:, :, start : start + T] = k
            vb[:, :, start : start + T] = v
        else:
            pos = self.lengths[:, None] + torch.arange(T, device=self.device)  # [B, T]
            rows = torch.arange(self.batch_size, device=self.device)[:, None]
            kb.permute(0, 2, 1, 3)[rows, pos] = k.permute(0, 2, 1, 3)
            vb.permute(0, 2, 1, 3)[rows, pos] = v.permute(0, 2, 1, 3)
        return kb[:, :, :end], vb[:, :, :end]

    def read_kv(self, layer: int, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        end = int(self.lengths.max()) + extra
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, n: torch.Tensor | int) -> None:
        self.lengths += n

    # ---------------------------------------------------------- rollback/copy
    def snapshot(self) -> CacheSnapshot:
        """Cheap copy of what truncation alone cannot restore (GDN states) plus the lengths."""
        return CacheSnapshot(
            lengths=self.lengths.clone(),
            conv={i: t.clone() for i, t in self.conv.items()},
            recurrent={i: t.clone() for i, t in self.recurrent.items()},
        )

    def restore(self, snap: CacheSnapshot) -> None:
        """Return to a snapshot. K/V slots written since are beyond the restored lengths, hence ignored."""
        self.lengths.copy_(snap.lengths)
        for i, t in snap.conv.items():
            self.conv[i].copy_(t)
        for i, t in snap.recurrent.items():
            self.recurrent[i].copy_(t)

    def start_recording(self) -> CacheSnapshot:
        """Snapshot, then have GDN layers keep (q, k, v, g, beta, conv window) of the next commit."""
        self.record = {}
        return self.snapshot()

    def rollback(self, snap: CacheSnapshot, keep: torch.Tensor) -> None:
        """Keep only the first `keep[b]` tokens committed since `snap` (taken by `start_recording`).

        Attention: lower the lengths. GDN: re-run the recurrence from the snapshot state over exactly
        the kept tokens' recorded inputs (no projections, no prefix recompute); the conv state is the
        last K-1 pre-conv inputs ending at the last kept token."""
        if self.record is None:
            raise RuntimeError("rollback needs start_recording() before the commit")
        keep = torch.as_tensor(keep, dtype=torch.long, device=self.device).expand(self.batch_size)
        for i, (q, k, v, g, beta, window) in self.record.items():
            T = q.shape[1]
            valid = (torch.arange(T, device=self.device)[None, :] < keep[:, None])[..., None]
            _, state = chunk_gated_delta_rule(
                q, k, v, g * valid, beta * valid,
                initial_state=snap.recurrent[i], output_final_state=True, use_qk_l2norm_in_kernel=True,
            )
            self.recurrent[i] = state
            K1 = self.conv[i].shape[2]
            idx = (keep[:, None, None] + torch.arange(K1, device=self.device)[None, None, :]).expand(-1, window.shape[1], -1)
            self.conv[i] = window.gather(2, idx).contiguous()
        self.lengths.copy_(snap.lengths + keep)
        self.record = None

    def select_rows(self, rows: list[int] | torch.Tensor) -> "HybridCache":
        """A new cache holding copies of the given rows (used to split or reorder a batch)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        out = HybridCache.__new__(HybridCache)
        out.config, out.capacity, out.dtype, out.device = self.config, self.capacity, self.dtype, self.device
        out.batch_size = len(idx)
        out.record = None
        out.lengths = self.lengths[idx].clone()
        out.keys = {i: t[idx].clone() for i, t in self.keys.items()}
        out.values = {i: t[idx].clone() for i, t in self.values.items()}
        out.conv = {i: t[idx].clone() for i, t in self.conv.items()}
        out.recurrent = {i: t[idx].clone() for i, t in self.recurrent.items()}
        return out

    @staticmethod
    def concat(caches: list["HybridCache"]) -> "HybridCache":
        """Stack several caches (same config) into one batch; K/V padded to the largest capacity."""
        first = caches[0]
        cap = max(c.capacity for c in caches)
        for c in caches:
            c.ensure_capacity(cap, exact=True)
        out = HybridCache.__new__(HybridCache)
        out.config, out.capacity, out.dtype, out.device = first.config, cap, first.dtype, first.device
        out.batch_size = sum(c.batch_size for c in caches)
        out.record = None
        out.lengths = torch.cat([c.lengths for c in caches])
        out.keys = {i: torch.cat([c.keys[i] for c in caches]) for i in first.keys}
        out.values = {i: torch.cat([c.values[i] for c in caches]) for i in first.values}
        out.conv = {i: torch.cat([c.conv[i] for c in caches]) for i in first.conv}
        out.recurrent = {i: torch.cat([c.recurrent[i] for c in caches]) for i in first.recurrent}
        return out
