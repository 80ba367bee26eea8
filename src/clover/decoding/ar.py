"""Autoregressive decoding with the cache: prefill, then one token per forward.

The baseline every other mode is measured against. `AREngine` holds a batch whose rows may have
different prompt lengths (right-padded prefill), join at any forward (their prefill rides along with
the others' decode step) and leave when finished."""

from __future__ import annotations

from typing import Iterator

import torch

from .base import DecodeEvent, RowState
from .sampling import make_generator, process_logits, propose


def pad_right(seqs: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), T), pad, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        if s:
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long, device=device)
    return ids, torch.tensor([len(s) for s in seqs], dtype=torch.long, device=device)


def propose_tokens(row: RowState, logits: torch.Tensor, generator, history_tail: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Process and propose for the positions of one row. logits [N, V] -> (tokens [N], confidences [N])."""
    p = row.params
    history = None
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.no_repeat_ngram_size:
        base = row.prompt + row.tokens
        history = [base + list(h) for h in (history_tail or [[]] * logits.shape[0])]
    processed = process_logits(logits, p, history, sorted(row.eos_ids))
    return propose(processed, p, generator)


def next_tokens(row: RowState, logits: torch.Tensor, generator, history_tail: list | None = None) -> tuple[list[int], list[float]]:
    """`propose_tokens` as Python lists."""
    toks, conf = propose_tokens(row, logits, generator, history_tail)
    return toks.tolist(), conf.tolist()


class BatchEngine:
    """Rows in flight over one cache; subclasses define what a forward feeds and how it is read."""

    def __init__(self, model, *, pad_id: int = 0) -> None:
        self.model = model
        self.pad_id = pad_id
        self.rows: list[RowState] = []
        self.cache = None

    @property
    def device(self):
        return self.model.device

    def __len__(self) -> int:
        return len(self.rows)

    def _capacity(self, row: RowState) -> int:
        return len(row.prompt) + row.params.max_new_tokens + 1

    def add(self, row: RowState) -> list[DecodeEvent]:
        """Admit a row; its prompt is committed with the next forward. A row with nothing to
        generate finishes at once."""
        if row.params.max_new_tokens == 0:
            row._finish("length")
            return [DecodeEvent("finish", -1, [], [], row_state=row)]
        self._init_row(row)
        cap = self._capacity(row)
        fresh = self.model.make_cache(1, cap)
        if self.cache is None:
            self.cache = fresh
        else:
            self.cache.ensure_capacity(cap)
            fresh.ensure_capacity(self.cache.capacity)
            self.cache = self.cache.concat([self.cache, fresh])
        self.rows.append(row)
        return []

    def _init_row(self, row: RowState) -> None:
        row.gen = make_generator(row.params.seed, self.device)
        row.pending = list(row.prompt)

    def cancel(self, row: RowState, reason: str = "abort") -> None:
        """Finish a row now (e.g. its client went away) and release its cache slot."""
        row.cancel(reason)
        self._drop_finished()

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.rows) if not r.finished]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self.cache = self.cache.select_rows(keep) if keep else None

    def run(self) -> Iterator[DecodeEvent]:
        while self.rows:
            yield from self.step()


class AREngine(BatchEngine):
    @torch.inference_mode()
    def step(self) -> list[DecodeEvent]:
        ids, n = pad_right([r.pending for r in self.rows], self.pad_id, self.device)
        out = self.model.step(self.cache, commit_ids=ids, n_commit=n, track_experts=True)
        events = []
        for i, r in enumerate(self.rows):
            r.forwards += 1
            r.experts_touched.extend(out.experts_touched)
            toks, _ = next_tokens(r, out.commit_logits[i : i + 1], r.gen)
            kept = r.accept(toks, [1])
            if kept:
                events.append(DecodeEvent("commit", i, kept, [1], block=len(r.tokens) - 1, row_state=r))
            if r.finished:
                events.append(DecodeEvent("finish", i, [], [], row_state=r))
            r.pending = toks
        self._drop_finished()
        return events


def ar_decode(model, rows: list[RowState], pad_id: int = 0) -> Iterator[DecodeEvent]:
    engine = AREngine(model, pad_id=pad_id)
    for r in rows:
        yield from engine.add(r)
    yield from engine.run()
