"""What every decoding strategy shares: per-row bookkeeping (EOS, stop strings, length), the events
a strategy yields, and the per-generation statistics."""

from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from .sampling import Sampler, SamplingParams, make_generator


@dataclass
class DecodeEvent:
    """Yielded by a strategy. kind:
    - "commit": `token_ids` were appended to row `row`'s output (`steps[i]` = denoise step within the
      block at which token i was decoded; 1 for AR);
    - "provisional": the current block of row `row` after a denoise step: `token_ids[i]` is None while
      position i is masked; `steps[i]` the step it was decoded at (0 = not yet);
    - "finish": row `row` is done (`RowState.finish_reason` says why)."""

    kind: str
    row: int
    token_ids: list
    steps: list[int]
    block: int = 0
    step: int = 0
    row_state: "RowState | None" = None  # the row the event belongs to (rows move as others leave)


def trim_at_stop(text: str, stop) -> str:
    """A finished row's text with its first stop string and what follows removed (the text of a row
    that ended on a stop string; unchanged when none occurs)."""
    hits = [text.find(s) for s in stop or () if s in text]
    return text[: min(hits)] if hits else text


@dataclass(eq=False)
class RowState:
    prompt: list[int]
    params: SamplingParams
    eos_ids: set[int]
    decode: object = None  # tokenizer.decode, needed only for stop strings
    tokens: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    forwards: int = 0
    draft_forwards: int = 0  # forwards of a separate drafter (dflash), beside the model's `forwards`
    experts_touched: list[int] = field(default_factory=list)
    block_steps: list[int] = field(default_factory=list)
    block_widths: list[int] = field(default_factory=list)  # the width of each block (diffusion; block_size="auto" varies it)
    width_why: list[str] = field(default_factory=list)  # block_size="auto": each width decision this row rode, and why
    forced_steps: int = 0  # denoise steps where no position reached the threshold (diffusion)
    forced: list[int] = field(default_factory=list)  # indices into `tokens` committed by such a step
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None
    accept_lengths: list[int] = field(default_factory=list)
    request_id: object = None  # whoever owns the row (a server request, a batch index)
    state: "EngineRow | None" = None  # what the row's engine keeps between forwards
    stop_token: int | None = None  # the EOS / stop token id that ended the row (not in `tokens`)
    constraint: object = None  # a `clover.grammar.Constraint` the output must match, handed to the row's sampler
    _new_tokens: int = 0

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.tokens)

    def accept(self, new: list[int], steps: list[int]) -> list[int]:
        """Append tokens, applying EOS / stop tokens / stop strings / the length limit.
        Returns the tokens actually kept (what a stream should emit).

        This is the one place that decides where a row's output ends and why, for every mode: a
        mode that commits k tokens at once gets exactly the result AR gets committing them one by
        one. The first of these to occur wins: an EOS / stop token (not kept; `stop`), a stop
        string completed by a kept token (`stop`, the text trimmed to before it), the length
        limit (`length`)."""
        if self.finished:
            return []
        room = self.params.max_new_tokens - len(self.tokens)
        stop_ids = self.params.stop_token_ids
        n, reason, stop_token = 0, None, None
        for tok in new[: max(0, room)]:
            if (tok in self.eos_ids and not self.params.ignore_eos) or tok in stop_ids:
                reason, stop_token = "stop", tok
                break
            n += 1
        start = len(self.tokens)
        self.tokens.extend(new[:n])
        self.steps.extend(steps[:n])
        self._new_tokens = n
        if self.params.stop and n:
            cut = self._stop_string_cut()
            if cut is not None:  # the stop string ends before any EOS / stop token after it
                del self.tokens[cut:], self.steps[cut:]
                reason, stop_token = "stop", None
        if reason is None and len(self.tokens) >= self.params.max_new_tokens:
            reason = "length"
        if reason is not None:
            self.stop_token = stop_token
            self._finish(reason)
        return self.tokens[start:]

    def grammar_done(self) -> None:
        """A constrained row whose grammar is complete (admits nothing more) ends here, `stop`, in
        every mode alike (without spending a forward on the EOS the grammar would force)."""
        if not self.finished and self.state.sampler.complete:
            self._finish("stop")

    def _stop_string_cut(self) -> int | None:
        """Number of tokens to keep so the text reaches the end of the first stop string, or None."""
        # cheap check on the tail first (a stop string can only complete in the newest tokens);
        # a character may span up to 4 byte tokens
        tail_n = self._new_tokens + 4 * max(len(s) for s in self.params.stop) + 4
        tail = self.decode(self.tokens[-tail_n:])
        if not any(s in tail for s in self.params.stop):
            return None
        text = self.decode(self.tokens)
        hits = [text.find(s) + len(s) for s in self.params.stop if s in text]
        if not hits:
            return None
        end = min(hits)
        for n in range(1, len(self.tokens) + 1):  # shortest prefix whose text covers the stop string
            # a prefix ending inside a multi-byte character decodes with replacement chars: ignore them
            if len(self.decode(self.tokens[:n]).rstrip("\ufffd")) >= end:
                return n
        return len(self.tokens)

    def text(self) -> str:
        text = self.decode(self.tokens) if self.decode else ""
        return trim_at_stop(text, self.params.stop) if self.finish_reason == "stop" else text

    def stream_text(self) -> str:
        """The text a stream may have emitted so far: all of `text()` once the row is finished;
        before that, not a trailing incomplete UTF-8 sequence nor a tail that could be the start of
        a stop string (so what a stream emits is always a prefix of the final text)."""
        text = self.text()
        return text if self.finished else text[: held_back(text, self.params.stop)]

    def cancel(self, reason: str = "abort") -> None:
        """Stop the row; the engine drops it before its next forward."""
        self._finish(reason)

    def _finish(self, reason: str) -> None:
        if not self.finished:
            self.finished, self.finish_reason = True, reason
            self.ended = time.perf_counter()


