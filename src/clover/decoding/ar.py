"""Autoregressive decoding with the cache: prefill, then one token per forward.

The baseline every other mode is measured against. Rows of a batch may have different prompt
lengths (right-padded prefill) and finish at different times (finished rows commit nothing)."""

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


def next_tokens(row: RowState, logits: torch.Tensor, generator, history_tail: list | None = None) -> tuple[list[int], list[float]]:
    """Process and propose for the positions of one row. logits [N, V]."""
    p = row.params
    history = None
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.no_repeat_ngram_size:
        base = row.prompt + row.tokens
        history = [base + list(h) for h in (history_tail or [[]] * logits.shape[0])]
    processed = process_logits(logits, p, history, sorted(row.eos_ids))
    toks, conf = propose(processed, p, generator)
    return toks.tolist(), conf.tolist()


@torch.inference_mode()
def ar_decode(model, rows: list[RowState], pad_id: int = 0) -> Iterator[DecodeEvent]:
    device = model.device
    B = len(rows)
    for i, r in enumerate(rows):
        if r.params.max_new_tokens == 0:
            r._finish("length")
            yield DecodeEvent("finish", i, [], [])
    if all(r.finished for r in rows):
        return
    gens = [make_generator(r.params.seed, device) for r in rows]
    ids, lens = pad_right([r.prompt for r in rows], pad_id, device)
    capacity = int(lens.max()) + max(r.params.max_new_tokens for r in rows) + 1
    cache = model.make_cache(B, capacity)
    out = model.step(cache, commit_ids=ids, n_commit=lens, track_experts=True)
    while True:
        feed = torch.full((B, 1), pad_id, dtype=torch.long, device=device)
        n = torch.zeros(B, dtype=torch.long, device=device)
        for i, r in enumerate(rows):
            if r.finished:
                continue
            r.forwards += 1
            r.experts_touched.extend(out.experts_touched)
            toks, _ = next_tokens(r, out.commit_logits[i : i + 1], gens[i])
            kept = r.accept(toks, [1])
            if kept:
                yield DecodeEvent("commit", i, kept, [1] * len(kept), block=len(r.tokens) - 1)
            if r.finished:
                yield DecodeEvent("finish", i, [], [])
            else:
                feed[i, 0], n[i] = toks[0], 1
        if all(r.finished for r in rows):
            return
        out = model.step(cache, commit_ids=feed, n_commit=n, track_experts=True)
