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
output is identical to AR greedy decoding.

That is the fixed draft, what a block size or a `draft_length` decodes (and the llama.cpp port, to the
forward). The adaptive draft is `block_size="auto"`'s (`adaptive=True`):
- after a rejection, the draft's tokens past the rejected one ride along behind AR's token in the
  draft of the next forward: they were denoised from masks, never from the rejected token, so they
  are as good a guess of the positions after AR's token (sampled: each still drawn from its q,
  independently of the rejection), where the fixed draft verified AR's token alone;
- each row's draft may be cut before its first token the denoise pass is unsure of (`DRAFT_CUT`,
  off by default: no cut paid on the bundled model; the top probability of that token's
  distribution, decided before any draw, so sampling stays lossless), so an unsure draft costs a
  narrow commit and, kept whole, keeps the forward's denoise block as the next draft;
- a draft's first token is AR's own, always kept: it is emitted when drafted, as AR emits it, so a
  row it ends needs no further forward;
- the width of the next draft is chosen per forward (`width.DraftPolicy`: each row's expected kept
  tokens over what a step drafting that width costs at this batch size, `step_curve`), down to a
  draft of one: no denoise block, the forward is AR's step (what wins under a large batch).

Sampling (temperature > 0, with top-k / top-p) is lossless by the standard speculative rejection rule
(Leviathan et al. 2023; Chen et al. 2023): draft token j is drawn from the denoise distribution q_j
(the same temperature / top-k / top-p applied to the denoise logits), and kept with probability
min(1, p_j(x) / q_j(x)), p_j being AR's sampling distribution at that point (the verify pass's causal
logits); at the first rejection the next token is drawn from norm(max(0, p_j - q_j)) instead, and
becomes the next draft's first token. Each emitted token is then distributed exactly as AR sampling
would draw it (`accept_draft`).
"""

from __future__ import annotations

import math
import statistics
import time
import weakref
from dataclasses import dataclass

import torch

from .base import BatchEngine, DecodeEvent, EngineRow, RowState, grad_free_call, pad_right, row_history
from .modes import EngineSpec, Mode, register
from .sampling import AUTO, SamplingParams, filter_logits

# the adaptive draft is cut before its first token whose distribution's top probability is below
# this (0: never). On the bundled model no cut paid: at 0.1 it never cuts, from 0.2 on it keeps fewer
# tokens per verify (100 held-out prompts the benchmarks do not use: 2.82 uncut, 2.70 at 0.2, 2.67
# at 0.3, 2.57 at 0.7) at the same speed within noise (docs/experiments.md, 2026-12-03)
DRAFT_CUT = 0.0
# draft "auto" leaves out the denoise block of a forward whose drafts in flight are each kept whole
# with probability below this (`SpeculativeEngine._skip_block`; 0: never). That probability is read
# from the draft itself where the denoise pass gave it (a greedy draft: the product of its tokens' top
# probabilities; else a^(L-1), a the row's acceptance rate so far). Swept on held-out prompts the
# benchmarks do not use (`heldout_tasks(5000)[1000:1040]` and `[1040:1080]`, eager, two runs each at
# load 0.9-3.3): x AR 1.15-1.20 / 1.34-1.35 at 0.35 (2.18 / 2.58 tokens per forward), 1.11-1.17 /
# 1.35-1.37 at 0.5 (2.18 / 2.56), 1.17-1.23 / 1.30-1.33 at 0.7 (2.18 / 2.48); a^(L-1) at 0.35, the
# rule before, 1.12-1.16 / 1.29-1.30 (2.12 / 2.46)
SKIP_BLOCK_BELOW = 0.35


def check_speculative_params(params) -> None:
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.no_repeat_ngram_size:
        raise ValueError("repetition_penalty: history-dependent penalties are not supported in speculative mode")


def accept_draft(draft: list[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
                 ) -> tuple[int, int | None]:
    """The speculative rejection rule. `draft[0]` was drawn from AR's distribution itself; `draft[j]`
    (j >= 1) from `q[j-1]` ([D-1, V] probabilities); `p[j-1]` is AR's distribution at draft
    position j. Returns (m, token): the first m draft tokens are kept, and `token` (None when all D
    were kept) is drawn from the residual norm(max(0, p - q)) at the first rejected position."""
    D = len(draft)
    if D <= 1:
        return D, None
    idx = torch.tensor(draft[1:], dtype=torch.long, device=p.device)
    px = p.gather(-1, idx[:, None]).squeeze(-1)
    qx = q.gather(-1, idx[:, None]).squeeze(-1)
    u = torch.rand(D - 1, generator=generator).to(p.device)
    rejected = (u * qx > px).nonzero()
    if rejected.numel() == 0:
        return D, None
    j = int(rejected[0])
    residual = (p[j] - q[j]).clamp_min(0)
    total = residual.sum()
    residual = residual / total if total > 0 else p[j]  # p == q there: any draw from p is exact
    return j + 1, int(torch.multinomial(residual, 1, generator=generator))


def sampling_probs(row: RowState, logits: torch.Tensor, history_tail: list | None = None) -> torch.Tensor:
    """AR's sampling distribution for logits [N, V] of one row: processed (penalties, whose history
    is the row's tokens plus `history_tail[n]` at position n), then temperature / top-k / top-p."""
    s = row.state.sampler
    return filter_logits(s.process(logits, row_history(row, history_tail, logits.shape[0])), s.params).softmax(-1)