def held_back(text: str, stop: list[str]) -> int:
    """How much of `text` a stream may emit now: not a trailing incomplete UTF-8 sequence (shown
    as U+FFFD), nor a tail that could be the start of a stop string."""
    n = len(text)
    while n and text[n - 1] == "\ufffd":
        n -= 1
    cut = n
    for s in stop:
        for k in range(min(len(s) - 1, n), 0, -1):
            if text[:n].endswith(s[:k]):
                cut = min(cut, n - k)
                break
    return cut


@dataclass
class GenerationStats:
    prompt_tokens: int
    tokens: int
    forwards: int
    seconds: float
    experts_touched: float | None = None  # mean unique experts per MoE layer per forward
    block_steps: list[int] = field(default_factory=list)  # denoise steps per block (diffusion)
    block_widths: list[int] = field(default_factory=list)  # width of each block (diffusion)
    width_why: list[str] = field(default_factory=list)  # block_size="auto": the width decisions and why
    forced_steps: int = 0  # denoise steps that committed their most confident position below the threshold
    accept_lengths: list[int] = field(default_factory=list)  # tokens per iteration (speculative)
    grammar_forced: int = 0  # tokens placed because the grammar forced them (a constrained diffusion row)
    grammar_seconds: float = 0.0  # time spent in the grammar (masks, checks, forced tokens)
    draft_forwards: int = 0  # forwards of a separate drafter (dflash); `forwards` counts the model's

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "forwards": self.forwards,
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "seconds": round(self.seconds, 6),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "experts_touched": self.experts_touched,
            "block_steps": self.block_steps,
            "block_widths": self.block_widths,
            "forced_steps": self.forced_steps,
            **({"grammar_forced": self.grammar_forced, "grammar_seconds": round(self.grammar_seconds, 6)}
               if self.grammar_seconds else {}),
            **({"draft_forwards": self.draft_forwards} if self.draft_forwards else {}),
        }

    @classmethod
    def from_row(cls, row: RowState) -> "GenerationStats":
        end = row.ended or time.perf_counter()
        et = sum(row.experts_touched) / len(row.experts_touched) if row.experts_touched else None
        return cls(
            prompt_tokens=len(row.prompt),
            tokens=len(row.tokens),
            forwards=row.forwards,
            seconds=end - row.started,
            experts_touched=et,
            block_steps=list(row.block_steps),
            block_widths=list(row.block_widths),
            width_why=list(row.width_why),
            forced_steps=row.forced_steps,
            accept_lengths=list(row.accept_lengths),
            grammar_forced=getattr(row.constraint, "forced_tokens", 0),
            grammar_seconds=getattr(row.constraint, "seconds", 0.0),
            draft_forwards=row.draft_forwards,
        )


# ------------------------------------------------------------------ the batch machinery
def pad_right(seqs: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), T), pad, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        if s:
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long, device=device)
    return ids, torch.tensor([len(s) for s in seqs], dtype=torch.long, device=device)


def propose_tokens(row: RowState, logits: torch.Tensor, history_tail: list | None = None,
                   with_entropy: bool = False) -> tuple[torch.Tensor, ...]:
    """Process and propose for positions of one row. logits [N, V] -> (tokens [N], confidences [N]);
    `history_tail[n]`: what position n follows inside the current block (for the penalties)."""
    sampler = row.state.sampler
    return sampler(logits, row_history(row, history_tail, logits.shape[0]), with_entropy)


