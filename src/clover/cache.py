"""Decoding state for the hybrid backbone: one state object per layer, held by a `HybridCache`.

- `AttentionState` (full-attention layers): K and V in preallocated buffers `[B, H_kv, capacity, D]`,
  scattered at each row's length (`scatter_kv`);
- `DeltaNetState` (Gated DeltaNet layers): the recurrent state `[B, H_v, d_k, d_v]` (fp32) and the conv
  state, the last `K-1` pre-conv inputs `[B, conv_dim, K-1]`.

Each mixer declares the state it needs (`make_state`), and the model builds the cache from them
(`model.make_cache`). Rows advance independently: `lengths[b]` is the number of committed tokens of
row b, which is also the RoPE position of its next token. Key slots at or past `lengths[b]` are garbage
and masked out, so truncating a row is just lowering its length (attention) — GDN states cannot be
rewound: they are restored from a snapshot, or re-derived from recorded inputs (`rollback`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import chunk_gated_delta_rule, recurrent_gated_delta_rule, state_after

RECURRENT_ROLLBACK = 4  # a rollback re-runs up to this many kept tokens one by one (measured cheaper on CPU)


def kv_bytes(config, tokens: int, *, elem: int = 2) -> int:
    """Bytes of K and V for `tokens` cached positions over every full-attention layer of `config` at
    `elem` bytes a value (`AttentionState`); a GDN layer's state does not grow with the context."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    layers = sum(t == "full_attention" for t in types)
    return layers * 2 * config.num_key_value_heads * config.head_dim * elem * tokens


# --------------------------------------------------------------------------- per-layer states
def scatter_kv(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> None:
    """The K/V write of a cached forward, without a host read: k/v `[B, H_kv, T, D]` scattered into the
    buffers at each row's length (the cache has room: `ensure_capacity`)."""
    B, H, T, D = k.shape
    slot = (lengths[:, None] + torch.arange(T, device=lengths.device))[:, None, :, None].expand(B, H, T, D)
    keys.scatter_(2, slot, k)
    values.scatter_(2, slot, v)


def conv_window_tail(window: torch.Tensor, width: int, n: torch.Tensor | None = None) -> torch.Tensor:
    """A GDN conv state after a commit: of `window` [B, C, width + T] (the old state, then the T
    committed pre-conv inputs), the `width` inputs ending at each row's last kept token (`n[b]` of
    the T; None: all T)."""
    if n is None:
        return window[:, :, window.shape[2] - width :]
    return window.gather(2, conv_tail_index(n, width, window.shape[1]))


def conv_tail_index(n: torch.Tensor, width: int, channels: int) -> torch.Tensor:
    """`conv_window_tail`'s gather index [B, channels, width]: positions n[b] .. n[b] + width - 1."""
    idx = n[:, None, None] + torch.arange(width, device=n.device)[None, None, :]
    return idx.expand(n.shape[0], channels, width)



def row_room(t: torch.Tensor) -> int:
    """How many rows (dim 0) of `t`'s shape its memory holds from where `t` starts: `t`'s own rows
    plus the spare rows a cache keeps behind them (`LayerState.reserve`)."""
    return (t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()) // t.stride(0)


def first_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A tensor of `rows` rows over `t`'s memory from where `t` starts (no copy; `rows` at most
    `row_room(t)`): fewer rows than `t`, or `t` with its spare rows."""
    if rows > row_room(t):
        raise ValueError(f"first_rows: {rows} rows asked, the memory holds {row_room(t)}")
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), (rows, *t.shape[1:]), t.stride())


class LayerState:
    """What every layer's state does with its tensors (`tensors()`, the attributes named in
    `FIELDS`, in the constructor's order): pick rows, join caches along the batch, keep spare rows."""

    FIELDS: tuple[str, ...] = ()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f) for f in self.FIELDS)

    def reserve(self, rows: int) -> None:
        """Keep memory for `rows` rows behind each tensor (zeros past the state's own rows), so that a
        compiled step of `rows` rows runs on it in place (`first_rows`); a no-op once there."""
        for f in self.FIELDS:
            t = getattr(self, f)
            if row_room(t) < rows:
                full = t.new_zeros((rows, *t.shape[1:]))
                full[: t.shape[0]] = t
                setattr(self, f, first_rows(full, t.shape[0]))

    def select(self, idx: torch.Tensor):
        """A copy holding the rows `idx`."""
        return type(self)(*(t[idx].clone() for t in self.tensors()))

    @classmethod
    def cat(cls, states: list):
        """One state whose rows are those of `states`, in order."""
        return cls(*(torch.cat(ts) for ts in zip(*(s.tensors() for s in states))))