def agreed(draft: list[int], target: list[int]) -> int:
    """Greedy verification: how many leading draft tokens equal the target's tokens there."""
    m = 0
    while m < min(len(draft), len(target)) and draft[m] == target[m]:
        m += 1
    return m


def commit_verified(r: RowState, i: int, tokens: list[int], events: list[DecodeEvent], emitted: int = 0) -> list[int]:
    """The outcome of a verify for row `r` (batch index `i`): `tokens` (the kept drafts and the
    model's own token) recorded as one accept length and appended by `RowState.accept` (EOS, stops,
    limits; a complete grammar ends the row), but for the first `emitted` of them, appended when
    they were drafted; a commit event for what was kept. Returns it."""
    r.accept_lengths.append(len(tokens))
    tokens = tokens[emitted:]
    kept = r.accept(tokens, [1] * len(tokens))
    r.grammar_done()
    if kept:
        events.append(DecodeEvent("commit", i, kept, [1] * len(kept), block=len(r.accept_lengths) - 1, row_state=r))
    return kept


def settle_cache(cache, snap, keep: list[int], committed: list[int]) -> None:
    """After a verify forward that committed `committed[b]` tokens per row since `snap`
    (`cache.start_recording()`): roll the cache back to the first `keep[b]` of them where a row
    keeps fewer, else just stop recording. Both are host lists: deciding reads nothing back."""
    if keep != committed:
        cache.rollback(snap, keep)
    else:
        cache.record = None


def constrained_draft(r: RowState, logits: torch.Tensor) -> list[int]:
    """A greedy draft under the row's grammar: position j's logits [D, V] masked by the grammar
    after draft[:j] (the grammar state is restored afterwards; the draft stops where the grammar
    is complete, so it may be shorter than D or empty)."""
    c, draft = r.constraint, []
    processed = r.state.sampler.process(logits)
    for j in range(logits.shape[0]):
        if c.stopped:
            break
        tok = c.argmax(processed[j])
        if not c.consume([tok]):
            break
        draft.append(tok)
    c.rollback(len(draft))
    return draft


