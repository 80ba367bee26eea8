"""Lossless self-speculative decoding: the model drafts a block with one denoise pass and verifies
it with one causal (commit) pass of the same weights (the drafter of the one verify engine,
`verify.VerifyEngine`, which holds the verify, the rejection rule and the rollback).

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
import weakref
from dataclasses import dataclass

import torch

from .base import RowState, grad_free_call
from .modes import EngineSpec, Mode, register
from .sampling import AUTO
from .verify import VerifyEngine, VerifyRow, sure_prefix

# the adaptive draft is cut before its first token whose top probability is below this (0: never):
# no cut paid on the bundled model (docs/experiments.md, 2026-12-03: the sweep)
DRAFT_CUT = 0.0
# draft "auto" leaves out the denoise block of a forward whose drafts in flight are each kept whole
# with probability below this (`SpeculativeEngine._skip_block`; 0: never): a greedy draft's product of
# its tokens' top denoise probabilities, else a^(L-1) from the row's acceptance rate so far (the sweep:
# docs/experiments.md, 2026-12-03, "the draft's own chance of being kept whole")
SKIP_BLOCK_BELOW = 0.35


def reserved_positions(width: int) -> int:
    """Positions a row drafting `width` tokens at a time (t and its drafts) needs past prompt +
    max_new_tokens: its last verify commits up to `width` tokens after the row's last committed one
    and denoises `width` more behind them (the furthest reaches 2 * width - 1 past the output), two
    to spare."""
    return 2 * width + 1


@dataclass(eq=False)
class SpeculativeRow(VerifyRow):
    # greedy, draft "auto": the denoise pass's top probability at each of draft[1:] (None: not known)
    draft_sure: list[float] | None = None


class SpeculativeEngine(VerifyEngine):
    """The verify engine drafting from the target's own denoise block: each forward carries, behind
    the drafts it verifies, an all-masked block of `width` whose logits draft the tokens after a
    draft kept whole."""

    row_type = SpeculativeRow

    def __init__(self, model, *, draft_length: int | str, mask_id: int, pad_id: int = 0,
                 expert_budget: int | None = None, expert_rank: str = "sum", draft_policy=None,
                 cut: float | None = None, adaptive: bool = False, reserve: int | None = None) -> None:
        if draft_length == AUTO:
            from .width import DraftPolicy

            draft_policy = draft_policy or DraftPolicy.for_model(
                model, lambda widths, batch: step_curve(model, widths, batch, mask_id=mask_id, pad_id=pad_id))
            draft_length = max(draft_policy.widths)
        else:
            draft_policy = None
        if reserve is None:  # built without a plan (no context check): room for drafts of its widest,
            # the model's block size for draft "auto" (a wider draft, when chosen, grows the cache)
            reserve = reserved_positions(draft_length if draft_policy is None
                                         else min(draft_length, model.config.block_size))
        super().__init__(model, width=draft_length, reserve=reserve, pad_id=pad_id,
                         draft_policy=draft_policy, expert_budget=expert_budget, expert_rank=expert_rank)
        self.mask_id = mask_id
        # the adaptive draft: after a rejection the draft past the rejected token drafts on, and a
        # draft's first token is emitted when drafted (else the fixed draft, as the llama.cpp port's)
        self.adaptive = adaptive
        self.cut = cut  # cut each draft before its first token below this denoise probability (None: never)
        # draft "auto": leave out the denoise block of a forward whose drafts in flight are all likely
        # rejected (`_skip_block`); `skipped` counts those forwards
        self.skip_below = SKIP_BLOCK_BELOW if self.draft_policy is not None else 0.0
        self.skipped = 0
        self.block_width = draft_length  # this forward's denoise block (1: none, the AR step)

    def _skip_block(self) -> bool:
        """Draft "auto", eagerly: whether this forward leaves out its denoise block. The block drafts
        the tokens after a row's whole draft, so it is used only where the draft in flight is kept
        whole; a rejection drafts on from the rejected draft's leftover (and AR's token) either way.
        Left out where every row's draft in flight is likely rejected (`kept_whole` below
        `skip_below`): the forward costs a commit of the drafts alone, and a row that keeps its draft
        whole after all drafts its next block one forward later."""
        if not self.skip_below or self.model.has_graph("verify", self.width):  # its graph has the block
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
        self._choose_width(from_ar=self.forwards > 0 and self.width == 1)
        if self.width <= 1:  # AR's step: nothing to fit
            return
        # a row near the end of the context drafts only what fits behind it: the context reserves the
        # model's block size for a draft (`Speculative.reserve`), a wider choice narrows there
        room = self.model.config.max_position_embeddings - max(
            n + len(r.state.draft if r.state.draft is not None else r.state.pending)
            for n, r in zip(self.cache.lengths.tolist(), self.rows))
        if self.width > room:
            self.width = max((w for w in self.draft_policy.widths if w <= room), default=1)

    def early(self, r: RowState) -> bool:
        """Whether the row's drafts have their first token emitted when drafted (the adaptive draft;
        not under a grammar, whose verify consumes it)."""
        return self.adaptive and not r.state.sampler.constrained

    def _propose(self, rows: list[RowState]) -> dict:
        """The denoise block this forward carries: `width` masks (none for a draft of one: the
        forward is AR's step), left out where the drafts in flight are likely rejected."""
        if self.draft_policy is not None:
            self._choose_draft()
        D = self.width
        if D > 1 and self._skip_block():
            D = 1  # this forward verifies the drafts in flight and drafts nothing
            self.skipped += 1
        self.block_width = D
        width = D
        if D == 1 and self.model.has_graph("verify", self.model.config.block_size) and any(
                r.state.draft is not None and len(r.state.draft) > 1 for r in rows):
            # compiled: a verify has a graph with the block (draft auto narrowing to AR), its block unused
            width = self.model.config.block_size
        block = torch.full((len(rows), width), self.mask_id, dtype=torch.long, device=self.device) if width > 1 else None
        return {"denoise_ids": block}

    def _follow(self, i: int, r: RowState, out, *, keep: int, whole: bool, verified: list[int] | None, m: int
                ) -> None:
        """The next draft: t and, where the verified draft was kept whole, this forward's denoise
        block after it; after a rejection (the block followed rejected tokens) t alone, the next
        forward committing it while it denoises the block after it — and, drafting adaptively, the
        rejected draft's tokens past the rejected one ride along: they were denoised from masks,
        never from the rejected token, so they draft the positions after t as well as before
        (sampled: each still distributed as its q, drawn independently of the rejection)."""
        D, st = self.block_width, r.state
        old_q, old_sure = st.draft_q, st.draft_sure
        st.draft = self._draft(r, out.denoise_logits[i, : D - 1] if whole and D > 1 else None)
        if self.adaptive and not whole and not st.sampler.constrained and m + 1 < len(verified):
            st.draft += verified[m + 1 :]
            if not r.params.greedy:
                st.draft_q = old_q[m:]
            elif st.draft_sure is not None and old_sure is not None:
                st.draft_sure = old_sure[m:]

    def _draft(self, r: RowState, denoise_logits: torch.Tensor | None) -> list[int]:
        """The row's next draft: its t (`state.draft[0]`, the verify's) and the tokens after it from
        the denoise logits (`denoise_logits[j-1]` predicts draft token j; None: a draft of one) as
        the row's sampler drafts them (`Sampler.draft`: under its grammar after t), cut before the
        first the denoise pass gave less than `self.cut`: by each distribution's top probability (a
        cut that read the drawn tokens' would bias what the rejection rule emits,
        tests/test_speculative.py)."""
        st = r.state
        first, s = st.draft[:1], st.sampler
        st.draft_q, st.draft_sure = None, ([] if self.skip_below and r.params.greedy else None)
        if denoise_logits is None:
            return first
        late = not self.early(r)
        if late:
            s.consume(first)  # t precedes the drafts (consumed for good by its verify)
        rest, q, sure = s.draft(denoise_logits, sure=bool(self.cut or self.skip_below))
        if late:
            s.rollback(len(first))
        if sure is not None and self.cut:
            k = sure_prefix(sure[None], self.cut)[0]
            rest, q = rest[:k], (q[:k] if q is not None else None)
        st.draft_q = q if rest else None
        if sure is not None and self.skip_below and r.params.greedy:
            st.draft_sure = sure[: len(rest)].tolist()
        return first + rest


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
    from .width import compiled_kind, load_curve, memo, save_curve

    known = memo(_STEP_COSTS, model)
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
    """`step_curve`'s timing (`width.time_steps`): per width the median of `repeat` rounds in each of
    `STEP_PASSES` passes, the cheapest pass kept, then no width dearer than a wider one. A measurement
    is kept in the user cache for good, so a burst of another process's load must not stay in it: on
    the shared 2-core box one pass read a batch-1 step drafting 8 at 3.7 AR steps (drafting 16: 3.4)
    where decoding pays ~2.2, and draft auto never drafted at batch 1."""
    from .width import STEP_KIND, CostCurve, time_steps

    seconds = time_steps(
        lambda w: SpeculativeEngine(model, draft_length=w, mask_id=mask_id, pad_id=pad_id, adaptive=True),
        widths, batch, vocab_size=model.config.vocab_size, repeat=repeat, passes=STEP_PASSES,
        budget=lambda w: (STEP_PASSES * repeat + 2) * (w + 1) + 1)
    curve = CostCurve()
    for w, sec in seconds.items():
        curve.add(STEP_KIND, batch, w, sec)
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
    engine = SpeculativeEngine

    auto_width = True  # block_size="auto": the draft length adapts to acceptance
    auto_default = True  # ... and is the default: it beat the fixed draft in every measured case (docs/experiments.md)

    def check(self, params) -> None:
        if (params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
                or params.no_repeat_ngram_size):
            raise ValueError("repetition_penalty: history-dependent penalties are not supported in speculative mode")
        if params.block_size == AUTO:
            if params.draft_length is not None:
                raise ValueError("draft_length: block_size \"auto\" chooses the draft length; give one or the other")
            return
        if (params.draft_length or params.block_size) > params.block_size:
            raise ValueError(f"draft_length: must be <= block_size ({params.block_size}), got {params.draft_length}")

    def spec(self, params, provisional=False) -> EngineSpec:
        # block_size "auto": the adaptive draft; else the fixed draft of draft_length or the block size
        auto = params.block_size == AUTO
        return EngineSpec(self, None if auto else params.draft_length or params.block_size, params.expert_budget,
                          params.expert_rank, draft_cut=DRAFT_CUT if auto else None, auto=auto)

    def reserve(self, spec, config=None, drafter=None) -> int:
        """The fixed draft's `reserved_positions`. Draft "auto": the model's block size; a wider draft
        chosen near the end of the context narrows to what fits (`SpeculativeEngine._choose_draft`),
        one chosen elsewhere grows the cache (doubling: rarely) -- room for its widest draft (64)
        doubled a row's cache and what every row joining or leaving the batch copies
        (docs/experiments.md, 2026-12-03: batch 16)."""
        from .width import AUTO_MAX_WIDTH

        if not spec.auto:
            return reserved_positions(spec.width)
        return AUTO_MAX_WIDTH if config is None else min(AUTO_MAX_WIDTH, config.block_size)

    def build_engine(self, model, spec, *, mask_id, pad_id, drafter=None):
        return SpeculativeEngine(model, draft_length=spec.engine_width, mask_id=mask_id, pad_id=pad_id,
                                 expert_budget=spec.expert_budget, expert_rank=spec.expert_rank, cut=spec.draft_cut,
                                 adaptive=spec.auto, reserve=spec.reserve)


register(Speculative())
