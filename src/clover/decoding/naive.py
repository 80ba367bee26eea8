"""The uncached baseline (`mode="naive"`): every denoise step recomputes the whole sequence, as the
original masked-diffusion reference generators do. The diffusion engine without a cache: same
block/threshold rules, so the two must produce the same tokens; only the cost differs."""

from __future__ import annotations

from .base import DecodeEvent, RowState
from .diffusion import Diffusion, DiffusionEngine
from .modes import register


class NaiveEngine(DiffusionEngine):
    """`DiffusionEngine` with no persistent cache: each forward builds a fresh one and commits each
    row's whole sequence so far into it (no approximate skips: nothing is kept to skip with)."""

    def __init__(self, model, **kw) -> None:
        super().__init__(model, **kw | {"skips": ()})

    def add(self, row: RowState) -> list[DecodeEvent]:
        if row.params.max_new_tokens == 0:
            row._finish("length")
            return [DecodeEvent("finish", -1, [], [], row_state=row)]
        self._init_row(row)
        self.rows.append(row)
        return []

    def _drop_finished(self) -> None:
        self.rows = [r for r in self.rows if not r.finished]

    def _commit_first(self, row: RowState, tokens: list[int]) -> None:
        row.state.committed = tokens

    def _forward_cache(self, rows: list[RowState]) -> tuple:
        cache = self.model.make_cache(len(rows), max(len(r.state.committed) for r in rows) + self.block_size)
        return cache, [r.state.committed for r in rows]

    def _queue_commit(self, r: RowState, tokens: list[int]) -> None:
        r.state.committed.extend(tokens)


class Naive(Diffusion):
    name = "naive"
    reference = "diffusion"
    summary = "block diffusion recomputing the whole sequence every step (the uncached reference)"
    engine = NaiveEngine


register(Naive())