def row_history(row: RowState, history_tail: list | None, n: int) -> list[list[int]] | None:
    """What the penalties of a row's n positions see: its prompt and tokens, then `history_tail[i]`
    (None when its sampler uses no history)."""
    if not row.state.sampler.uses_history:
        return None
    base = row.prompt + row.tokens
    return [base + list(h) for h in (history_tail or [[]] * n)]


def next_tokens(row: RowState, logits: torch.Tensor) -> list[int]:
    """`propose_tokens`' tokens as a Python list, chosen and consumed under the row's grammar by its
    sampler (`Sampler.next_tokens`)."""
    return row.state.sampler.next_tokens(logits, row_history(row, None, logits.shape[0]))


@dataclass(eq=False)
class EngineRow:
    """What an engine keeps per row between forwards; each engine declares its own subclass."""

    sampler: Sampler | None = None  # the row's logits processing and proposal (with its generator)
    pending: list[int] = field(default_factory=list)  # tokens to commit with the next forward


# model -> whether its decoding may run in inference mode; weak keys, so a collected model takes its answer with it
_INFERENCE_MODE_OK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grad_free(model):
    """The context decoding runs in: `torch.inference_mode()`, or `torch.no_grad()` where the model's
    weights include a tensor subclass (torchao's `Int8Tensor` in the transformers export of an INT8
    checkpoint), whose ops may not take inference tensors (`Int8Tensor`'s select of one expert sets a
    version counter: "Cannot set version_counter for inference tensor"). Decided once per model."""
    ok = _INFERENCE_MODE_OK.get(model)
    if ok is None:
        plain = (torch.Tensor, nn.Parameter)
        ok = all(type(t) in plain for t in (*model.parameters(), *model.buffers()))
        _INFERENCE_MODE_OK[model] = ok
    return torch.inference_mode() if ok else torch.no_grad()


def grad_free_call(fn):
    """Decorator: `fn` — an engine's method, or a function whose first argument is the model — runs
    under `grad_free` of its model."""

    @functools.wraps(fn)
    def run(first, *args, **kwargs):
        with grad_free(first.model if isinstance(first, BatchEngine) else first):
            return fn(first, *args, **kwargs)

    return run


class BatchEngine:
    """Rows in flight over one cache; subclasses define what a forward feeds and how it is read."""

    row_type: type = EngineRow
    # the block semantics (`clover.config.BlockSemantics`) this engine decodes right, beyond Clover's
    # values: field -> the other values. A model whose config states another is refused here, in one line.
    semantics_implemented: dict[str, tuple] = {}

    def __init__(self, model, *, pad_id: int = 0, reserve: int = 0) -> None:
        model.config.semantics.require(f"{type(self).__name__}", self.semantics_implemented)
        self.model = model
        self.pad_id = pad_id
        self.reserve = reserve  # positions a row's cache holds past prompt + max_new_tokens (`EngineSpec.reserve`)
        self.rows: list[RowState] = []
        self.cache = None

    @property
    def device(self):
        return self.model.device

    def __len__(self) -> int:
        return len(self.rows)

    def _capacity(self, row: RowState) -> int:
        """The cache a row is made with: its prompt, its output and the plan's reserve (the positions the
        context check reserved for it, so a row that passed the check never grows its cache)."""
        return len(row.prompt) + row.params.max_new_tokens + self.reserve

    @grad_free_call
    def add(self, row: RowState) -> list[DecodeEvent]:
        """Admit a row; its prompt is committed with the next forward. A row with nothing to
        generate finishes at once. The cache is made under `grad_free`, as every step runs (so a
        compiled step sees the same kind of tensors whether the cache was made here or grown,
        joined or cut inside a step)."""
        if row.params.max_new_tokens == 0:
            row._finish("length")
            return [DecodeEvent("finish", -1, [], [], row_state=row)]
        self._init_row(row)
        cap = self._capacity(row)
        fresh = self.model.make_cache(1, cap)
        if self.cache is None:
            self.cache = fresh
        else:
            self.cache.ensure_capacity(cap)
            fresh.ensure_capacity(self.cache.capacity)
            self.cache = self.cache.concat([self.cache, fresh])
        self.rows.append(row)
        return []

    def _init_row(self, row: RowState) -> None:
        sampler = Sampler(row.params, row.eos_ids, make_generator(row.params.seed, self.device), row.constraint)
        row.state = self.row_type(sampler=sampler, pending=list(row.prompt))

    @grad_free_call
    def cancel(self, row: RowState, reason: str = "abort") -> None:
        """Finish a row now (e.g. its client went away) and release its cache slot."""
        row.cancel(reason)
        self._drop_finished()

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.rows) if not r.finished]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self.cache = self.cache.select_rows(keep) if keep else None

    def run(self) -> Iterator[DecodeEvent]:
        while self.rows:
            yield from self.step()
