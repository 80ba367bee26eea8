"""Cached block-diffusion decoding.

Per row: the prompt is committed, then blocks of `block_size` positions are generated. A block
starts fully masked; each denoise step proposes a token for every masked position and accepts
those whose confidence reaches the threshold (or the single most confident one if none does).
A finished block is committed in the same forward that runs the next block's first denoise step
(and the prompt prefill is fused with the first block's first step), so a block costs exactly its
number of denoise steps.

Shift-by-one: the hidden state at position i predicts token i+1, so block position 0 is predicted
by the last committed position (the commit part of the forward) and position j >= 1 by block
position j-1 (the denoise part).

A decoded stop caps its block: once a position holds a stop token or a token whose text contains a
stop string, the output ends at or before it, so later positions of the block are never decoded
(EOS does the same by filling the rest of the block with EOS).

Rows advance independently: each forward carries, per row, whatever it has to commit (a prompt, a
finished block, or nothing) plus its current block, so rows can join or leave at any forward.

`block_size="auto"` (`clover.decoding.width`): whenever every row stands at a block boundary (a fresh,
all-masked block), the engine picks the trained width with the most expected tokens per second for
the rows it holds (their tokens per forward so far against the model's prior, over the measured
cost of a forward at that width), or width 1 when the AR step wins; every block is then decoded
exactly as at that fixed width. A block of width 1 is the AR step: its one position is predicted by
the commit part (the last committed position), so no block is denoised and its tokens are AR's. Rows
that ride together share one width, so with rows at different points of their blocks the width
holds until they meet a boundary together. `choices` keeps each decision and why.

Only live positions cost compute. Exactly, always (the model's eager `forward_step`): the last
layer computes its queries, output projection and MLP/MoE only at the positions whose logits are
read (the denoise positions whose next position is masked, the commit's last token), and a row whose
output has ended leaves the batch after the forward that ended it (a block ends as soon as its
decoded prefix ends the row: EOS, a stop token or string), so it costs nothing after. Two
approximations, opt-in per request and tested against the exact path on what they claim to keep:

- `skip_window=True`: a row's forward carries its block only through its decode window
  (`_window_end`): masked positions right of the window (the sub-blocks after the current one with
  `sub_block`) and the tail after a decoded stop or EOS are not computed, not attended to, and read
  by the GDN as past the block's end. Per row (the forward's `denoise_valid`), so a row's tokens do
  not depend on its batch. Without sub-blocks, stops or EOS nothing is cut (the exact tokens).
- `skip_decoded=True` (dKV-Cache's delayed caching): a decoded position's layer inputs are computed
  once with its token (the forward after the one that decoded it) and then reused from a memo, and
  the position computes nothing at all, while its own prediction is not needed (its next position
  is decoded). What "its K/V" means in a GDN layer: the denoise branch is not a recurrence over the
  block. Each block position reads the prefix's recurrent state (a decayed readout with its own
  query and decay) and the block's keys and values through a softmax over the block, after a
  causal and a right-side depthwise conv over the block's pre-conv inputs. So what the other
  positions read from a decoded position at a GDN layer is its pre-conv inputs (`in_proj_qkv`),
  through the conv windows and then as key and value: those are kept; the conv and the intra-block
  attention still run over the whole block (elementwise and Bs x Bs), while the position's own
  gate projections, output norm and projection and MLP are skipped. The recurrence proper only runs
  over committed tokens, and the block commit computes every position through every layer, so
  nothing approximate reaches the cache. Not with an expert budget (block expert sharing routes the
  whole block together; the option is then off).

Both run eagerly: a compiled model serves a step that uses them without its graphs.

The uncached baseline (`mode="naive"`, `naive.NaiveEngine`) is this engine without a cache: every
forward rebuilds the whole committed sequence from scratch with the same block and acceptance rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .acceptance import accept, needs_entropy
from .base import BatchEngine, DecodeEvent, EngineRow, RowState, grad_free_call, pad_right, propose_tokens
from .modes import EngineSpec, Mode, register
from .sampling import AUTO


def block_reserve(width: int) -> int:
    """Positions a row decoded in blocks of up to `width` needs past prompt + max_new_tokens: its last
    block opens before the output's end and is denoised whole (its cache holds committed blocks only,
    never more than the prompt and the output)."""
    return width


@dataclass(eq=False)
class DiffusionRow(EngineRow):
    committed: list[int] = field(default_factory=list)  # naive (no cache): the whole committed sequence
    fixed: int = 0  # block_grid "absolute": the block's first positions that hold the prompt's tail
    first_logits: torch.Tensor | None = None  # logits of the last committed position (predicts block position 0)
    block_no: int = 0
    blk: torch.Tensor | None = None  # [Bs] the current block (mask id where still masked)
    masked: torch.Tensor | None = None  # [Bs] bool
    dec_step: torch.Tensor | None = None  # [Bs] the step that decoded each position (0 = not yet)
    dec_forced: torch.Tensor | None = None  # [Bs] bool: decoded by a forced step
    step: int = 0  # denoise steps spent on the current block
    need: int = 0  # positions that must be decoded in this block
    expected_gain: float = 0.0  # block_size="auto": the prior's tokens beyond one per forward, summed over forwards
    valid: int = 0  # a constrained row: the block's prefix its grammar has consumed
    memo_ok: torch.Tensor | None = None  # [Bs] skip_decoded: positions whose memo holds their current token's inputs


class DiffusionEngine(BatchEngine):
    row_type = DiffusionRow
    # SDAR's / LLaDA2's: no shift, the absolute grid, a block-causal commit; Fast-dLLM v2's first token
    # (docs/diffusion.md)
    semantics_implemented = {"logit_shift": (0,), "block_grid": ("absolute",), "commit_attention": ("block",),
                             "first_token": ("commit_argmax",)}

    def __init__(self, model, *, block_size: int | str, mask_id: int, pad_id: int = 0,
                 provisional: bool = False, expert_budget: int | None = None,
                 expert_rank: str = "sum", width_policy=None, skips: tuple[str, ...] = (),
                 reserve: int | None = None) -> None:
        super().__init__(model, pad_id=pad_id)
        sem = model.config.semantics
        if sem.commit_attention == "block" and sem.block_grid != "absolute":
            raise sem.refuse("commit_attention", "blocks that start at the prompt's end (block_grid 'prompt')")
        self.shift, self.absolute = sem.logit_shift, sem.block_grid == "absolute"
        self.commit_block = sem.commit_attention == "block"
        self.first_argmax = sem.first_token == "commit_argmax"
        self.eos_fill = model.config.fills_after_eos
        self.width_policy = None
        if block_size == AUTO:
            from .width import WidthPolicy

            self.width_policy = width_policy or WidthPolicy.for_model(model)
            block_size = max(self.width_policy.widths)
        self.block_size, self.mask_id = block_size, mask_id
        # the plan's reserve; an engine built without one reserves its widest block (`block_reserve`)
        self.reserve = block_reserve(block_size) if reserve is None else reserve
        self.provisional, self.expert_budget = provisional, expert_budget
        self.expert_rank = expert_rank
        self.skip_window = "window" in skips
        # the memo needs the hybrid family's layers (`live`) and routes per position (no expert sharing)
        self.skip_decoded = ("decoded" in skips and expert_budget is None
                             and getattr(model, "live_positions", False))
        self.memo: list | None = None  # skip_decoded: per layer, the rows' block inputs of their last forward [B, Bs, ...]
        self.choices: list = []  # block_size="auto": each WidthChoice (width, why), in order
        self.forwards = 0

    def _choose_width(self) -> None:
        """block_size="auto": when every row is at a fresh block, pick the width for the next blocks."""
        rows = self.rows
        if not all(r.state.step == 0 for r in rows):
            return
        pol = self.width_policy
        stats = [(pol.row_scale(len(r.tokens), r.forwards, r.state.expected_gain), r.remaining) for r in rows]
        choice = pol.choose(stats)
        choice.forward = self.forwards
        if not self.choices or self.choices[-1].width != choice.width or self.choices[-1].batch != choice.batch:
            self.choices.append(choice)
            for r in rows:
                r.width_why.append(f"forward {self.forwards}: {choice.why()}")
        if choice.width != self.block_size:
            self.block_size = choice.width
            self.memo = None
            for r in rows:
                self._new_block(r)

    def _init_row(self, row: RowState) -> None:
        super()._init_row(row)
        self._commit_first(row, list(row.prompt))
        self._new_block(row)
        self._place_prompt(row)

    # -- where the block semantics act (`clover.config.BlockSemantics`; `semantics_implemented`
    # lists the values beyond Clover's these implement, the constructor refuses the others)
    def _place_prompt(self, row: RowState) -> None:
        """`block_grid` "prompt": the whole prompt is committed by the row's first forward and its
        first block starts right after it (nothing to do). "absolute": the prompt's whole blocks are
        committed, and its tail opens the first block, decoded with it (never part of the output).
        Every block is decoded whole, as the references do; `max_new_tokens` cuts the output after."""
        if not self.absolute:
            return
        st, Bs = row.state, self.block_size
        full = len(row.prompt) - len(row.prompt) % Bs
        tail = row.prompt[full:]
        if st.valid:  # what the grammar forced into the block goes behind the tail
            st.sampler.rollback(st.valid, forced=True)
            st.blk.fill_(self.mask_id)
            st.masked.fill_(True)
            st.dec_step.zero_()
        self._commit_first(row, list(row.prompt[:full]))
        st.blk[: len(tail)] = torch.tensor(tail, dtype=torch.long, device=st.blk.device)
        st.masked[: len(tail)] = False
        st.fixed = st.valid = len(tail)
        st.need = Bs
        if st.sampler.constrained:
            self._advance_valid(row)

    def _read_positions(self, cands: list[torch.Tensor]) -> torch.Tensor:
        """[B, Bs] bool: the denoise positions whose logits a step reads. `logit_shift` 1: block
        position j is predicted by position j-1, so those whose next position is a candidate; 0: the
        candidates themselves."""
        if not self.shift:
            return torch.stack(cands)
        Bs = self.block_size
        need = torch.zeros(len(cands), Bs, dtype=torch.bool, device=self.device)
        for i, c in enumerate(cands):
            need[i, : Bs - 1] = c[1:]
        return need

    def _block_logits(self, r: RowState, denoise_logits: torch.Tensor | None,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
        """[Bs, V]: the logits that predict each block position of row `r`. `logit_shift` 1: position
        0 from the commit part (the last committed position), position j >= 1 from block position j-1
        (`denoise_logits` [Bs, V], None for a block of one). 0: each position from itself. `rows` [Bs]
        bool: the positions the step reads; only theirs are filled, the others left unset (the shift
        then moves a sub-block's rows, not the whole block's logits)."""
        if not self.shift:
            return denoise_logits
        if r.state.first_logits is None:  # no commit yet (block_grid "absolute"): position 0 holds the prompt
            first = denoise_logits[:1]
        else:
            first = r.state.first_logits[None]
            if denoise_logits is None:
                return first
        if rows is None:
            return torch.cat([first, denoise_logits[: self.block_size - 1]], dim=0)
        out = denoise_logits.new_empty(self.block_size, denoise_logits.shape[-1])
        out[0] = first[0]  # one row, read or not: no host read of `rows[0]`
        later = rows[1:].nonzero().squeeze(1)  # block positions j >= 1, less one
        out[later + 1] = denoise_logits[later]
        return out

    def _read_rows(self, r: RowState, cand: torch.Tensor) -> torch.Tensor:
        """[Bs] bool: the block positions whose logits `_decode_positions` reads for row `r`: this step's
        candidates, and a constrained row's frontier (its grammar masks that row first)."""
        if not r.state.sampler.constrained or r.state.valid >= self.block_size:
            return cand
        rows = cand.clone()
        rows[r.state.valid] = True
        return rows

    def _first_token(self, r: RowState) -> None:
        """The commit part's logits reached row `r` (`first_logits`, predicting its block's first
        position). `first_token` "denoise": that position is decoded like the others (nothing to do).
        "commit_argmax": a masked first position takes their argmax (within the row's grammar), at any
        temperature, as Fast-dLLM v2's `generate` does; the forward that committed was then the row's
        whole forward (`_commit_only`)."""
        st = r.state
        if not self._commit_only(r):
            return
        st.blk[0] = st.sampler.allowed(st.first_logits).argmax()  # (no mask without a grammar)
        st.masked[0] = False
        if st.sampler.constrained:
            self._advance_valid(r)

    def _commit_only(self, r: RowState) -> bool:
        """Whether row `r`'s next forward only commits: its block's first position waits for the commit's
        argmax (`first_token` "commit_argmax"; on the absolute grid only a fresh block after a commit
        has it masked), so nothing of the block can be denoised before it."""
        return self.first_argmax and bool(r.state.masked[0])

    def _new_block(self, row: RowState) -> None:
        Bs = self.block_size
        if row.state.blk is not None and row.state.step == 0 and row.state.valid:
            # a fresh block re-made (a new width): what the grammar forced into it is undone first
            row.state.sampler.rollback(row.state.valid, forced=True)
        row.state.blk = torch.full((Bs,), self.mask_id, dtype=torch.long, device=self.device)
        row.state.masked = torch.ones(Bs, dtype=torch.bool, device=self.device)
        row.state.dec_step = torch.zeros(Bs, dtype=torch.long, device=self.device)
        row.state.dec_forced = torch.zeros(Bs, dtype=torch.bool, device=self.device)
        row.state.step = 0
        row.state.memo_ok = torch.zeros(Bs, dtype=torch.bool, device=self.device)
        # positions that must be decoded in this block; on an absolute grid the whole block, as its
        # references decode it (the output is cut at max_new_tokens after)
        row.state.need = Bs if self.absolute else min(Bs, row.remaining)
        row.state.valid = row.state.fixed = 0
        if row.state.sampler.constrained:
            self._advance_valid(row)  # the tokens the grammar forces fill their positions now

    def _advance_valid(self, r: RowState) -> None:
        """A constrained row, left to right from its validated prefix (its sampler holds the grammar):
        a masked position takes the tokens the grammar forces (no forward decides them); decoded
        positions are checked and consumed while they keep the output valid, and the first that
        breaks it is masked again. Once the grammar is complete the block ends there."""
        st = r.state
        c = st.sampler
        while st.valid < st.need and not c.complete:
            j = st.valid
            if st.masked[j]:
                forced = c.forced()[: st.need - j]
                if not forced:
                    break
                span = slice(j, j + len(forced))
                st.blk[span] = torch.tensor(forced, dtype=torch.long, device=st.blk.device)
                st.masked[span] = False
                st.dec_step[span] = max(st.step, 1)
                c.consume(forced, forced=True)
                st.valid += len(forced)
                continue
            end = j
            while end < st.need and not st.masked[end]:
                end += 1
            toks = st.blk[j:end].tolist()
            n = c.valid_prefix(toks)
            c.consume(toks[:n])
            st.valid += n
            if n < len(toks):  # this proposal breaks the grammar: mask it again
                st.masked[j + n] = True
                st.blk[j + n] = self.mask_id
                st.dec_step[j + n] = 0
                st.dec_forced[j + n] = False
        if c.complete:
            st.need = st.valid

    def add(self, row: RowState) -> list[DecodeEvent]:
        events = super().add(row)
        if self.memo is not None and len(self.rows) > self.memo[0][0].shape[0]:  # the newcomer has no memo yet
            self.memo = [tuple(torch.cat([t, t.new_zeros(1, *t.shape[1:])]) for t in layer) for layer in self.memo]
        return events

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.rows) if not r.finished]
        if self.memo is not None and len(keep) < len(self.rows):
            idx = torch.tensor(keep, dtype=torch.long, device=self.device)
            self.memo = [tuple(t.index_select(0, idx) for t in layer) for layer in self.memo] if keep else None
        super()._drop_finished()

    @grad_free_call
    def step(self) -> list[DecodeEvent]:
        if self.width_policy is not None:
            self._choose_width()
        Bs, rows = self.block_size, self.rows
        self.forwards += 1
        cache, commit_src = self._forward_cache(rows)
        has_commit = any(commit_src)
        commit_ids, n_commit = pad_right(commit_src, self.pad_id, self.device) if has_commit else (None, None)
        only = [self._commit_only(r) for r in rows]
        cands = [torch.zeros_like(r.state.masked) if o else self._candidates(r) for r, o in zip(rows, only)]
        need = self._read_positions(cands)
        # a block of one position is predicted by the commit part alone (the AR step): nothing to denoise;
        # nor when every row waits for its commit's argmax
        ar_step = (self.shift and Bs == 1 and has_commit and all(commit_src)) or all(only)
        denoise_ids = None if ar_step else torch.stack([r.state.blk for r in rows])
        skips = {} if ar_step else self._skips(rows, cands, need)
        kind = "commit" if ar_step else "commit+denoise" if has_commit else "denoise"
        if any(only) and not ar_step and not self.model.has_graph(kind, Bs):
            # rows that only commit carry no block (nothing of it is computed); on a compiled graph
            # they carry it whole (its logits unread: what they commit does not see it)
            W = skips["denoise_valid"].shape[1] if "denoise_valid" in skips else Bs
            idle = torch.tensor(only, device=self.device)[:, None]
            skips["denoise_valid"] = skips.get("denoise_valid", torch.ones(len(rows), W, dtype=torch.bool,
                                                                           device=self.device)) & ~idle
        valid = skips.get("denoise_valid")  # skip_window: rows' blocks cut at the batch's widest window
        if valid is not None:
            denoise_ids, need = denoise_ids[:, : valid.shape[1]], need[:, : valid.shape[1]]
        out = self.model.step(
            cache,
            kind=kind,
            commit_ids=commit_ids,
            n_commit=n_commit,
            denoise_ids=denoise_ids,
            expert_budget=self.expert_budget,
            expert_rank=self.expert_rank,
            track_experts=True,
            denoise_need=None if ar_step else need,
            commit_block=Bs if self.commit_block else None,
            **skips,
        )
        at_input = denoise_ids if self.skip_decoded and not ar_step else None
        memo = out.memo
        if memo:  # this forward's block inputs, kept for the next
            self._keep_memo(memo)
        events: list[DecodeEvent] = []
        for i, r in enumerate(rows):
            if commit_src[i]:
                r.state.first_logits = out.commit_logits[i]
                r.state.pending = []
                self._first_token(r)
            logits = self._block_logits(r, None if ar_step or (Bs == 1 and self.shift) else out.denoise_logits[i],
                                        self._read_rows(r, cands[i]))
            r.forwards += 1
            if self.width_policy is not None:
                r.state.expected_gain += self.width_policy.prior[Bs] - 1.0
            r.experts_touched.extend(out.experts_touched)
            block_no = r.state.block_no
            events.extend(self._denoise_row(i, r, logits, cands[i], decode=not only[i]))
            if memo and not r.finished and r.state.block_no == block_no:
                # the memo now holds the inputs of every position that carried a decoded token (and
                # still carries it); positions past the row's window end were not computed
                inp, W = at_input[i], at_input.shape[1]
                ok = (inp != self.mask_id) & (r.state.blk[:W] == inp)
                r.state.memo_ok[:W] = ok if valid is None else ok & valid[i]
        self._drop_finished()
        return events

    # -- where the cache acts (`naive.NaiveEngine` has none)
    def _commit_first(self, row: RowState, tokens: list[int]) -> None:
        """What the row's first forward commits: its prompt (block_grid "absolute": its whole blocks)."""
        row.state.pending = tokens

    def _forward_cache(self, rows: list[RowState]) -> tuple:
        """The cache this forward runs on and what each row commits into it first."""
        return self.cache, [r.state.pending for r in rows]

    def _queue_commit(self, r: RowState, tokens: list[int]) -> None:
        """A finished block's tokens, committed with the next block's first step."""
        r.state.pending = tokens

    def _skips(self, rows: list[RowState], cands: list[torch.Tensor], need: torch.Tensor) -> dict:
        """The forward's approximate skips (`model.step` arguments; `clover.models.core`):

        - `skip_window`: each row's block ends at its decode window's end (`_window_end`),
          `denoise_valid`; the forward carries the batch's widest window (`denoise_width` keeps the
          block's own width for the GDN block gain);
        - `skip_decoded`: positions whose memo holds their current token's inputs and whose own
          prediction is not needed are `denoise_frozen`; every forward refreshes `denoise_memo`."""
        Bs = self.block_size
        out: dict = {}
        W = Bs
        if self.skip_window:
            ends = torch.tensor([self._window_end(r, c) for r, c in zip(rows, cands)], device=self.device)
            W = int(ends.max())
            out["denoise_valid"] = torch.arange(W, device=self.device)[None, :] < ends[:, None]
            if W < Bs:
                out["denoise_width"] = Bs
            elif bool(out["denoise_valid"].all()):
                del out["denoise_valid"]
        if self.skip_decoded:
            out["denoise_memo"] = () if self.memo is None else tuple(tuple(t[:, :W] for t in layer) for layer in self.memo)
            if self.memo is not None:
                frozen = torch.stack([r.state.memo_ok[:W] for r in rows]) & ~need[:, :W]
                if "denoise_valid" in out:
                    frozen &= out["denoise_valid"]
                if bool(frozen.any()):
                    out["denoise_frozen"] = frozen
        return out

    def _window_end(self, r: RowState, cand: torch.Tensor) -> int:
        """How many of the block's positions a row's forward needs with `skip_window`: through the last
        one that is a candidate of this step or a decoded token, before the block's end for the row
        (`need`: the length limit, a decoded stop) and before its first decoded EOS. Cut: masked
        positions right of the window (sub-blocks after the current one), and the tail past a stop or
        an EOS, which cannot change the output."""
        st = r.state
        lim = st.need
        if not r.params.ignore_eos and r.eos_ids:
            eos = [j for j, t in enumerate(st.blk[:lim].tolist())
                   if j >= st.fixed and t in r.eos_ids and not bool(st.masked[j])]
            if eos:
                lim = eos[0] + 1
        live = (cand | ~st.masked)[:lim].nonzero()
        return int(live[-1]) + 1 if live.numel() else 1

    def _keep_memo(self, memo: list) -> None:
        """Write a forward's block inputs (per layer, [B, W, ...]) into the engine's memo."""
        Bs = self.block_size
        W = memo[0][0].shape[1]
        if W == Bs:
            self.memo = memo
            return
        if self.memo is None:
            self.memo = [tuple(t.new_zeros(t.shape[0], Bs, *t.shape[2:]) for t in layer) for layer in memo]
        for full, new in zip(self.memo, memo):
            for f, n in zip(full, new):
                f[:, :W] = n

    def _candidates(self, r: RowState) -> torch.Tensor:
        """[Bs] bool: the positions this step may decode: masked, before the block's end for this row
        and, with sub-blocks, inside the leftmost sub-block that still has a masked position."""
        st = r.state
        open_ = st.masked.clone()
        open_[st.need :] = False
        sub = r.params.sub_block
        if sub and sub < self.block_size and bool(open_.any()):
            first = int(open_.nonzero()[0])
            lo = first - first % sub
            open_[:lo] = False
            open_[lo + sub :] = False
        return open_

    def _decode_positions(self, r: RowState, logits: torch.Tensor, open_: torch.Tensor) -> None:
        """One denoise step's proposals and acceptance for row `r` (logits [Bs, V]; `open_` the step's
        `_candidates`, computed once per forward in `step`)."""
        Bs = self.block_size
        cand = open_.nonzero().squeeze(-1)
        tails = None
        if r.state.sampler.uses_history:
            block_now = [None if r.state.masked[j] else int(r.state.blk[j]) for j in range(Bs)]
            tails = [block_now[:j] for j in cand.tolist()]
        want_ent = needs_entropy(r.params)
        frontier = r.state.valid
        constrained = r.state.sampler.constrained
        if constrained:  # the first open position follows the validated prefix: mask it
            logits = logits.clone()
            logits[frontier] = r.state.sampler.allowed(logits[frontier])
        prop = propose_tokens(r, logits[cand], tails, with_entropy=want_ent)  # stay tensors: no list round trip
        toks, conf = prop[0], prop[1]
        take, forced = accept(r.params, conf, cand, prop[2] if want_ent else None, step=r.state.step - 1, width=Bs)
        if forced:
            r.forced_steps += 1
            r.state.dec_forced[cand[take]] = True
        pos = cand[take]
        r.state.blk[pos] = toks[take].to(r.state.blk.device)
        r.state.masked[pos] = False
        r.state.dec_step[pos] = r.state.step
        if constrained:
            self._advance_valid(r)
            if r.state.valid == frontier and r.state.valid < r.state.need:
                # nothing the step accepted extends the valid prefix: the frontier commits its
                # grammar-masked proposal (always valid), so every forward makes progress
                at = int((cand == frontier).nonzero()[0])
                r.state.blk[frontier] = toks[at].to(r.state.blk.device)
                r.state.masked[frontier] = False
                r.state.dec_step[frontier] = r.state.step
                r.state.dec_forced[frontier] = True
                self._advance_valid(r)
            pos = pos[~r.state.masked[pos]]
        if not r.params.ignore_eos and r.eos_ids and not constrained and self.eos_fill:
            eos_hits = [j for j in pos.tolist() if int(r.state.blk[j]) in r.eos_ids]
            if eos_hits:  # everything after the first accepted EOS becomes EOS
                e = min(eos_hits)
                eos_tok = int(r.state.blk[e])
                later = torch.arange(e + 1, Bs, device=self.device)
                fill = later[r.state.masked[e + 1 :] | (r.state.blk[e + 1 :] != eos_tok)]
                r.state.blk[fill] = eos_tok
                r.state.dec_step[fill[r.state.masked[fill]]] = r.state.step
                r.state.masked[fill] = False
        if r.params.stop or r.params.stop_token_ids:
            # a decoded token that ends the output by itself (a stop token, or a token whose text holds
            # a stop string) caps the block: the output ends at or before it, so the positions after
            # it are never decoded -- no forward is spent on text that would be cut away
            for j in pos.tolist():  # ascending, all < r.state.need (candidates come from masked[:need])
                if _token_stops(r, int(r.state.blk[j])):
                    r.state.need = j + 1
                    break

    def _denoise_row(self, i: int, r: RowState, logits: torch.Tensor, cand: torch.Tensor,
                     decode: bool = True) -> list[DecodeEvent]:
        """Row `r`'s part of a forward: one denoise step (`decode`; else the forward only committed and
        placed the block's first token, `_first_token`), then its block emitted if it is done."""
        Bs = self.block_size
        events = []
        if decode:
            r.state.step += 1
        if decode and (r.state.valid < r.state.need or not r.state.sampler.constrained):  # a fully forced block: nothing to decode
            self._decode_positions(r, logits, cand)
        if self.provisional:
            events.append(DecodeEvent(
                "provisional", i, [None if r.state.masked[j] else int(r.state.blk[j]) for j in range(Bs)],
                r.state.dec_step.tolist(), block=r.state.block_no, step=r.state.step, row_state=r,
            ))
        open_pos = r.state.masked[: r.state.need].nonzero()
        done = r.state.need if open_pos.numel() == 0 else int(open_pos[0])  # decoded contiguous prefix
        fixed = r.state.fixed  # the prompt's tail (block_grid "absolute"): committed, never output
        # a first token alone that reaches max_new_tokens ends the row too (Fast-dLLM v2's last token,
        # which its reference takes from the commit after the last whole block)
        ends = done > fixed and (_prefix_ends_row(r, r.state.blk[fixed:done].tolist())
                                 or (not decode and len(r.tokens) + done - fixed >= r.params.max_new_tokens))
        if done < r.state.need and not ends:
            return events
        # block finished (or its decoded prefix already ends the row: EOS, a stop token or stop
        # string — the positions after it cannot change the output): emit it, then queue it for
        # commit with the next block's first step
        r.block_steps.append(r.state.step)
        r.block_widths.append(Bs)
        start = len(r.tokens)
        kept = r.accept(r.state.blk[fixed:done].tolist(), r.state.dec_step[fixed:done].tolist())
        r.grammar_done()
        n = len(r.tokens)  # a stop string may have cut into earlier blocks too
        forced_here = r.state.dec_forced[fixed : fixed + max(0, n - start)].nonzero().flatten().tolist()
        r.forced = [k for k in r.forced if k < n] + [start + j for j in forced_here]
        if kept:
            events.append(DecodeEvent("commit", i, kept, r.steps[len(r.tokens) - len(kept) :],
                                      block=r.state.block_no, step=r.state.step, row_state=r))
        if r.finished:
            events.append(DecodeEvent("finish", i, [], [], row_state=r))
            return events
        self._queue_commit(r, r.state.blk[:done].tolist())
        r.state.block_no += 1
        self._new_block(r)
        return events


