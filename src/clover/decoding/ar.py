"""Autoregressive decoding with the cache: prefill, then one token per forward.

The baseline every other mode is measured against. `AREngine` holds a batch whose rows may have
different prompt lengths (right-padded prefill), join at any forward (their prefill rides along with
the others' decode step) and leave when finished."""

from __future__ import annotations

import torch

from .base import BatchEngine, DecodeEvent, grad_free_call, next_tokens, pad_right
from .modes import Mode, register


class AREngine(BatchEngine):
    # no block: where blocks start and how their first token is decided do not apply
    semantics_implemented = {"block_grid": ("absolute",), "first_token": ("commit_argmax",)}

    @grad_free_call
    def step(self) -> list[DecodeEvent]:
        ids, n = pad_right([r.state.pending for r in self.rows], self.pad_id, self.device)
        out = self.model.step(self.cache, kind="commit", commit_ids=ids, n_commit=n, track_experts=True)
        events = []
        for i, r in enumerate(self.rows):
            r.forwards += 1
            r.experts_touched.extend(out.experts_touched)
            toks = next_tokens(r, out.commit_logits[i : i + 1])
            kept = r.accept(toks, [1])
            r.grammar_done()
            if kept:
                events.append(DecodeEvent("commit", i, kept, [1], block=len(r.tokens) - 1, row_state=r))
            if r.finished:
                events.append(DecodeEvent("finish", i, [], [], row_state=r))
            r.state.pending = toks
        self._drop_finished()
        return events


class AR(Mode):
    name = "ar"
    summary = "autoregressive: one token per forward (the baseline)"
    engine = AREngine

    def build_engine(self, model, spec, *, mask_id, pad_id, drafter=None):
        return AREngine(model, pad_id=pad_id)


register(AR())