def constrained_sampled_draft(r: RowState, logits: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
    """A sampled draft under the row's grammar: token j drawn from AR's sampling distribution of
    logits[j] masked by the grammar after draft[:j] (the grammar state is restored afterwards; the
    draft stops where the grammar is complete). Returns the draft and those distributions
    ([len, V], for the rejection rule; None when empty)."""
    c, gen, draft, qs = r.constraint, r.state.sampler.generator, [], []
    for j in range(logits.shape[0]):
        if c.stopped:
            break
        q = sampling_probs(r, c.mask(logits[j : j + 1]))
        tok = int(torch.multinomial(q, 1, generator=gen))
        if not c.consume([tok]):
            break
        draft.append(tok)
        qs.append(q[0])
    c.rollback(len(draft))
    return draft, (torch.stack(qs) if qs else None)


def sure_prefix(probs: torch.Tensor, cut: float) -> list[int]:
    """Per row of `probs` [rows, D] (the drafter's probability of each draft token it proposes):
    how many leading draft tokens it gave at least `cut`, where the draft is cut. The cut reads the
    drafter alone, so the verify stays lossless (greedy and sampled)."""
    below = probs < cut
    return torch.where(below.any(1), below.int().argmax(1), below.shape[1]).tolist()


def choose_draft(policy, rows: list[RowState], choices: list, forward: int, from_ar: bool = False) -> int:
    """Draft "auto" (a `width.DraftPolicy`): the width with the most expected tokens per second for
    these rows, each keeping a draft token at its own rate so far (`state.kept_draft` kept,
    `state.rejected_draft` verifies that rejected one). `from_ar`: the last forward took AR's step,
    so a row whose draft is AR's token alone starts drafting only where the gain over the tokens it
    is expected to have left pays for the forward that starts it (`DraftPolicy.tokens_per_forward`;
    nothing says where a row's answer ends, so: as many again as it has generated). A new decision
    is appended to `choices` and to each row's `width_why`; returns the width."""
    rows_in = []
    for r in rows:
        a = policy.acceptance(r.state.kept_draft, r.state.rejected_draft)
        starting = from_ar and r.state.draft is not None and len(r.state.draft) <= 1
        rows_in.append((a, r.remaining, max(1, len(r.tokens)) if starting else None))
    choice = policy.choose(rows_in)
    choice.forward = forward
    if not choices or choices[-1].width != choice.width or choices[-1].batch != choice.batch:
        choices.append(choice)
        for r in rows:
            r.width_why.append(f"forward {forward}: draft {choice.why()}")
    return choice.width


@dataclass(eq=False)
class SpeculativeRow(EngineRow):
    first_logits: torch.Tensor | None = None  # causal logits after the last accepted token
    draft: list[int] | None = None  # a draft awaiting verification by the next forward
    draft_q: torch.Tensor | None = None  # sampling: [D-1, V] the distributions draft[1:] were drawn from
    # greedy, draft "auto": the denoise pass's top probability at each of draft[1:] (None: not known)
    draft_sure: list[float] | None = None
    next_first: int | None = None  # sampling: the residual draw at a rejection, the next draft's first token
    kept_draft: int = 0  # draft tokens after the first kept so far (draft "auto": the acceptance rate)
    rejected_draft: int = 0  # verifies that rejected a draft token


class SpeculativeEngine(BatchEngine):
    row_type = SpeculativeRow

    def __init__(self, model, *, draft_length: int | str, mask_id: int, pad_id: int = 0,
                 expert_budget: int | None = None, expert_rank: str = "sum", draft_policy=None,
                 cut: float | None = None, adaptive: bool = False) -> None:
        super().__init__(model, pad_id=pad_id)
        # the adaptive draft: after a rejection the draft past the rejected token drafts on, and a
        # draft's first token is emitted when drafted (else the fixed draft, as the llama.cpp port's)
        self.adaptive = adaptive
        self.cut = cut  # cut each draft before its first token below this denoise probability (None: never)
        self.draft_policy = None
        if draft_length == AUTO:
            from .width import DraftPolicy

            self.draft_policy = draft_policy or DraftPolicy.for_model(
                model, lambda widths, batch: step_curve(model, widths, batch, mask_id=mask_id, pad_id=pad_id))
            draft_length = max(self.draft_policy.widths)
        self.draft_length, self.mask_id, self.expert_budget = draft_length, mask_id, expert_budget
        # the cache reserves room for drafts of this length behind each row; draft "auto" reserves for
        # the model's block size, and a wider draft, when chosen, grows the cache (doubling: rarely) —
        # room for its widest draft (64) doubled a row's cache and what every row joining or leaving
        # the batch copies (batch 16 held to AR's step: 0.83-0.88x AR, 1.01x with the narrower room)
        self.max_draft = draft_length if self.draft_policy is None else min(draft_length, model.config.block_size)
        self.expert_rank = expert_rank
        self.choices: list = []  # draft "auto": each WidthChoice (draft length, why), in order
        self.forwards = 0
        # draft "auto": leave out the denoise block of a forward whose drafts in flight are all likely
        # rejected (`_skip_block`); `skipped` counts those forwards
        self.skip_below = SKIP_BLOCK_BELOW if self.draft_policy is not None else 0.0
        self.skipped = 0

    def _capacity(self, row: RowState) -> int:
        return len(row.prompt) + row.params.max_new_tokens + 2 * self.max_draft + 1

    def _skip_block(self) -> bool:
        """Draft "auto", eagerly: whether this forward leaves out its denoise block. The block drafts
        the tokens after a row's whole draft, so it is used only where the draft in flight is kept
        whole; a rejection drafts on from the rejected draft's leftover (and AR's token) either way.
        Left out where every row's draft in flight is likely rejected (`kept_whole` below
        `skip_below`): the forward costs a commit of the drafts alone, and a row that keeps its draft
        whole after all drafts its next block one forward later."""
        if not self.skip_below or self.model.static_steps is not None:  # compiled: the verify graph has the block
            return False
        return all(r.state.draft is not None and len(r.state.draft) > 1 and self.kept_whole(r) < self.skip_below
                   for r in self.rows)

    def kept_whole(self, r: RowState) -> float:
        """The probability that the row's draft in flight (of L > 1 tokens) is kept whole: where the
        denoise pass gave its tokens' top probabilities (`draft_sure`: a greedy draft), their product —
        on held-out prompts this ranks the drafts kept whole above the rest 98% of the time, and a draft
        at 0.9+ is kept whole in 98% of verifies, at 0.1- in none (docs/benchmarks.md); else
        a^(L-1), a the row's acceptance rate so far (ranking them 69% of the time)."""
        L, sure = len(r.state.draft), r.state.draft_sure
        if sure is not None and len(sure) >= L - 1:
            return math.prod(sure[: L - 1])
        return self.draft_policy.acceptance(r.state.kept_draft, r.state.rejected_draft) ** (L - 1)

    def _choose_draft(self) -> None:
        """Draft "auto": the draft length of the drafts this forward makes (a verify of a draft of D
        costs a forward of 2D positions; each draft token is kept with the row's acceptance rate)."""
        self.draft_length = choose_draft(self.draft_policy, self.rows, self.choices, self.forwards,
                                         from_ar=self.forwards > 0 and self.draft_length == 1)
        if self.draft_length <= 1:  # AR's step: nothing to fit
            return
        # a row near the end of the context drafts only what fits behind it: the context reserves the
        # model's block size for a draft (`Speculative.extra_positions`), a wider choice narrows there
        room = self.model.config.max_position_embeddings - max(
            n + len(r.state.draft if r.state.draft is not None else r.state.pending)
            for n, r in zip(self.cache.lengths.tolist(), self.rows))
        if self.draft_length > room:
            self.draft_length = max((w for w in self.draft_policy.widths if w <= room), default=1)

    def _init_row(self, row: RowState) -> None:
        check_speculative_params(row.params)
        super()._init_row(row)

    def _argmax(self, row: RowState, logits: torch.Tensor) -> list[int]:
        return row.state.sampler.process(logits).argmax(-1).tolist()

    def _draft_constrained(self, r: RowState, logits: torch.Tensor) -> list[int]:
        """The draft of a constrained row (`constrained_draft`), at least one token."""
        return constrained_draft(r, logits) or [r.constraint.argmax(r.state.sampler.process(logits[:1])[0])]

    def _draft_constrained_sampled(self, r: RowState, logits: torch.Tensor) -> list[int]:
        """Sampling under a grammar: each draft token drawn from its distribution masked by the
        grammar after the draft so far (kept in `draft_q` for the rejection rule)."""
        c = r.constraint
        gen = r.state.sampler.generator
        if r.state.next_first is not None:
            draft, r.state.next_first = [r.state.next_first], None
        else:
            draft = torch.multinomial(self._probs(r, c.mask(logits[:1])), 1, generator=gen).flatten().tolist()
        c.consume(draft)
        rest, r.state.draft_q = constrained_sampled_draft(r, logits[1:])
        c.rollback(len(draft))
        return draft + rest

    def _verify_constrained_sampled(self, r: RowState, causal_logits: torch.Tensor) -> int:
        """The rejection rule against AR's distributions masked by the grammar after each draft
        prefix: distributed as constrained AR sampling. The grammar consumes the kept tokens."""
        c, draft = r.constraint, r.state.draft
        if len(draft) <= 1:
            c.consume(draft)
            return len(draft)
        ps = []
        c.consume(draft[:1])
        for j in range(1, len(draft)):
            ps.append(self._probs(r, c.mask(causal_logits[j - 1 : j]))[0])
            c.consume(draft[j : j + 1])
        c.rollback(len(draft) - 1)
        m, r.state.next_first = accept_draft(draft, r.state.draft_q, torch.stack(ps), r.state.sampler.generator)
        c.consume(draft[1:m])
        return m

    def _verify_constrained(self, r: RowState, causal_logits: torch.Tensor) -> int:
        """How many draft tokens constrained AR greedy agrees with; the grammar consumes them.
        causal_logits[j] follows draft[:j+1]; each is masked by the grammar after draft[:j+1], so
        the kept tokens are exactly the tokens constrained AR would choose."""
        c, draft = r.constraint, r.state.draft
        c.consume(draft[:1])  # draft[0] comes from masked causal logits: constrained AR's own token
        processed = r.state.sampler.process(causal_logits)
        m = 1
        while m < len(draft) and not c.stopped:
            if c.argmax(processed[m - 1]) != draft[m]:
                break
            c.consume(draft[m : m + 1])
            m += 1
        return m

    _probs = staticmethod(sampling_probs)

    def _draft(self, r: RowState, denoise_logits: torch.Tensor | None) -> list[int]:
        """The next draft: token 0 from the causal logits (or a rejection's residual draw), the rest
        from the denoise logits (`denoise_logits[j-1]` predicts draft token j; None: a draft of one),
        cut before the first the denoise pass gave less than `self.cut`."""
        rest: list[int] = []
        if r.params.greedy:
            first = self._argmax(r, r.state.first_logits[None])
            r.state.draft_sure = [] if self.skip_below else None
            if denoise_logits is not None:
                processed = r.state.sampler.process(denoise_logits)
                rest = processed.argmax(-1).tolist()
                if self.cut or self.skip_below:
                    sure = processed.softmax(-1).amax(-1)
                    if self.cut:
                        rest = rest[: sure_prefix(sure[None], self.cut)[0]]
                    if self.skip_below:
                        r.state.draft_sure = sure[: len(rest)].tolist()
            return first + rest
        gen = r.state.sampler.generator
        if r.state.next_first is not None:
            first, r.state.next_first = [r.state.next_first], None
        else:
            first = torch.multinomial(self._probs(r, r.state.first_logits[None]), 1, generator=gen).flatten().tolist()
        r.state.draft_q = None
        if denoise_logits is not None:
            q = self._probs(r, denoise_logits)
            drawn = torch.multinomial(q, 1, generator=gen)
            # cut by each distribution's top probability: a cut that read the drawn tokens' would bias
            # what the rejection rule emits (tests/test_speculative.py)
            k = q.shape[0] if not self.cut else sure_prefix(q.amax(-1)[None], self.cut)[0]
            rest = drawn[:k, 0].tolist()
            r.state.draft_q = q[:k] if k else None
        return first + rest

    def early(self, r: RowState) -> bool:
        """Whether the row's drafts have their first token emitted when drafted (the adaptive draft;
        not under a grammar, whose verify consumes it)."""
        return self.adaptive and r.constraint is None

    def _next_draft(self, r: RowState, denoise_logits: torch.Tensor | None) -> list[int]:
        """The row's next draft from its causal logits and `denoise_logits` (the predictions of draft
        tokens 1.. ; None: a draft of one, AR's own next token), under the row's grammar if any."""
        if r.constraint is None:
            return self._draft(r, denoise_logits)
        first = r.state.first_logits[None]
        logits = first if denoise_logits is None else torch.cat([first, denoise_logits])
        return (self._draft_constrained if r.params.greedy else self._draft_constrained_sampled)(r, logits)

    @grad_free_call
    def step(self) -> list[DecodeEvent]:
        if self.draft_policy is not None:
            self._choose_draft()
        self.forwards += 1
        D, rows = self.draft_length, self.rows
        if D > 1 and self._skip_block():
            D = 1  # this forward verifies the drafts in flight and drafts nothing
            self.skipped += 1
        commit_src = [r.state.draft if r.state.draft is not None else r.state.pending for r in rows]
        has_commit = any(commit_src)
        commit_ids, n_commit = pad_right(commit_src, self.pad_id, self.device) if has_commit else (None, None)
        longer = any(r.state.draft is not None and len(r.state.draft) > 1 for r in rows)  # a draft to verify
        # a draft of one needs no denoise block: its token comes from the causal logits (the AR step)
        width = D
        if D == 1 and self.model.static_steps is not None and longer:
            # compiled: a verify has a graph with the block (draft auto narrowing to AR), its block unused
            width = self.model.config.block_size
        block = torch.full((len(rows), width), self.mask_id, dtype=torch.long, device=self.device) if width > 1 else None
        # drafts of one are always kept: with no denoise block the forward is AR's step, no logits but
        # the last and nothing to roll back (with one, the verify forward's shape: compiled, its graph);
        # a forward of prompts alone verifies nothing either (the logits of the prompts' last tokens)
        verifying = (block is not None and any(r.state.draft is not None for r in rows)) or longer
        snap = self.cache.start_recording() if verifying else None
        out = self.model.step(self.cache, commit_ids=commit_ids, n_commit=n_commit, denoise_ids=block,
                              all_logits=verifying, track_experts=True, expert_budget=self.expert_budget,
                              expert_rank=self.expert_rank)
        causal_logits = out.commit_logits if verifying else out.commit_logits[:, None]  # [B, Tc or 1, V]
        committed = [len(s) for s in commit_src]
        keep = list(committed)
        events: list[DecodeEvent] = []
        for i, r in enumerate(rows):
            r.forwards += 1
            r.experts_touched.extend(out.experts_touched)
            next_draft_ok = True
            Dv = len(r.state.draft) if r.state.draft is not None else 0
            if r.state.draft is not None and r.constraint is not None:  # verify under the grammar
                verify = self._verify_constrained if r.params.greedy else self._verify_constrained_sampled
                m = verify(r, causal_logits[i, :Dv])
            elif r.state.draft is not None and not r.params.greedy:  # verify by the rejection rule
                p = self._probs(r, causal_logits[i, : Dv - 1]) if Dv > 1 else None
                m, r.state.next_first = accept_draft(r.state.draft, r.state.draft_q, p, r.state.sampler.generator)
            elif Dv == 1:  # a draft of one is AR's own token: kept, nothing to compare
                m = 1
            elif r.state.draft is not None:  # verify
                causal = self._argmax(r, causal_logits[i, : Dv - 1])  # causal[j] = AR token after draft[:j+1]
                m = 1 + agreed(r.state.draft[1:], causal)
            if r.state.draft is not None:
                keep[i] = m
                r.state.first_logits = causal_logits[i, m - 1]
                r.state.kept_draft += m - 1
                r.state.rejected_draft += m < Dv
                next_draft_ok = m == Dv  # kept whole: this forward's denoise block follows the kept tokens
                commit_verified(r, i, r.state.draft[:m], events, emitted=int(self.early(r)))
            elif r.state.pending:  # prompt prefill rides with the first draft
                r.state.first_logits = causal_logits[i, len(r.state.pending) - 1 if verifying else 0]
                r.state.pending = []
            old_draft, old_q, old_sure = r.state.draft, r.state.draft_q, r.state.draft_sure
            r.state.draft = None
            if r.finished:
                events.append(DecodeEvent("finish", i, [], [], row_state=r))
                continue
            # after a rejection this forward's denoise block followed rejected tokens: the next forward
            # commits AR's own next token (a draft of one, always kept) while it denoises the block
            # after it, rather than only denoising (a forward that committed nothing)
            r.state.draft = self._next_draft(r, out.denoise_logits[i, : D - 1] if next_draft_ok and D > 1
                                             else None)
            if self.adaptive and not next_draft_ok and r.constraint is None and m + 1 < Dv:
                # and the draft's tokens past the rejected one ride along: they were denoised from masks,
                # never from the rejected token, so they draft the positions after AR's as well as before
                # (sampled: each still distributed as its q, drawn independently of the rejection)
                r.state.draft += old_draft[m + 1 :]
                if not r.params.greedy:
                    r.state.draft_q = old_q[m:]
                elif r.state.draft_sure is not None and old_sure is not None:
                    r.state.draft_sure = old_sure[m:]
            if self.early(r):
                # the draft's first token is AR's own (always kept): emitted now, as AR would emit it,
                # and a row it ends needs no further forward (a grammar's row keeps it to its verify)
                kept = r.accept(r.state.draft[:1], [1])
                if kept:
                    events.append(DecodeEvent("commit", i, kept, [1], block=len(r.accept_lengths), row_state=r))
                if r.finished:
                    r.state.draft = None
                    events.append(DecodeEvent("finish", i, [], [], row_state=r))
        if snap is not None:
            settle_cache(self.cache, snap, keep, committed)
        self._drop_finished()
        return events


# model -> (eager/compiled, widths, batch) -> CostCurve, once per process (read from the user cache or
# measured); weak keys, so that a model collected (its id reused) takes its curves with it
_STEP_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached_step_curve(cached, widths, batch: int) -> "CostCurve | None":
    """The step costs at `batch` rows for every width in `widths` from `cached` (the user cache's
    curve, `width.load_curve`; None: nothing cached), or None where one is missing."""
    from .width import STEP_KIND, CostCurve

    pts = (cached.seconds_by.get(STEP_KIND, {}).get(int(batch), {}) if cached is not None else {})
    if not all(w in pts for w in widths):
        return None
    curve = CostCurve()
    for w in widths:
        curve.add(STEP_KIND, batch, w, pts[w])
    return curve


@grad_free_call
def step_curve(model, widths, batch: int, *, mask_id: int, pad_id: int = 0, repeat: int = 8) -> "CostCurve":
    """What a forward of the adaptive draft costs as it runs at each width in `widths` (the verify
    and its drafting, rollback and bookkeeping; width 1: the AR step) at `batch` rows: an engine of
    that fixed width decoding random prompts, its steps timed in rounds across the widths after two
    untimed ones (a compiled model compiles there), the median kept (the rounds spread load that
    comes and goes on a shared machine over every width; the median keeps what a step pays as it
    varies, a rollback after one and none after the next). Kept in the `width.STEP_KIND` kind of a
    `width.CostCurve` for `width.DraftPolicy`, and in the user cache with the model's other costs
    (`width.save_curve`: per model shape, dtype, machine, eager or compiled): read from there when
    it is, else measured once and written there."""
    from .width import compiled_kind, load_curve, save_curve

    known = _STEP_COSTS.setdefault(model, {})
    key = (compiled_kind(model), tuple(widths), batch)
    if key in known:
        return known[key]
    curve = cached_step_curve(load_curve(model), widths, batch)
    if curve is None:
        curve = _time_steps(model, widths, batch, mask_id=mask_id, pad_id=pad_id, repeat=repeat)
        try:
            save_curve(model, curve)
        except OSError:  # a read-only cache: the curve still serves this process
            pass
    known[key] = curve
    return curve


STEP_PASSES = 2  # step_curve: passes of its rounds, the cheapest pass's median kept per width


def _time_steps(model, widths, batch: int, *, mask_id: int, pad_id: int, repeat: int) -> "CostCurve":
    """`step_curve`'s timing: per width the median of `repeat` rounds in each of `STEP_PASSES` passes,
    the cheapest pass kept, then no width dearer than a wider one. A measurement is kept in the user
    cache for good, so a burst of another process's load must not stay in it: on the shared 2-core
    box one pass read a batch-1 step drafting 8 at 3.7 AR steps (drafting 16: 3.4) where decoding
    pays ~2.2, and draft auto never drafted at batch 1; a burst seldom spans both passes, and a step
    does not get cheaper for carrying more positions."""
    from .width import STEP_KIND, CostCurve

    gen = torch.Generator().manual_seed(0)
    engines = {}
    for w in widths:
        engine = SpeculativeEngine(model, draft_length=w, mask_id=mask_id, pad_id=pad_id, adaptive=True)
        for _ in range(batch):
            prompt = torch.randint(3, model.config.vocab_size, (32,), generator=gen).tolist()
            budget = (STEP_PASSES * repeat + 2) * (w + 1) + 1
            engine.add(RowState(prompt, SamplingParams(max_new_tokens=budget, ignore_eos=True), set()))
        engine.step()  # the prefill
        engine.step()
        engines[w] = engine
    best = {w: float("inf") for w in widths}
    for _ in range(STEP_PASSES):
        seconds = {w: [] for w in widths}
        for _ in range(repeat):
            for w, engine in engines.items():
                t0 = time.perf_counter()
                engine.step()
                seconds[w].append(time.perf_counter() - t0)
        best = {w: min(best[w], statistics.median(seconds[w])) for w in widths}
    curve = CostCurve()
    dearest = float("inf")
    for w in sorted(widths, reverse=True):
        dearest = min(dearest, best[w])
        curve.add(STEP_KIND, batch, w, dearest)
    return curve


def pending_step_curves(model, batches) -> list[int]:
    """The batch sizes in `batches` whose draft "auto" step costs the user cache does not hold yet."""
    from .width import draft_widths, load_curve

    widths, cached = draft_widths(model.config), load_curve(model)
    return [b for b in batches if cached_step_curve(cached, widths, b) is None]


def measure_step_curves(model, batches, *, mask_id: int, pad_id: int = 0, bar=None) -> list[int]:
    """Draft "auto"'s step costs (`step_curve`) at each batch size in `batches` for the widths it
    chooses among (`width.draft_widths`), ahead of any request: those the user cache holds are read,
    the rest measured and cached. `bar`: a progress bar (tqdm's `update` and `set_postfix_str`) made
    by the caller over `pending_step_curves`' count (this module is bundled with the transformers
    export, which may import only the standard library and torch). Returns the batch sizes measured."""
    from .width import draft_widths

    widths = draft_widths(model.config)
    todo = pending_step_curves(model, batches)
    for b in batches:  # those in `todo` measured, the others read from the cache
        shown = bar is not None and b in todo
        if shown:
            bar.set_postfix_str(f"batch {b}")
        step_curve(model, widths, b, mask_id=mask_id, pad_id=pad_id)
        if shown:
            bar.update()
    return todo


class Speculative(Mode):
    name = "speculative"
    needs_mask = True
    reference = "ar"
    summary = ("self-speculative: drafts a block by denoising, verifies it causally (greedy == AR greedy; sampling "
               "distributed as AR's by the rejection rule)")

    auto_width = True  # block_size="auto": the draft length adapts to acceptance
    auto_default = True  # ... and is the default: 1.32x AR eager against the fixed draft's 1.13x (docs/benchmarks.md)

    def check(self, params) -> None:
        check_speculative_params(params)
        if params.block_size == AUTO:
            if params.draft_length is not None:
                raise ValueError("draft_length: block_size \"auto\" chooses the draft length; give one or the other")
            return
        if (params.draft_length or params.block_size) > params.block_size:
            raise ValueError(f"draft_length: must be <= block_size ({params.block_size}), got {params.draft_length}")

    def extra_positions(self, params, drafter=None, config=None) -> int:
        from .width import AUTO_MAX_WIDTH

        if params.block_size != AUTO:
            return params.block_size
        # the adaptive draft drafts at most the model's block size (`SpeculativeEngine.max_draft`)
        return AUTO_MAX_WIDTH if config is None else min(AUTO_MAX_WIDTH, config.block_size)

    def spec(self, params, provisional=False) -> EngineSpec:
        # block_size "auto": the adaptive draft; else the fixed draft of draft_length or the block size
        return EngineSpec(self, params.draft_length or params.block_size, params.expert_budget, params.expert_rank,
                          draft_cut=DRAFT_CUT if params.block_size == AUTO else None)

    def make_engine(self, model, spec, *, mask_id, pad_id):
        return SpeculativeEngine(model, draft_length=spec.width, mask_id=mask_id, pad_id=pad_id,
                                 expert_budget=spec.expert_budget, expert_rank=spec.expert_rank, cut=spec.draft_cut,
                                 adaptive=spec.draft_cut is not None)  # draft_cut 0: adaptive, never cut


register(Speculative())