class AttentionState(LayerState):
    """K/V buffers of one full-attention layer."""

    FIELDS = ("keys", "values")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values  # [B, H_kv, capacity, D]

    @classmethod
    def empty(cls, batch: int, kv_heads: int, capacity: int, head_dim: int, *, dtype, device) -> "AttentionState":
        shape = (batch, kv_heads, capacity, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def grow(self, capacity: int) -> None:
        """Longer buffers, keeping the spare rows' memory (`reserve`)."""
        old = self.keys.shape[2]
        for name in self.FIELDS:
            buf = getattr(self, name)
            grown = buf.new_zeros(row_room(buf), buf.shape[1], capacity, buf.shape[3])
            grown[: buf.shape[0], :, :old] = buf
            setattr(self, name, first_rows(grown, buf.shape[0]))

    # K/V slots past the restored lengths are ignored: nothing to snapshot
    def snapshot(self) -> None:
        return None

    def restore(self, snap: None) -> None:
        pass

    def rollback(self, snap: None, keep: torch.Tensor, longest: int) -> None:
        pass


class DeltaNetState(LayerState):
    """Conv and recurrent state of one Gated DeltaNet layer. While `recording`, the layer keeps the
    inputs of its next commit in `record` (q, k, v, g, beta, conv window, and the WY terms of a commit
    run as one chunk) so `rollback` can keep a prefix."""

    FIELDS = ("conv", "recurrent")

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv = conv  # [B, conv_dim, K-1]
        self.recurrent = recurrent  # [B, H_v, d_k, d_v] fp32
        self.recording = False
        self.record: tuple | None = None

    @classmethod
    def empty(cls, batch: int, conv_dim: int, kernel: int, heads: int, dk: int, dv: int, *, dtype, device) -> "DeltaNetState":
        return cls(
            torch.zeros(batch, conv_dim, kernel - 1, dtype=dtype, device=device),
            torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=device),
        )

    def grow(self, capacity: int) -> None:
        pass

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv.clone(), self.recurrent.clone()

    def restore(self, snap: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.conv.copy_(snap[0])
        self.recurrent.copy_(snap[1])

    def rollback(self, snap: tuple[torch.Tensor, torch.Tensor], keep: torch.Tensor, longest: int) -> None:
        """Re-run the recurrence from the snapshot state over exactly the first `keep[b]` recorded
        tokens (no projections, no prefix recompute; `longest` = max(keep), read once by the cache);
        the conv state is the last K-1 pre-conv inputs ending at the last kept token. Written into
        the state's tensors (their spare rows stay, `reserve`)."""
        if self.record is not None:  # else the layer saw no commit since the snapshot
            DeltaNetState.rollback_layers([self], [snap], keep, longest)

    @staticmethod
    def rollback_layers(states: list["DeltaNetState"], snaps: list, keep: torch.Tensor, longest: int) -> None:
        """`rollback` of several layers whose records have the same shapes, as one recurrence over
        their heads side by side (the heads are independent: one kernel call instead of one per layer),
        or where the commit kept its WY terms, the state after the kept prefix read from them."""
        recs = [s.record for s in states]
        T = min(recs[0][0].shape[1], longest)  # the tokens after the longest kept prefix need not run
        wy = len(recs[0]) > 6  # the commit's WY terms (`models.layers.ONE_CHUNK_RECORDED`): no recurrence
        if not wy and T == 0:
            for s, snap in zip(states, snaps):
                s.recurrent.copy_(snap[1])
        else:
            init = torch.cat([snap[1] for snap in snaps], dim=1)
            if wy:
                state = state_after(init, tuple(torch.cat([r[6][i] for r in recs], dim=1) for i in range(3)), keep)
            else:
                valid = (torch.arange(T, device=keep.device)[None, :] < keep[:, None])[..., None]
                q, k, v, g, beta = (torch.cat([r[i][:, :T] for r in recs], dim=2) for i in range(5))
                # a few tokens (a typical rejected draft): token by token, as AR's own steps; else chunked
                kernel = recurrent_gated_delta_rule if T <= RECURRENT_ROLLBACK else chunk_gated_delta_rule
                _, state = kernel(q, k, v, g * valid, beta * valid, initial_state=init, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
            for s, part in zip(states, state.split([s.recurrent.shape[1] for s in states], dim=1)):
                s.recurrent.copy_(part)
        idx = None  # the gather index of the kept conv inputs: one for every layer
        for s, r in zip(states, recs):
            width = s.conv.shape[2]
            if idx is None or idx.shape[1] != r[5].shape[1]:
                idx = conv_tail_index(keep, width, r[5].shape[1])
            s.conv.copy_(r[5].gather(2, idx))


# --------------------------------------------------------------------------- the cache
@dataclass
class CacheSnapshot:
    lengths: torch.Tensor
    layers: list  # per layer: what its state needs to come back (None for attention)


class HybridCache:
    """Per-layer states plus the per-row lengths they share. Built by `model.make_cache(batch, capacity)`."""

    def __init__(self, layers: list[LayerState], batch_size: int, capacity: int, *, device: torch.device | str = "cpu") -> None:
        self.layers = layers
        self.batch_size = batch_size
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self._recording = False

    # ----------------------------------------------------------------- views
    def attention_states(self) -> list[AttentionState]:
        return [s for s in self.layers if isinstance(s, AttentionState)]

    def deltanet_states(self) -> list[DeltaNetState]:
        return [s for s in self.layers if isinstance(s, DeltaNetState)]

    def _by_layer(self, kind: type, attr: str) -> dict[int, torch.Tensor]:
        return {i: getattr(s, attr) for i, s in enumerate(self.layers) if isinstance(s, kind)}

    @property
    def keys(self) -> dict[int, torch.Tensor]:
        return self._by_layer(AttentionState, "keys")

    @property
    def values(self) -> dict[int, torch.Tensor]:
        return self._by_layer(AttentionState, "values")

    @property
    def conv(self) -> dict[int, torch.Tensor]:
        return self._by_layer(DeltaNetState, "conv")

    @property
    def recurrent(self) -> dict[int, torch.Tensor]:
        return self._by_layer(DeltaNetState, "recurrent")

    @property
    def record(self) -> dict[int, tuple] | None:
        """The recorded commit inputs per GDN layer while recording, else None; `= None` stops recording."""
        if not self._recording:
            return None
        return {i: s.record for i, s in enumerate(self.layers) if isinstance(s, DeltaNetState)}

    @record.setter
    def record(self, value: None) -> None:
        if value is not None:
            raise ValueError("record can only be cleared (use start_recording)")
        self._stop_recording()

    def _stop_recording(self) -> None:
        self._recording = False
        for s in self.deltanet_states():
            s.recording, s.record = False, None

    # ----------------------------------------------------------------- sizing
    def ensure_capacity(self, needed: int, *, exact: bool = False) -> None:
        """Grow the K/V buffers (doubling, or to exactly `needed`) so `needed` slots fit."""
        if needed <= self.capacity:
            return
        new_cap = needed if exact else max(needed, 2 * self.capacity)
        for s in self.layers:
            s.grow(new_cap)
        self.capacity = new_cap

    def reserve_rows(self, rows: int) -> None:
        """Keep memory for `rows` >= batch_size rows behind every state tensor (`LayerState.reserve`):
        a compiled step of that batch size then serves this cache in place, the spare rows as dummies."""
        for s in self.layers:
            s.reserve(rows)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.layers for t in s.tensors())

    def advance(self, n: torch.Tensor | int) -> None:
        self.lengths += n

    # ---------------------------------------------------------- rollback/copy
    def snapshot(self) -> CacheSnapshot:
        """Cheap copy of what truncation alone cannot restore (GDN states) plus the lengths."""
        return CacheSnapshot(lengths=self.lengths.clone(), layers=[s.snapshot() for s in self.layers])

    def restore(self, snap: CacheSnapshot) -> None:
        """Return to a snapshot. K/V slots written since are beyond the restored lengths, hence ignored."""
        self.lengths.copy_(snap.lengths)
        for s, saved in zip(self.layers, snap.layers):
            s.restore(saved)

    def start_recording(self) -> CacheSnapshot:
        """Snapshot, then have GDN layers keep (q, k, v, g, beta, conv window) of the next commit."""
        self._recording = True
        for s in self.deltanet_states():
            s.recording, s.record = True, None
        return self.snapshot()

    def rollback(self, snap: CacheSnapshot, keep: torch.Tensor) -> None:
        """Keep only the first `keep[b]` tokens committed since `snap` (taken by `start_recording`).
        Attention: lower the lengths. GDN: re-derived from the snapshot over the kept tokens."""
        if self.record is None:
            raise RuntimeError("rollback needs start_recording() before the commit")
        longest = int(torch.as_tensor(keep).max())  # one host read (none for a list), not one per GDN layer
        keep = torch.as_tensor(keep, dtype=torch.long, device=self.device).expand(self.batch_size)
        groups: dict = {}  # GDN layers with records of one shape roll back together
        for s, saved in zip(self.layers, snap.layers):
            if isinstance(s, DeltaNetState) and s.record is not None:
                groups.setdefault(tuple(tuple(t.shape) for t in s.record[:5]), []).append((s, saved))
            else:
                s.rollback(saved, keep, longest)
        for group in groups.values():
            DeltaNetState.rollback_layers([s for s, _ in group], [saved for _, saved in group], keep, longest)
        self.lengths.copy_(snap.lengths + keep)
        self._stop_recording()

    def drop_span(self, row: int, begin: int, end: int) -> None:
        """Remove slots [begin, end) of one row's keys and values, the later ones moving down (a
        whole-sequence model's dual cache: the canvas's keys but its current block's; attention
        layers only, whose stored keys carry their RoPE already)."""
        if self.deltanet_states():
            raise ValueError("drop_span: a linear-attention state cannot drop positions")
        n = int(self.lengths[row])
        for state in self.attention_states():
            for buf in (state.keys, state.values):
                buf[row, :, begin : n - (end - begin)] = buf[row, :, end:n].clone()
        self.lengths[row] = n - (end - begin)

    def select_rows(self, rows: list[int] | torch.Tensor) -> "HybridCache":
        """A new cache holding copies of the given rows (used to split or reorder a batch)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        out = HybridCache([s.select(idx) for s in self.layers], len(idx), self.capacity, device=self.device)
        out.lengths = self.lengths[idx].clone()
        return out

    @staticmethod
    def concat(caches: list["HybridCache"]) -> "HybridCache":
        """Stack several caches (same model) into one batch; K/V padded to the largest capacity."""
        first = caches[0]
        cap = max(c.capacity for c in caches)
        for c in caches:
            c.ensure_capacity(cap, exact=True)
        layers = [type(s).cat([c.layers[i] for c in caches]) for i, s in enumerate(first.layers)]
        out = HybridCache(layers, sum(c.batch_size for c in caches), cap, device=first.device)
        out.lengths = torch.cat([c.lengths for c in caches])
        return out
