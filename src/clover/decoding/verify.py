"""Lossless speculative decoding, whatever drafts: the one verify engine.

Each iteration of a row commits `[t, d_1 .. d_k]` in one causal (commit) forward: `t` the target's own
next token (AR's, always kept) and `d_1 .. d_k` a drafter's guesses of the tokens after it. The causal
logits at position j follow t, d_1 .. d_j and verify d_{j+1} (`VerifyEngine._verify`):
- greedy: the longest prefix of drafts equal to the target's choice there is kept, and the target's
  token at the first mismatch (or after the last draft) is the next `t`: the output is AR greedy's;
- sampling: the speculative rejection rule (Leviathan et al. 2023; Chen et al. 2023; `accept_draft`):
  d_j, drawn from the drafter's distribution q_j, is kept with probability min(1, p_j(d_j) / q_j(d_j)),
  p_j being AR's sampling distribution there; at the first rejection the next `t` is drawn from
  norm(max(0, p_j - q_j)), after a full accept from p; each token is distributed as AR sampling draws it;
- under a grammar every p_j (and each greedy choice) is masked by the grammar after the tokens before
  it, so the kept tokens are those constrained AR chooses (or draws).
The cache then rolls back to the kept tokens (`settle_cache`: K/V truncated, GDN state re-derived from
the recorded inputs of exactly those tokens). The prompt's prefill yields the first `t`.

A row's `t` is emitted when it is drawn (`early`: a row it ends needs no further forward) or with the
drafts its verify keeps (the fixed self-speculative draft, as the llama.cpp port does it).

What drafts is the subclass's (the drafter strategy): `_propose` runs before the forward (a separate
drafter's forward; or the parts the forward carries for drafting, a denoise block) and `_follow` after
each row's verify (the next draft from that forward). `speculative.SpeculativeEngine` drafts from the
target's own denoise block, `dflash.DFlashEngine` with a DFlash drafter. `draft_length="auto"` chooses
the width (t + drafts) per forward (`width.DraftPolicy`) from each row's acceptance so far and what a
step of each width costs (`width.time_steps`, the one harness that times any engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BatchEngine, DecodeEvent, EngineRow, RowState, grad_free_call, pad_right, row_history
from .sampling import filter_logits, greedy_tokens


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
    """The outcome of a verify for row `r` (batch index `i`): `tokens` recorded as one accept length
    and appended by `RowState.accept` (EOS, stops, limits; a complete grammar ends the row), but for
    the first `emitted` of them, appended when they were drawn; a commit event for what was kept.
    Returns it."""
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
class VerifyRow(EngineRow):
    draft: list[int] | None = None  # [t, d_1 .. d_k] for the next forward to commit and verify (None: prefill)
    draft_q: torch.Tensor | None = None  # sampling: [k, V] the distributions d_1 .. were drawn from
    kept_draft: int = 0  # drafts kept so far (draft "auto": the acceptance rate)
    rejected_draft: int = 0  # verifies that rejected a draft


class VerifyEngine(BatchEngine):
    """Draft, verify causally, keep the agreed prefix, roll back; the drafting is the subclass's
    (`_propose`, `_follow`). `width`: tokens a verify commits (t + drafts), chosen per forward by
    `draft_policy` when there is one."""

    row_type = VerifyRow

    def __init__(self, model, *, width: int, reserve: int, pad_id: int = 0, draft_policy=None,
                 expert_budget: int | None = None, expert_rank: str = "sum") -> None:
        super().__init__(model, pad_id=pad_id)
        self.width = width
        self.reserve = reserve  # positions a row's cache holds past prompt + max_new_tokens
        self.draft_policy = draft_policy
        self.expert_budget, self.expert_rank = expert_budget, expert_rank
        self.choices: list = []  # draft "auto": each WidthChoice (width, why), in order
        self.forwards = 0

    def _capacity(self, row: RowState) -> int:
        return len(row.prompt) + row.params.max_new_tokens + self.reserve

    def early(self, r: RowState) -> bool:
        """Whether the row's `t` is emitted when drawn (else with its verify's kept drafts)."""
        return True

    # -- the drafter strategy
    def _propose(self, rows: list[RowState]) -> dict:
        """Before the forward (`self.forwards` not yet counted): what drafts now, and the forward's
        extra `model.step` arguments."""
        return {}

    def _follow(self, i: int, r: RowState, out, *, keep: int, whole: bool, verified: list[int] | None, m: int
                ) -> None:
        """After row `r`'s verify (`r.state.draft` = [t]; `draft_q` still the verified draft's): the
        next draft from this forward `out`. `keep`: the row's tokens this forward put in the cache;
        `verified`, `m`: the draft verified (None: a prefill) and how many of it were kept;
        `whole`: all of them."""

    def _choose_width(self, from_ar: bool = False) -> None:
        self.width = choose_draft(self.draft_policy, self.rows, self.choices, self.forwards, from_ar=from_ar)

    # -- the verify
    _probs = staticmethod(sampling_probs)  # the distribution a row samples from (AR's)

    def _verify(self, r: RowState, logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                before: list[int]) -> tuple[int, int | None]:
        """logits [k+1, V], position j after the row's tokens, `before` (tokens committed with the
        drafts, not yet in `r.tokens`) and d_1 .. d_j -> (how many of `drafts` are kept, the
        target's next token: None where the grammar is complete). The grammar consumes the kept
        drafts."""
        k, c, gen = len(drafts), r.constraint, r.state.sampler.generator
        tails = [before + drafts[:j] for j in range(k + 1)]
        if r.params.greedy:
            processed = r.state.sampler.process(logits, row_history(r, tails, k + 1))
            if c is None:  # AR's token choice (`propose`), without its confidences
                target = greedy_tokens(processed).tolist()
                n = agreed(drafts, target)
                return n, target[n]
            n = 0
            while not c.stopped:
                tok = c.argmax(processed[n])
                if n == k or tok != drafts[n]:
                    return n, tok
                c.consume([tok])
                n += 1
            return n, None
        if c is None:
            p = self._probs(r, logits, tails)  # [k+1, V]
        else:  # p_j masked by the grammar after d_1 .. d_j
            ps = []
            for j in range(k + 1):
                if c.stopped:
                    break
                ps.append(self._probs(r, c.mask(logits[j : j + 1]), tails[j : j + 1])[0])
                if j < k:
                    c.consume(drafts[j : j + 1])
            c.rollback(min(len(ps), k))
            if not ps:
                return 0, None
            p = torch.stack(ps)
        m, token = accept_draft([None] + drafts, q, p[:k], gen)  # position 0 is the target's own
        if token is None and p.shape[0] > k:  # every draft kept: the next token after the last one
            token = int(torch.multinomial(p[k], 1, generator=gen))
        if c is not None:
            c.consume(drafts[: m - 1])
        return m - 1, token

    @grad_free_call
    def step(self) -> list[DecodeEvent]:
        rows = self.rows
        extra = self._propose(rows)
        self.forwards += 1
        commit_src = [r.state.draft if r.state.draft is not None else r.state.pending for r in rows]
        has_commit = any(commit_src)
        commit_ids, n_commit = pad_right(commit_src, self.pad_id, self.device) if has_commit else (None, None)
        # a forward whose drafts are each the target's token alone (or prompts) verifies nothing: the
        # logits of the last tokens; with a denoise block it keeps the verify forward's shape
        # (compiled, its graph)
        verifying = any(r.state.draft is not None and len(r.state.draft) > 1 for r in rows) or (
            extra.get("denoise_ids") is not None and any(r.state.draft is not None for r in rows))
        every = extra.pop("all_logits", verifying)
        snap = self.cache.start_recording() if verifying else None
        out = self._forward(commit_ids, n_commit, all_logits=every, **extra)
        causal = out.commit_logits if every else out.commit_logits[:, None]  # [B, Tc or 1, V]
        committed = [len(s) for s in commit_src]
        keep = list(committed)
        events: list[DecodeEvent] = []
        for i, r in enumerate(rows):
            st = r.state
            r.forwards += 1
            r.experts_touched.extend(out.experts_touched)
            early = self.early(r)
            verified, m = st.draft, 0
            if verified is None:  # the prefill: the first t, from the prompt's last logits
                n = len(st.pending)
                _, t = self._verify(r, causal[i, n - 1 if every else 0][None], [], None, [])
                st.pending = []
                whole = True
                if early and t is not None:
                    self._emit(r, i, t, events)
            else:
                D = len(verified)
                if not early and r.constraint is not None:
                    r.constraint.consume(verified[:1])  # t, AR's own token, is kept
                n, t = self._verify(r, causal[i, :D], verified[1:], st.draft_q, [] if early else verified[:1])
                m = keep[i] = 1 + n
                st.kept_draft += n
                st.rejected_draft += m < D
                whole = m == D
                if not early:  # t_prev and the kept drafts (t waits for its own verify)
                    emit = verified[:m]
                else:  # t_prev was emitted when drawn: the kept drafts and t
                    emit = verified[1:m] + ([t] if t is not None else [])
                    if t is not None and r.constraint is not None:
                        r.constraint.consume([t])
                commit_verified(r, i, emit, events)
            st.draft = None
            if t is None:  # the grammar is complete: the row ends here
                r.grammar_done()
            if r.finished:
                events.append(DecodeEvent("finish", i, [], [], row_state=r))
                continue
            st.draft = [t]
            self._follow(i, r, out, keep=keep[i], whole=whole, verified=verified, m=m)
        if snap is not None:
            settle_cache(self.cache, snap, keep, committed)
        self._drop_finished()
        return events

    def _forward(self, commit_ids, n_commit, **kw):
        return self.model.step(self.cache, commit_ids=commit_ids, n_commit=n_commit, track_experts=True,
                               expert_budget=self.expert_budget, expert_rank=self.expert_rank, **kw)

    def _emit(self, r: RowState, i: int, t: int, events: list[DecodeEvent]) -> None:
        """The prefill's `t`, emitted when drawn (and consumed by the row's grammar)."""
        if r.constraint is not None:
            r.constraint.consume([t])
        kept = r.accept([t], [1])
        r.grammar_done()
        if kept:
            events.append(DecodeEvent("commit", i, kept, [1], block=len(r.accept_lengths), row_state=r))
