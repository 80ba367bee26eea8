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
  it, so the kept tokens are those constrained AR chooses (or draws); the row's sampler owns the
  grammar and makes those choices (`Sampler.agree`, `target_probs`, `draft`).
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
        super().__init__(model, pad_id=pad_id, reserve=reserve)
        self.width = width
        self.draft_policy = draft_policy
        self.expert_budget, self.expert_rank = expert_budget, expert_rank
        self.choices: list = []  # draft "auto": each WidthChoice (width, why), in order
        self.forwards = 0

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
    @staticmethod
    def _probs(r: RowState, logits: torch.Tensor, history_tail: list | None = None) -> torch.Tensor:
        """AR's sampling distribution for logits [N, V] of row `r` (penalties reading its tokens and
        `history_tail[n]` at position n)."""
        return r.state.sampler.probs(logits, row_history(r, history_tail, logits.shape[0]))

    def _verify(self, r: RowState, logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                before: list[int]) -> tuple[int, int | None]:
        """logits [k+1, V], position j after the row's tokens, `before` (tokens committed with the
        drafts, not yet in `r.tokens`) and d_1 .. d_j -> (how many of `drafts` are kept, the
        target's next token: None where the row's grammar is complete). Its sampler chooses (under
        the grammar, which consumes the kept drafts); sampled, by the rejection rule."""
        k, s = len(drafts), r.state.sampler
        history = row_history(r, [before + drafts[:j] for j in range(k + 1)], k + 1)
        if r.params.greedy:
            return s.agree(s.process(logits, history), drafts)
        p = s.target_probs(logits, drafts, history)
        if p is None:
            return 0, None
        m, token = accept_draft([None] + drafts, q, p[:k], s.generator)  # position 0 is the target's own
        if token is None and p.shape[0] > k:  # every draft kept: the next token after the last one
            token = s.draw(p[k])
        s.consume(drafts[: m - 1])
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
        block = extra.get("denoise_ids") is not None
        kind = "verify" if verifying else ("commit+denoise" if block else "commit") if has_commit else "denoise"
        out = self._forward(commit_ids, n_commit, kind=kind, all_logits=every, **extra)
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
                if not early:
                    st.sampler.consume(verified[:1])  # t, AR's own token, is kept
                n, t = self._verify(r, causal[i, :D], verified[1:], st.draft_q, [] if early else verified[:1])
                m = keep[i] = 1 + n
                st.kept_draft += n
                st.rejected_draft += m < D
                whole = m == D
                if not early:  # t_prev and the kept drafts (t waits for its own verify)
                    emit = verified[:m]
                else:  # t_prev was emitted when drawn: the kept drafts and t
                    emit = verified[1:m] + ([t] if t is not None else [])
                    if t is not None:
                        st.sampler.consume([t])
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
        r.state.sampler.consume([t])
        kept = r.accept([t], [1])
        r.grammar_done()
        if kept:
            events.append(DecodeEvent("commit", i, kept, [1], block=len(r.accept_lengths), row_state=r))
