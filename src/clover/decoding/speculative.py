"""Lossless self-speculative decoding: the model drafts a block with one denoise pass and verifies
it with one causal (commit) pass of the same weights.

Per row, each forward carries a commit part and an all-masked denoise block of `draft_length`:
- a row with a fresh draft commits the draft (the *verify* pass) — position j-1 of the causal logits
  verifies draft token j; the longest agreeing prefix is kept, plus the causal token at the first
  mismatch (or the bonus token after a full accept) as the next draft's first token;
- the same forward's denoise block is the *next draft*, valid when the whole draft was accepted; after
  a partial accept the cache is rolled back to the accepted length (K/V truncated, GDN state re-derived
  from the recorded inputs of exactly the accepted tokens) and the next forward drafts again.
Draft token 0 always comes from causal logits, so every iteration gains at least one token, and greedy
output is identical to AR greedy decoding. Sampling (temperature > 0) is refused: the output
distribution would not match AR sampling without a rejection-sampling rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BatchEngine, DecodeEvent, EngineRow, RowState, pad_right
from .modes import Mode, register


def check_speculative_params(params) -> None:
    if not params.greedy:
        raise ValueError("temperature: speculative mode is greedy-only (lossless w.r.t. AR greedy); use mode 'ar' or 'diffusion' to sample")
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.no_repeat_ngram_size:
        raise ValueError("repetition_penalty: history-dependent penalties are not supported in speculative mode")


@dataclass(eq=False)
class SpeculativeRow(EngineRow):
    first_logits: torch.Tensor | None = None  # causal logits after the last accepted token
    draft: list[int] | None = None  # a draft awaiting verification by the next forward


class SpeculativeEngine(BatchEngine):
    row_type = SpeculativeRow

    def __init__(self, model, *, draft_length: int, mask_id: int, pad_id: int = 0,
                 expert_budget: int | None = None, expert_rank: str = "sum") -> None:
        super().__init__(model, pad_id=pad_id)
        self.draft_length, self.mask_id, self.expert_budget = draft_length, mask_id, expert_budget
        self.expert_rank = expert_rank

    def _capacity(self, row: RowState) -> int:
        return len(row.prompt) + row.params.max_new_tokens + 2 * self.draft_length + 1

    def _init_row(self, row: RowState) -> None:
        check_speculative_params(row.params)
        super()._init_row(row)

    def _argmax(self, row: RowState, logits: torch.Tensor) -> list[int]:
        return row.state.sampler.process(logits).argmax(-1).tolist()

    def _draft_constrained(self, r: RowState, logits: torch.Tensor) -> list[int]:
        """The draft of a constrained row: position j's logits masked by the grammar after draft[:j]
        (the grammar state is restored afterwards; the draft stops where the grammar is complete)."""
        c, draft = r.constraint, []
        for j in range(logits.shape[0]):
            if c.stopped:
                break
            tok = self._argmax(r, c.mask(logits[j : j + 1]))[0]
            if not c.consume([tok]):
                break
            draft.append(tok)
        c.rollback(len(draft))
        return draft or self._argmax(r, c.mask(logits[:1]))

    def _verify_constrained(self, r: RowState, causal_logits: torch.Tensor) -> int:
        """How many draft tokens constrained AR greedy agrees with; the grammar consumes them.
        causal_logits[j] follows draft[:j+1]; each is masked by the grammar after draft[:j+1], so
        the kept tokens are exactly the tokens constrained AR would choose."""
        c, draft = r.constraint, r.state.draft
        c.consume(draft[:1])  # draft[0] comes from masked causal logits: constrained AR's own token
        m = 1
        while m < len(draft) and not c.stopped:
            if self._argmax(r, c.mask(causal_logits[m - 1 : m]))[0] != draft[m]:
                break
            c.consume(draft[m : m + 1])
            m += 1
        return m

    @torch.inference_mode()
    def step(self) -> list[DecodeEvent]:
        D, rows = self.draft_length, self.rows
        commit_src = [r.state.draft if r.state.draft is not None else r.state.pending for r in rows]
        has_commit = any(commit_src)
        commit_ids, n_commit = pad_right(commit_src, self.pad_id, self.device) if has_commit else (None, None)
        snap = self.cache.start_recording()
        block = torch.full((len(rows), D), self.mask_id, dtype=torch.long, device=self.device)
        out = self.model.step(self.cache, commit_ids=commit_ids, n_commit=n_commit, denoise_ids=block,
                              all_logits=True, track_experts=True, expert_budget=self.expert_budget,
                              expert_rank=self.expert_rank)
        keep = n_commit.clone() if has_commit else torch.zeros(len(rows), dtype=torch.long, device=self.device)
        events: list[DecodeEvent] = []
        for i, r in enumerate(rows):
            r.forwards += 1
            r.experts_touched.extend(out.experts_touched)
            next_draft_ok = True
            if r.state.draft is not None:  # verify
                if r.constraint is None:
                    causal = self._argmax(r, out.commit_logits[i, :D])  # causal[j] = AR token after draft[:j+1]
                    m = 1
                    while m < D and r.state.draft[m] == causal[m - 1]:
                        m += 1
                else:
                    m = self._verify_constrained(r, out.commit_logits[i, :D])
                accepted = r.state.draft[:m]
                r.accept_lengths.append(m)
                keep[i] = m
                r.state.first_logits = out.commit_logits[i, m - 1]
                next_draft_ok = m == D
                kept = r.accept(accepted, [1] * m)
                r.grammar_done()
                if kept:
                    events.append(DecodeEvent("commit", i, kept, [1] * len(kept), block=len(r.accept_lengths) - 1, row_state=r))
            elif r.state.pending:  # prompt prefill rides with the first draft
                r.state.first_logits = out.commit_logits[i, len(r.state.pending) - 1]
                r.state.pending = []
            r.state.draft = None
            if r.finished:
                events.append(DecodeEvent("finish", i, [], [], row_state=r))
                continue
            if next_draft_ok:
                if r.constraint is None:
                    first = self._argmax(r, r.state.first_logits[None])
                    rest = self._argmax(r, out.denoise_logits[i, : D - 1]) if D > 1 else []
                    r.state.draft = first + rest
                else:
                    r.state.draft = self._draft_constrained(r, torch.cat([r.state.first_logits[None],
                                                                          out.denoise_logits[i, : D - 1]]))
        if any(int(keep[i]) != (int(n_commit[i]) if has_commit else 0) for i in range(len(rows))):
            self.cache.rollback(snap, keep)
        else:
            self.cache.record = None
        self._drop_finished()
        return events


class Speculative(Mode):
    name = "speculative"
    needs_mask = True
    reference = "ar"
    summary = "self-speculative: drafts a block by denoising, verifies it causally (greedy == AR greedy)"

    def check(self, params) -> None:
        check_speculative_params(params)
        if (params.draft_length or params.block_size) > params.block_size:
            raise ValueError(f"draft_length: must be <= block_size ({params.block_size}), got {params.draft_length}")

    def extra_positions(self, params) -> int:
        return params.block_size

    def group(self, params) -> tuple:
        return (self.name, params.draft_length or params.block_size, params.expert_budget, params.expert_rank)

    def make_engine(self, model, params, *, mask_id, pad_id, provisional=False):
        return SpeculativeEngine(model, draft_length=params.draft_length or params.block_size, mask_id=mask_id,
                                 pad_id=pad_id, expert_budget=params.expert_budget,
                                 expert_rank=params.expert_rank)


register(Speculative())
