"""AR decoding accelerated by a DFlash block drafter (arXiv 2602.06036): the comparator of
Clover-35B-A3B's published speed figure, here on the same target weights. A drafter of the one verify
engine (`verify.VerifyEngine`, which holds the verify, the rejection rule and the rollback).

Per row, an iteration is one drafter forward and one target forward:
- *draft*: the drafter (`clover.models.dflash`) takes the target's hidden states of the tokens
  committed since its last draft (the context; its cache keeps the rest) and the block
  `[anchor, mask x D]` -- the anchor being the last token the target produced, not yet in the
  target's cache -- and proposes D tokens at once (greedy: the argmax; sampling: drawn from the
  drafter's distribution q, processed like the target's);
- *verify*: the target commits `[anchor, d_1..d_D]` in one causal forward, which also yields the
  hidden states of the chosen layers (`Step.hidden_layers`, the next draft's context). Greedy:
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

import dataclasses
import weakref
from dataclasses import dataclass

import torch

from .base import DecodeEvent, RowState, grad_free_call, row_history
from .modes import EngineSpec, Mode, register
from .sampling import AUTO
from .verify import VerifyEngine, VerifyRow, sure_prefix

DEFAULT_DRAFT = 15  # the published drafters' block of 16: the anchor + 15 drafts
# the default draft ends before its first token the drafter gives less than this probability (the
# verify then runs at the narrowest of the drafter's `verify_widths` that holds the rest): the best
# threshold on the bundled model, on training-split prompts as on held-out ones (docs/experiments.md)
DRAFT_CUT = 0.2
AUTO_BLOCKS = (2, 4, 8, 16)  # draft "auto": the blocks (anchor + drafts) it picks among, up to the drafter's


def drafter_block(drafter=None) -> int:
    """The tokens a verify commits with the drafter's whole block (its anchor and drafts; `DEFAULT_DRAFT`
    drafts before a drafter is known)."""
    return drafter.block_size if drafter is not None else DEFAULT_DRAFT + 1


@dataclass(eq=False)
class DFlashRow(VerifyRow):
    ctx: torch.Tensor | None = None  # [n, F] context features not yet in the drafter's cache


class DFlashEngine(VerifyEngine):
    """The verify engine drafting with a DFlash drafter: one drafter forward before each verify."""

    row_type = DFlashRow

    def __init__(self, model, drafter, *, draft_length: int | str, pad_id: int = 0, draft_policy=None,
                 cut: float | None = None, reserve: int | None = None) -> None:
        if draft_length == AUTO:
            from .width import DraftPolicy

            blocks = sorted({b for b in AUTO_BLOCKS if b <= drafter.block_size} | {drafter.block_size})
            draft_policy = draft_policy or DraftPolicy(blocks, iteration_curve(model, drafter, blocks))
            draft_length = max(draft_policy.widths) - 1
        else:
            draft_policy = None
        # the plan's reserve (the widest verify: the anchor and its drafts, one to spare behind the last
        # committed token); an engine built without a plan reserves that for its own drafts
        super().__init__(model, width=draft_length + 1, reserve=draft_length + 1 if reserve is None else reserve,
                         pad_id=pad_id, draft_policy=draft_policy)
        self.drafter = drafter
        self.cut = cut  # cut each draft before its first token below this drafter probability (None: never)
        self.draft_cache = None
        self.layer_ids = drafter.target_layer_ids

    @property
    def draft_length(self) -> int:
        """Drafts per verify (after t): the width less one."""
        return self.width - 1

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

    # -- the drafter strategy
    def _propose(self, rows: list[RowState]) -> dict:
        """The drafter's forward (where any row has its t), its drafts appended to each row's t; the
        verify forward returns every logit and the drafter's context (the chosen layers' states)."""
        if any(r.state.draft is not None for r in rows):
            if self.draft_policy is not None:
                self._choose_width()
            drafts, q = self._draft(rows)
            for r, d, qd in zip(rows, drafts, q):
                if d is not None:
                    r.state.draft = r.state.draft + d
                    r.state.draft_q = qd
        return {"all_logits": True, "hidden_layers": tuple(self.layer_ids)}

    def _forward(self, commit_ids, n_commit, **kw):
        out = super()._forward(commit_ids, n_commit, **kw)
        self._feats = self.drafter.context_features(out.hidden, self.model)  # [B, Tc, F]
        return out

    def _follow(self, i: int, r: RowState, out, *, keep: int, whole: bool, verified: list[int] | None, m: int
                ) -> None:
        r.state.ctx = self._feats[i, :keep]  # the states of the tokens this forward put in the cache

    def _draft(self, rows: list[RowState]) -> tuple[list[list[int] | None], list[torch.Tensor | None]]:
        """One drafter forward: per row the drafts after its t (None for a row whose prefill is
        pending) and, sampling, the distributions they were drawn from."""
        D, dr, dev = self.draft_length, self.drafter, self.device
        ctx = [r.state.ctx if r.state.draft is not None else None for r in rows]
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
        block[:, 0] = torch.tensor([dr.mask_token_id if r.state.draft is None else r.state.draft[0] for r in rows],
                                   dtype=torch.long, device=dev)  # one copy to the device, not one write per row
        h = dr.draft(self.draft_cache, feats, n_ctx, dr.embed(block, self.model))
        logits = dr.logits(h[:, 1:], self.model)  # [B, D, V]: block position j predicts its own token
        picked = dr.select(h[:, 1:], logits, block[:, 0])  # DFlash2: the selector's greedy path (or None)
        drafts: list[list[int] | None] = []
        q: list[torch.Tensor | None] = []
        sure: list = []  # (row, the drafter's probability of each draft token) where drafts may be cut
        for i, r in enumerate(rows):
            r.state.ctx = None
            if r.state.draft is None:
                drafts.append(None)
                q.append(None)
                continue
            r.draft_forwards += 1
            # the row's sampler drafts (under its grammar: each token masked after those before it);
            # the cut reads each distribution's top probability, not the drawn token's: a cut that read
            # the draws would bias what the rejection rule emits
            s = r.state.sampler
            if picked is not None and s.grammar is None and s.params.greedy:  # z-lab's greedy draft
                d, qd = picked[i].tolist(), None
                top = s.process(logits[i]).softmax(-1).amax(-1) if self.cut is not None else None
            else:  # sampled or under a grammar: the sampler's
                d, qd, top = s.draft(logits[i], row_history(r, None, logits.shape[1]), sure=self.cut is not None)
            drafts.append(d)
            q.append(qd)
            if top is not None:
                sure.append((i, top))
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



# model -> drafter -> (eager/compiled, blocks) -> CostCurve, measured once per process; weak keys, so
# that a model or drafter collected (its id reused) takes its curves with it
_ITERATION_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@grad_free_call
def iteration_curve(model, drafter, blocks, *, repeat: int = 3) -> "CostCurve":
    """What one dflash iteration (draft, verify, rollback, bookkeeping) costs at each block (t +
    drafts) in `blocks` (`width.time_steps`: an engine of that fixed draft length decoding a random
    prompt at batch 1, the median of `repeat` iterations after two untimed ones, where a compiled
    model compiles). Kept in the `"verify"` kind of a `width.CostCurve` for `DraftPolicy`; measured
    once per process."""
    from .width import CostCurve, compiled_kind, memo, time_steps

    known = memo(_ITERATION_COSTS, model, drafter)
    key = (compiled_kind(model), tuple(blocks))
    if key in known:
        return known[key]
    seconds = time_steps(lambda b: DFlashEngine(model, drafter, draft_length=b - 1), blocks, 1,
                         vocab_size=model.config.vocab_size, repeat=repeat, budget=lambda b: (repeat + 2) * b + 1)
    curve = CostCurve()
    for b, sec in seconds.items():
        curve.add("verify", 1, b, sec)
    known[key] = curve
    return curve


class DFlash(Mode):
    name = "dflash"
    needs_drafter = True  # the engine needs a DFlash drafter next to the target (`clover.load(..., drafter=)`)
    reference = "ar"
    engine = DFlashEngine
    summary = "AR with a DFlash block drafter: drafts a block in one drafter forward, verifies it causally (lossless)"
    auto_width = True  # block_size="auto": the draft length adapts to acceptance

    def check(self, params) -> None:
        if params.block_size == AUTO and params.draft_length is not None:
            raise ValueError("draft_length: block_size \"auto\" chooses the draft length; give one or the other")

    def spec(self, params, provisional: bool = False) -> EngineSpec:
        # a draft length asked for is kept; "auto": adapted to acceptance; neither: the drafter's whole
        # block, cut by its confidence (`resolve`)
        return EngineSpec(self, width=params.draft_length + 1 if params.draft_length else None,
                          auto=params.block_size == AUTO and not params.draft_length)

    def resolve(self, spec, config=None, drafter=None) -> EngineSpec:
        """The width the drafter decides (its whole block, cut by its confidence, where no draft length
        was asked for), checked against it; the reserve is the widest verify."""
        if spec.reserve is not None:
            return spec
        if drafter is not None and spec.width is not None and spec.width > drafter.block_size:
            raise ValueError(f"draft_length: must lie in [1, {drafter.block_size - 1}] for this drafter "
                             f"(block_size {drafter.block_size}), got {spec.width - 1}")
        width = spec.width
        if width is None and not spec.auto:
            width = drafter_block(drafter)
            spec = dataclasses.replace(spec, width=width, draft_cut=DRAFT_CUT)
        return dataclasses.replace(spec, reserve=width or drafter_block(drafter))

    def build_engine(self, model, spec, *, mask_id, pad_id, drafter=None):
        if drafter is None:
            raise ValueError("mode: 'dflash' needs a DFlash drafter; load one with clover.load(model, drafter=DIR) "
                             "(CLI and server: --drafter DIR)")
        return DFlashEngine(model, drafter, draft_length=AUTO if spec.auto else spec.width - 1, pad_id=pad_id,
                            cut=spec.draft_cut, reserve=spec.reserve)


register(DFlash())