def _token_stops(r: RowState, tok: int) -> bool:
    p = r.params
    if p.stop_token_ids and tok in p.stop_token_ids:
        return True
    if p.stop:
        text = r.decode([tok])
        return any(x in text for x in p.stop)
    return False


def _prefix_ends_row(r: RowState, prefix: list[int]) -> bool:
    """Whether these decoded tokens, after the row's output, already end it (EOS, a stop token, a
    stop string): the block's later positions cannot change the output."""
    p = r.params
    if not p.ignore_eos and any(t in r.eos_ids for t in prefix):
        return True
    if p.stop_token_ids and any(t in p.stop_token_ids for t in prefix):
        return True
    if p.stop:
        n = len(prefix) + 4 * max(len(x) for x in p.stop) + 4
        text = r.decode((r.tokens + prefix)[-n:])
        return any(x in text for x in p.stop)
    return False


class Diffusion(Mode):
    name = "diffusion"
    needs_mask = True
    threshold_commit = True
    summary = "block diffusion with the cache: every position whose confidence passes the threshold commits"
    auto_width = True
    engine = DiffusionEngine

    def check(self, params) -> None:
        if params.policy == "hierarchy" and params.low_threshold > params.threshold:
            raise ValueError(f"low_threshold: must be <= threshold ({params.threshold}), got {params.low_threshold}")
        if params.steps is not None and params.fallback != "quota":
            raise ValueError(f"steps: sets the quota of fallback='quota'; fallback is {params.fallback!r}")

    def spec(self, params, provisional=False) -> EngineSpec:
        # what changes the forward itself; the acceptance options are per row
        skips = tuple(k for k, on in (("window", params.skip_window), ("decoded", params.skip_decoded)) if on)
        auto = params.block_size == AUTO
        return EngineSpec(self, None if auto else params.block_size, params.expert_budget, params.expert_rank,
                          provisional, skips, auto=auto)

    def reserve(self, spec, config=None, drafter=None) -> int:
        """The widest block: the fixed one, or the widest that "auto" picks among (the model's trained
        widths, `width.trained_widths`)."""
        from .width import AUTO_MAX_WIDTH, trained_widths

        if not spec.auto:
            return block_reserve(spec.width)
        return block_reserve(AUTO_MAX_WIDTH if config is None else max(trained_widths(config)))

    def resolve(self, spec, config=None, drafter=None) -> EngineSpec:
        if spec.reserve is None and spec.auto and config is not None and config.semantics.block_grid == "absolute":
            raise ValueError("block_size: 'auto' re-makes fresh blocks, which an absolute block grid does not have; give a size")
        return super().resolve(spec, config, drafter)

    def build_engine(self, model, spec, *, mask_id, pad_id, drafter=None):
        return self.engine(model, block_size=spec.engine_width, mask_id=mask_id, pad_id=pad_id, provisional=spec.provisional,
                           expert_budget=spec.expert_budget, expert_rank=spec.expert_rank, skips=spec.skips,
                           reserve=spec.reserve)


register(Diffusion())
