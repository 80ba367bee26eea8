"""AR decoding accelerated by a DFlash block drafter (arXiv 2602.06036): the comparator of
Clover-35B-A3B's published speed figure, here on the same target weights.

Per row, an iteration is one drafter forward and one target forward:
- *draft*: the drafter (`clover.models.dflash`) takes the target's hidden states of the tokens
  committed since its last draft (the context; its cache keeps the rest) and the block
  `[anchor, mask x D]` -- the anchor being the last token the target produced, not yet in the
  target's cache -- and proposes D tokens at once (greedy: the argmax; sampling: drawn from the
  drafter's distribution q, processed like the target's);
- *verify*: the target commits `[anchor, d_1..d_D]` in one causal forward, which also yields the
  hidden states of the chosen layers (`step(hidden_out=...)`, the next draft's context). Greedy:
  the longest prefix of drafts that equals the target's argmax is kept, plus the target's token at
  the first mismatch (or after the last draft) as the next anchor. Sampling: the standard
  speculative rejection rule (accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first
  rejection draw from norm(max(p_j - q_j, 0)); after a full accept draw from p_{D+1}), so the output
  follows the target's distribution exactly.
- the target's cache is rolled back to the anchor plus the accepted drafts with the cache's
  snapshot/rollback (K/V truncated, GDN state and conv window re-derived from the recorded inputs),
  as in self-speculative decoding.
The prompt's prefill yields the first anchor (sampled from the target as in AR) and the first
context. Every token is the target's, so greedy output equals AR greedy token for token; penalties
see the same history as in AR (the verify logits at position j follow the committed tokens and
d_1..d_j). `forwards` counts the target's forwards; `draft_forwards` the drafter's.
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass

import torch

from .base import BatchEngine, DecodeEvent, EngineRow, RowState, grad_free_call, next_tokens, pad_right, row_history
from .modes import EngineSpec, Mode, register
from .sampling import AUTO, SamplingParams, greedy_tokens
from .speculative import (accept_draft, agreed, choose_draft, commit_verified, constrained_draft,
                          constrained_sampled_draft, sampling_probs, settle_cache, sure_prefix)

DEFAULT_DRAFT = 15  # the published drafters' block of 16: the anchor + 15 drafts
# the default draft ends before its first token the drafter gives less than this probability (the
# verify then runs at the narrowest of the drafter's `verify_widths` that holds the rest): the best
# threshold on the bundled model, on training-split prompts as on held-out ones (docs/experiments.md)
DRAFT_CUT = 0.2
AUTO_BLOCKS = (2, 4, 8, 16)  # draft "auto": the blocks (anchor + drafts) it picks among, up to the drafter's


def max_draft(draft_length: int | None, drafter=None) -> int:
    """The most drafts per verify of rows asking for `draft_length` (None or "auto": the drafter's
    block - 1, or `DEFAULT_DRAFT` before a drafter is known)."""
    if isinstance(draft_length, int):
        return draft_length
    return drafter.block_size - 1 if drafter is not None else DEFAULT_DRAFT


def reserved_positions(draft_length: int) -> int:
    """Positions a row needs beyond prompt + max_new_tokens with up to `draft_length` drafts: its
    last verify writes the anchor and the drafts after its last committed token (one to spare)."""
    return draft_length + 1


@dataclass(eq=False)
class DFlashRow(EngineRow):
    anchor: int | None = None  # the target's last token, not yet in its cache (None: prefill pending)
    ctx: torch.Tensor | None = None  # [n, F] context features not yet in the drafter's cache
    kept_draft: int = 0  # drafts kept so far (draft "auto": the acceptance rate)
    rejected_draft: int = 0  # verifies that rejected a draft


class DFlashEngine(BatchEngine):
    row_type = DFlashRow

    def __init__(self, model, drafter, *, draft_length: int | str, pad_id: int = 0, draft_policy=None,
                 cut: float | None = None) -> None:
        super().__init__(model, pad_id=pad_id)
        self.drafter = drafter
        self.cut = cut  # cut each draft before its first token below this drafter probability (None: never)
        self.draft_policy = None
        if draft_length == AUTO:
            from .width import DraftPolicy

            blocks = sorted({b for b in AUTO_BLOCKS if b <= drafter.block_size} | {drafter.block_size})
            self.draft_policy = draft_policy or DraftPolicy(blocks, iteration_curve(model, drafter, blocks))
            draft_length = max(self.draft_policy.widths) - 1
        elif not 1 <= draft_length <= drafter.block_size - 1:
            raise ValueError(f"draft_length: must lie in [1, {drafter.block_size - 1}] for this drafter "
                             f"(block_size {drafter.block_size}), got {draft_length}")
        self.draft_length = self.max_draft = draft_length
        self.draft_cache = None
        self.layer_ids = drafter.target_layer_ids
        self.choices: list = []  # draft "auto": each WidthChoice (block = anchor + drafts, why), in order
        self.forwards = 0

    def _capacity(self, row: RowState) -> int:
        return len(row.prompt) + row.params.max_new_tokens + reserved_positions(self.max_draft)

    @grad_free_call  # as the target's cache (`BatchEngine.add`): a compiled draft is specialised on it
    def add(self, row: RowState) -> list[DecodeEvent]:
        n = len(self.rows)
        events = super().add(row)
        if len(self.rows) > n:  # admitted: a drafter cache row beside the target's
            fresh = self.drafter.make_cache(1, self.cache.capacity)
            self.draft_cache = fresh if self.draft_cache is None else self.draft_cache.concat([self.draft_cache, fresh])
        return events

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.rows) if not r.finished]
        if len(keep) < len(self.rows):
            self.draft_cache = self.draft_cache.select_rows(keep) if keep else None
        super()._drop_finished()

    # -- the draft
    _probs = staticmethod(sampling_probs)  # the distribution a row samples from (AR's)

    def _draft(self, rows: list[RowState]) -> tuple[list[list[int] | None], list[torch.Tensor | None]]:
        D, dr, dev = self.draft_length, self.drafter, self.device
        ctx = [r.state.ctx if r.state.anchor is not None else None for r in rows]
        Tc = max((c.shape[0] for c in ctx if c is not None), default=0)
        if dr.static_draft is not None and Tc <= D + 1:
            Tc = D + 1  # the compiled draft's shape: the context padded to the block
        F = len(self.layer_ids) * self.model.config.hidden_size
        feats = torch.zeros(len(rows), Tc, F, dtype=dr.dtype, device=dev)
        for i, c in enumerate(ctx):
            if c is not None:
                feats[i, : c.shape[0]] = c
        n_ctx = torch.tensor([0 if c is None else c.shape[0] for c in ctx], dtype=torch.long, device=dev)
        block = torch.full((len(rows), D + 1), dr.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = torch.tensor([dr.mask_token_id if r.state.anchor is None else r.state.anchor for r in rows],
                                   dtype=torch.long, device=dev)  # one copy to the device, not one write per row
        h = dr.draft(self.draft_cache, feats, n_ctx, dr.embed(block, self.model))
        logits = dr.logits(h[:, 1:], self.model)  # [B, D, V]: block position j predicts its own token
        drafts: list[list[int] | None] = []
        q: list[torch.Tensor | None] = []
        sure: list = []  # (row, the drafter's probability of each draft token) where drafts may be cut
        for i, r in enumerate(rows):
            r.state.ctx = None
            if r.state.anchor is None:
                drafts.append(None)
                q.append(None)
                continue
            r.draft_forwards += 1
            if r.constraint is not None:  # each draft token masked by the grammar after those before it
                if r.params.greedy:
                    drafts.append(constrained_draft(r, logits[i]))
                    q.append(None)
                else:
                    d, qd = constrained_sampled_draft(r, logits[i])
                    drafts.append(d)
                    q.append(qd)
            elif r.params.greedy:
                processed = r.state.sampler.process(logits[i], None)
                drafts.append(processed.argmax(-1).tolist())
                q.append(None)
                if self.cut is not None:
                    sure.append((i, processed.softmax(-1).amax(-1)))
            else:
                probs = self._probs(r, logits[i])
                drafts.append(torch.multinomial(probs, 1, generator=r.state.sampler.generator).squeeze(-1).tolist())
                q.append(probs)
                if self.cut is not None:  # the top probability, not the drawn token's: a cut that read the
                    sure.append((i, probs.amax(-1)))  # draws would bias what the rejection rule emits
        if sure:
            self._cut(drafts, q, sure)
        return drafts, q

    def _cut(self, drafts: list, q: list, sure: list) -> None:
        """Cut the rows' drafts before the first token the drafter gave less than `self.cut` (`sure`:
        (row, the drafter's probability of each draft token)), to the narrowest verify width that
        holds every row's kept part (all rows verify as many drafts: one graph serves the batch).
        The choice reads the drafter alone, so the verify stays lossless."""
        probs = torch.stack([p for _, p in sure])  # [rows, D]
        D = probs.shape[1]
        keep = max(sure_prefix(probs, self.cut))  # drafts the surest row keeps
        width = next((w for w in self.drafter.verify_widths if w - 1 >= keep), D + 1)
        for i, d in enumerate(drafts):
            if d is not None and len(d) > width - 1:
                drafts[i] = d[: width - 1]
                if q[i] is not None:
                    q[i] = q[i][: width - 1]

    # -- the verify
    def _verify(self, r: RowState, logits: torch.Tensor, draft: list[int], q: torch.Tensor | None) -> list[int]:
        """logits [D+1, V] (after anchor, d_1, ..., d_D) -> the new tokens: accepted drafts + one."""
        D = len(draft)
        tails = [draft[:j] for j in range(D + 1)]
        if r.constraint is not None:
            new = self._verify_constrained(r, logits, draft, q, tails)
        elif r.params.greedy:  # AR's token choice (`propose`), without its confidences
            target = greedy_tokens(r.state.sampler.process(logits, row_history(r, tails, D + 1))).tolist()
            m = agreed(draft, target)
            new = draft[:m] + [target[m]]
        else:
            p = self._probs(r, logits, tails)  # [D+1, V]
            gen = r.state.sampler.generator
            m, token = accept_draft([r.state.anchor] + draft, q, p[:D], gen)  # the anchor is the target's own
            if token is None:  # every draft kept: the next token from the target after the last one
                token = int(torch.multinomial(p[D], 1, generator=gen))
            new = draft[: m - 1] + [token]
        r.state.kept_draft += max(len(new) - 1, 0)
        r.state.rejected_draft += len(new) - 1 < D
        return new

    def _verify_constrained(self, r: RowState, logits: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                            tails: list) -> list[int]:
        """The verify of a constrained row: position j's logits masked by the grammar after the
        anchor and d_1..d_j, so that greedy keeps exactly the tokens constrained AR chooses and
        sampling (the rejection rule over the masked distributions) draws as constrained AR does.
        The grammar consumes the new tokens; where it completes, the row ends (no further token)."""
        c, D = r.constraint, len(draft)
        if r.params.greedy:
            processed = r.state.sampler.process(logits, row_history(r, tails, D + 1))
            new = []
            for j in range(D + 1):
                if c.stopped:
                    break
                tok = c.argmax(processed[j])
                c.consume([tok])
                new.append(tok)
                if j == D or tok != draft[j]:
                    break
            return new
        ps = []  # p_j: AR's distribution after the anchor and d_1..d_j, masked by the grammar there
        for j in range(D + 1):
            if c.stopped:
                break
            ps.append(self._probs(r, c.mask(logits[j : j + 1]), tails[j : j + 1])[0])
            if j < D:
                c.consume(draft[j : j + 1])
        c.rollback(min(len(ps), D))
        gen = r.state.sampler.generator
        m, token = accept_draft([r.state.anchor] + draft, q, torch.stack(ps[:D]) if D else None, gen)
        if token is None and len(ps) > D:  # every draft kept: the next token after the last one
            token = int(torch.multinomial(ps[D], 1, generator=gen))
        new = draft[: m - 1] + ([token] if token is not None else [])
        c.consume(new)
        return new

    @grad_free_call
    def step(self) -> list[DecodeEvent]:
        rows = self.rows
        drafting = any(r.state.anchor is not None for r in rows)
        if drafting and self.draft_policy is not None:
            self.draft_length = choose_draft(self.draft_policy, rows, self.choices, self.forwards) - 1
        self.forwards += 1
        drafts, q = self._draft(rows) if drafting else ([None] * len(rows),) * 2
        src = [r.state.pending if d is None else [r.state.anchor] + d for r, d in zip(rows, drafts)]
        ids, n = pad_right(src, self.pad_id, self.device)
        snap = self.cache.start_recording() if drafting else None  # a prefill alone is never rolled back
        hidden = dict.fromkeys(self.layer_ids)
        out = self.model.step(self.cache, commit_ids=ids, n_commit=n, all_logits=True, track_experts=True,
                              hidden_out=hidden)
        feats = self.drafter.context_features(hidden, self.model)  # [B, Tc, F]
        keep = [0] * len(rows)
        events: list[DecodeEvent] = []
        for i, r in enumerate(rows):
            r.forwards += 1
            r.experts_touched.extend(out.experts_touched)
            if drafts[i] is None:  # the prefill: the first anchor, as AR samples it
                m = len(r.state.pending)
                new = next_tokens(r, out.commit_logits[i, m - 1 : m])
                r.state.pending = []
                kept = r.accept(new, [1])
                r.grammar_done()
                if kept:
                    events.append(DecodeEvent("commit", i, kept, [1], row_state=r))
            else:
                new = self._verify(r, out.commit_logits[i, : len(drafts[i]) + 1], drafts[i], q[i])
                m = len(new)  # the anchor and the accepted drafts enter the cache
                commit_verified(r, i, new, events)
            keep[i] = m
            if r.finished:
                events.append(DecodeEvent("finish", i, [], [], row_state=r))
                continue
            r.state.anchor = new[-1]
            r.state.ctx = feats[i, :m]
        if snap is not None:
            settle_cache(self.cache, snap, keep, [len(s) for s in src])
        self._drop_finished()
        return events


# model -> drafter -> (eager/compiled, blocks) -> CostCurve, measured once per process; weak keys, so
# that a model or drafter collected (its id reused) takes its curves with it
_ITERATION_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@grad_free_call
def iteration_curve(model, drafter, blocks, *, repeat: int = 3) -> "CostCurve":
    """What one dflash iteration (draft, verify, rollback, bookkeeping) costs at each block (anchor
    + drafts) in `blocks`: an engine of that fixed draft length decoding a random prompt at batch 1,
    the median of `repeat` iterations after one untimed one (where a compiled model compiles).
    Kept in the `"verify"` kind of a `width.CostCurve` for `DraftPolicy`; measured once per
    process."""
    from .width import CostCurve, compiled_kind

    known = _ITERATION_COSTS.setdefault(model, weakref.WeakKeyDictionary()).setdefault(drafter, {})
    key = (compiled_kind(model), tuple(blocks))
    if key in known:
        return known[key]
    curve = CostCurve()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (32,), generator=gen).tolist()
    for b in blocks:
        engine = DFlashEngine(model, drafter, draft_length=b - 1)
        engine.add(RowState(prompt, SamplingParams(max_new_tokens=(repeat + 2) * b + 1, ignore_eos=True), set()))
        engine.step()  # the prefill
        engine.step()
        seconds = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - t0)
        curve.add("verify", 1, b, statistics.median(seconds))
    known[key] = curve
    return curve


class DFlash(Mode):
    name = "dflash"
    needs_drafter = True  # the engine needs a DFlash drafter next to the target (`clover.load(..., drafter=)`)
    reference = "ar"
    summary = "AR with a DFlash block drafter: drafts a block in one drafter forward, verifies it causally (lossless)"
    auto_width = True  # block_size="auto": the draft length adapts to acceptance

    def check(self, params) -> None:
        if params.block_size == AUTO and params.draft_length is not None:
            raise ValueError("draft_length: block_size \"auto\" chooses the draft length; give one or the other")

    def extra_positions(self, params, drafter=None, config=None) -> int:
        """As the engine reserves for the drafter it decodes with (`drafter`; the LLM passes its own)."""
        return reserved_positions(max_draft(params.draft_length, drafter))

    def spec(self, params, provisional: bool = False) -> EngineSpec:
        # None: the drafter's block - 1, cut by its confidence; "auto": adapted to acceptance
        return EngineSpec(self, width=params.draft_length or (AUTO if params.block_size == AUTO else None))

    def make_engine(self, model, spec, *, mask_id, pad_id, drafter=None):
        if drafter is None:
            raise ValueError("mode: 'dflash' needs a DFlash drafter; load one with clover.load(model, drafter=DIR) "
                             "(CLI and server: --drafter DIR)")
        # the default draft length is cut by the drafter's confidence; a length asked for is kept
        return DFlashEngine(model, drafter, draft_length=spec.width or max_draft(None, drafter), pad_id=pad_id,
                            cut=DRAFT_CUT if spec.width is None else None)


register(DFlash())
