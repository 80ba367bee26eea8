"""Decoding parameters, logits processing, sampling and confidence — shared by every strategy."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, fields

import torch

from .acceptance import FALLBACKS, POLICIES

CONFIDENCE_KINDS = ("prob", "margin", "entropy")
EXPERT_RANKS = ("sum", "max")  # clover.moe.BlockSharing.rank
SEED_MAX = 2**64 - 1
_FMAX = torch.finfo(torch.float32).max
MAX_N = 64  # completions per request (the server's `n`)
AUTO = "auto"  # block_size: the engine picks a trained width per block (clover.decoding.width)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Limit:
    """The accepted values of one generation option. The one description of each option's limits:
    `SamplingParams.validate` checks them, the server's request schema (and so its OpenAPI document)
    is built from them (`clover.serve.schemas`), a config.json's defaults are checked by them, and docs/serving.md lists them (`limits_table`)."""

    kind: type  # int, float, str, bool or list (of `item`)
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    item: type | None = None  # list items
    max_items: int | None = None
    max_chars: int | None = None  # per string (a str option, or each item of a list of str)
    choices: tuple = ()
    nullable: bool = False  # None means: the model's default
    words: tuple = ()  # strings accepted besides the numbers (block_size: "auto")
    doc: str = ""

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        if self.kind is bool:
            return "true or false"
        parts = []
        lo = f"{_num(self.ge)} <=" if self.ge is not None else f"{_num(self.gt)} <" if self.gt is not None else None
        if lo or self.le is not None:
            what = "finite number" if self.kind is float else "integer"
            parts.append(" ".join(x for x in (lo, "x" if lo or self.le is not None else None,
                                               f"<= {_num(self.le)}" if self.le is not None else None) if x) + f" ({what})")
        if self.kind is list:
            parts.append(f"at most {self.max_items} items" + (f" of at most {self.max_chars} characters" if self.max_chars else ""))
        parts += [f'or "{w}"' for w in self.words]
        if self.nullable:
            parts.append("or null")
        return "; ".join(parts)

    def check(self, name: str, value):
        """The value, normalised; or ValueError("name: what is wrong and what is accepted")."""
        def bad(why: str):
            raise ValueError(f"{name}: {why}, got {value!r}"[:300])

        if value is None:
            if self.nullable:
                return None
            bad("must be given")
        if isinstance(value, str) and value in self.words:
            return value
        if self.kind is bool:
            if not isinstance(value, bool):
                bad("must be true or false")
            return value
        if self.choices:
            if value not in self.choices:
                bad(f"must be one of {', '.join(map(str, self.choices))}")
            return value
        if self.kind is list:
            if not isinstance(value, (list, tuple)):
                bad("must be a list")
            if self.max_items is not None and len(value) > self.max_items:
                raise ValueError(f"{name}: at most {self.max_items} items, got {len(value)}")
            return [Limit(self.item, ge=self.ge, gt=self.gt, le=self.le, max_chars=self.max_chars).check(name, v)
                    for i, v in enumerate(value)]
        if self.kind is str:
            if not isinstance(value, str):
                bad("must be a string")
            if self.max_chars is not None and len(value) > self.max_chars:
                raise ValueError(f"{name}: at most {self.max_chars} characters, got {len(value)}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad(f"must be {'an integer' if self.kind is int else 'a number'}")
        if self.kind is int:
            if isinstance(value, float):
                if not value.is_integer():
                    bad("must be an integer")
                value = int(value)
        else:
            value = float(value)
            if not math.isfinite(value):
                bad("must be a finite number")
        if self.ge is not None and not value >= self.ge:
            bad(f"must be >= {_num(self.ge)}" + (f" and <= {_num(self.le)}" if self.le is not None else ""))
        if self.gt is not None and not value > self.gt:
            bad(f"must be > {_num(self.gt)}" + (f" and <= {_num(self.le)}" if self.le is not None else ""))
        if self.le is not None and not value <= self.le:
            low = f">= {_num(self.ge)} and " if self.ge is not None else f"> {_num(self.gt)} and " if self.gt is not None else ""
            bad(f"must be {low}<= {_num(self.le)}")
        return value


LIMITS: dict[str, Limit] = {
    "max_new_tokens": Limit(int, ge=0, doc="tokens to generate; prompt + this (+ one block) must fit the context"),
    "temperature": Limit(float, ge=0, le=100, doc="0 = greedy"),
    "top_p": Limit(float, gt=0, le=1, doc="nucleus sampling (1 = off)"),
    "top_k": Limit(int, ge=-1, le=1 << 20, doc="-1 or 0 = off"),
    "seed": Limit(int, ge=0, le=SEED_MAX, nullable=True, doc="sampling seed (null = unseeded); row i of a request with n > 1 uses seed + i"),
    "stop": Limit(list, item=str, max_items=64, max_chars=256, doc="stop strings (not included in the text)"),
    "stop_token_ids": Limit(list, item=int, ge=0, max_items=256, doc="token ids that end the output (ids in the vocabulary)"),
    "ignore_eos": Limit(bool, doc="keep generating past EOS"),
    "repetition_penalty": Limit(float, gt=0, le=10, doc="1 = off"),
    "presence_penalty": Limit(float, ge=-2, le=2, doc="subtracted from the logits of tokens already seen"),
    "frequency_penalty": Limit(float, ge=-2, le=2, doc="OpenAI's: subtracted from a seen token's logit once per time it was seen"),
    "eos_penalty": Limit(float, ge=-100, le=100, doc="subtracted from the EOS logits"),
    "no_repeat_ngram_size": Limit(int, ge=0, le=64, doc="0 = off"),
    "block_size": Limit(int, ge=1, le=1024, nullable=True, words=(AUTO,),
                        doc="diffusion / speculative block (null = the model's; speculative without draft_length: \"auto\"); \"auto\": diffusion per block, speculative per draft, the trained width with the most expected tokens/s"),
    "threshold": Limit(float, gt=0, le=2, nullable=True, doc="confidence to accept a token (null = the model's); above 1: one token per step"),
    "confidence": Limit(str, choices=CONFIDENCE_KINDS, doc="confidence measure"),
    "policy": Limit(str, choices=tuple(POLICIES), nullable=True,
                    doc="acceptance rule of a denoise step (null = the model's; `threshold` when only a threshold is given)"),
    "fallback": Limit(str, choices=FALLBACKS, doc="what a step commits when the rule accepts nothing (a forced step)"),
    "factor": Limit(float, gt=0, le=10, doc="policy factor: the top n while the n-th confidence >= 1 - factor/(n+1)"),
    "low_threshold": Limit(float, gt=0, le=1, doc="policy hierarchy: local maxima at or above this also commit (<= threshold)"),
    "entropy_budget": Limit(float, gt=0, le=100, doc="policy entropy: summed entropy (nats) a step may commit"),
    "sub_block": Limit(int, ge=1, le=1024, nullable=True,
                       doc="denoise the block in sub-blocks of this size, left to right (null = the whole block)"),
    "expert_budget": Limit(int, ge=1, le=1 << 16, nullable=True,
                           doc="experts per block forward, within [experts per token, experts] of the model (null = the model's)"),
    "skip_window": Limit(bool, doc="diffusion: a denoise forward carries each row's block only up to the end of its "
                               "decode window (approximate; eager)"),
    "skip_decoded": Limit(bool, doc="diffusion: decoded positions whose prediction is not needed reuse their K/V and "
                                "compute nothing (approximate; eager)"),
    "expert_rank": Limit(str, choices=EXPERT_RANKS,
                         doc="how expert_budget ranks a block's experts: sum of its tokens' router probabilities, or max"),
    "draft_length": Limit(int, ge=1, le=1024, nullable=True, doc="speculative draft, <= block_size (null = block_size)"),
    "steps": Limit(int, ge=1, le=1 << 16, nullable=True,
                   doc="canvas: denoising steps over the whole canvas, <= max_new_tokens (null = one token a step); "
                       "diffusion with fallback quota: denoise steps per block, step s commits at least block/steps "
                       "positions (null = the block size: one)"),
    "cfg_scale": Limit(float, ge=0, le=100, doc="canvas (LLaDA): classifier-free guidance scale (0 = off)"),
    "canvas_cache": Limit(str, choices=("prefix", "dual"), nullable=True,
                          doc="canvas (LLaDA): Fast-dLLM's prefix or dual cache, refreshed at each block's start "
                              "(approximate; null = none)"),
    "canvas_threshold": Limit(float, gt=0, le=1, nullable=True,
                              doc="canvas (LLaDA): Fast-dLLM's parallel decoding, a step unmasks every position above this "
                                  "confidence, at least one (approximate; null = the schedule's count)"),
    "canvas_ties": Limit(str, choices=("position",), nullable=True,
                         doc="canvas: the order of equal confidences: \"position\", the leftmost first (llama.cpp's "
                             "llama-diffusion-cli; null = torch.topk's, the references')"),
}


def limits_table() -> str:
    """The generation options and their limits as a Markdown table (docs/serving.md shows it)."""
    rows = ["| option | accepted values | meaning |", "|---|---|---|"]
    for name, lim in LIMITS.items():
        rows.append(f"| `{name}` | {lim.describe()} | {lim.doc} |")
    return "\n".join(rows)


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    eos_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    # diffusion
    block_size: int | str | None = None  # None: the model's config; "auto" (diffusion): chosen per block
    threshold: float | None = None  # None: the model's config
    confidence: str = "prob"
    policy: str | None = None  # None: the model's (LLM.params)
    fallback: str = "confident"
    factor: float = 1.0
    low_threshold: float = 0.5
    entropy_budget: float = 1.0
    sub_block: int | None = None
    skip_window: bool = False
    skip_decoded: bool = False
    expert_budget: int | None = None
    expert_rank: str = "sum"
    # speculative
    draft_length: int | None = None
    # canvas (whole-sequence diffusion); diffusion's fallback quota (steps per block)
    steps: int | None = None
    cfg_scale: float = 0.0
    canvas_cache: str | None = None
    canvas_threshold: float | None = None
    canvas_ties: str | None = None
    # token id -> added to its logit, in [-100, 100] (OpenAI's logit_bias; -100 bans the token)
    logit_bias: dict[int, float] | None = None

    def validate(self) -> "SamplingParams":
        """Check every option against `LIMITS` (ValueError "option: what is wrong"), and normalise:
        a single stop string becomes a list, empty stop strings are dropped, top_k -1 becomes 0."""
        if self.stop is None:  # as in the OpenAI API: null = no stop strings
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        for name, lim in LIMITS.items():
            setattr(self, name, lim.check(name, getattr(self, name)))
        self.stop = [s for s in self.stop if s]
        self.top_k = max(0, self.top_k)
        self.logit_bias = check_logit_bias(self.logit_bias)
        return self

    def check_model(self, vocab_size: int) -> "SamplingParams":
        """The checks that need the model: token ids inside the vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[0]} is outside the vocabulary (size {vocab_size})")
        bad = [t for t in self.logit_bias or {} if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary (size {vocab_size})")
        return self

    @classmethod
    def from_kwargs(cls, **kwargs) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown generation option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**kwargs).validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


LOGIT_BIAS_MAX_ITEMS = 1024


def check_logit_bias(bias) -> dict[int, float] | None:
    """OpenAI's logit_bias: {token id (an int, or its decimal string as JSON keys are): bias in
    [-100, 100]} -> {int: float}; None or {} -> None. ValueError "logit_bias: why" otherwise."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias: must map token ids to numbers, got {type(bias).__name__}")
    if len(bias) > LOGIT_BIAS_MAX_ITEMS:
        raise ValueError(f"logit_bias: at most {LOGIT_BIAS_MAX_ITEMS} tokens, got {len(bias)}")
    out = {}
    for k, v in bias.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: keys must be token ids, got {k!r}") from None
        if tok < 0 or isinstance(k, bool):
            raise ValueError(f"logit_bias: keys must be token ids >= 0, got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise ValueError(f"logit_bias: the bias of token {tok} must be a number in [-100, 100], got {v!r}")
        out[tok] = float(v)
    return out


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    if seed is None:
        return None
    # any integer seed maps into the generator's 64-bit range (row i of a request uses seed + i)
    return torch.Generator(device=device).manual_seed(int(seed) % (SEED_MAX + 1))


class Sampler:
    """One row's logits processing, token proposal and grammar, built once from its options (which
    processors apply is decided here, not at every step). As in vLLM the sampler owns the row's
    grammar (`grammar`, a `clover.grammar.Constraint` whose state is the row's output so far, or
    None): its mask, consume and rollback, and every choice made under it (`next_tokens`, `agree`,
    `target_probs`, `draft`), so an engine never reads the grammar and writes each step once. Each
    grammar operation is a no-op without one."""

    def __init__(self, params: SamplingParams, eos_ids, generator: torch.Generator | None = None,
                 grammar=None) -> None:
        self.params = params
        self.eos = sorted(eos_ids)
        self.generator = generator
        self.grammar = grammar
        self.uses_history = bool(params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
                                 or params.no_repeat_ngram_size)

    def process(self, logits: torch.Tensor, history: list[list[int]] | None = None) -> torch.Tensor:
        return process_logits(logits, self.params, history if self.uses_history else None, self.eos)

    def __call__(self, logits: torch.Tensor, history: list[list[int]] | None = None,
                 with_entropy: bool = False) -> tuple[torch.Tensor, ...]:
        """logits [N, V] -> (tokens [N], confidences [N][, entropies [N]]); `history[n]`: the tokens
        position n follows."""
        return propose(self.process(logits, history), self.params, self.generator, with_entropy)

    def probs(self, logits: torch.Tensor, history: list[list[int]] | None = None) -> torch.Tensor:
        """AR's sampling distribution for logits [N, V]: processed, then temperature / top-k / top-p."""
        return filter_logits(self.process(logits, history), self.params).softmax(-1)

    # -- the grammar
    @property
    def constrained(self) -> bool:
        return self.grammar is not None

    @property
    def complete(self) -> bool:
        """The grammar admits nothing more: the row's output ends here."""
        return self.grammar is not None and self.grammar.stopped

    def consume(self, tokens, forced: bool = False) -> None:
        """The grammar moves past `tokens` (`forced`: placed because it forced them)."""
        if self.grammar is not None and tokens:
            self.grammar.consume(tokens)
            self.grammar.forced_tokens += len(tokens) if forced else 0

    def rollback(self, n: int, forced: bool = False) -> None:
        """The grammar forgets its last `n` tokens (`forced`: tokens it had forced)."""
        if self.grammar is not None and n:
            self.grammar.rollback(n)
            self.grammar.forced_tokens -= n if forced else 0

    def allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] with -inf where a token would break the grammar (as they are without one)."""
        return logits if self.grammar is None else self.grammar.mask(logits)

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (nothing consumed; none without one)."""
        return [] if self.grammar is None else self.grammar.forced()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the left, keep the output valid (nothing consumed)."""
        return len(tokens) if self.grammar is None else self.grammar.valid_prefix(tokens)

    # -- choosing under it
    def next_tokens(self, logits: torch.Tensor, history: list[list[int]] | None = None) -> list[int]:
        """The tokens proposed at logits [N, V] (`__call__`), under the grammar (masked first; greedy:
        the plain argmax where the grammar allows it, no mask computed), consumed by it."""
        if self.grammar is None:
            return self(logits, history)[0].tolist()
        if self.params.greedy:
            toks = self(logits, history)[0].tolist()
            if not self.grammar.allows(toks[0]):
                toks = self(self.grammar.mask(logits), history)[0].tolist()
        else:
            toks = self(self.grammar.mask(logits), history)[0].tolist()
        self.grammar.consume(toks)
        return toks

    def agree(self, processed: torch.Tensor, drafts: list[int]) -> tuple[int, int | None]:
        """Greedy verification: processed logits [k+1, V], position j after d_1 .. d_j -> (how many of
        `drafts` equal the target's choice there, the target's token after them: None where the
        grammar is complete). Under the grammar each choice is masked by it after the drafts before
        and the agreed drafts are consumed."""
        k, c = len(drafts), self.grammar
        if c is None:  # AR's token choice (`propose`), without its confidences
            target = greedy_tokens(processed).tolist()
            n = 0
            while n < k and drafts[n] == target[n]:
                n += 1
            return n, target[n]
        n = 0
        while not c.stopped:
            tok = c.argmax(processed[n])
            if n == k or tok != drafts[n]:
                return n, tok
            c.consume([tok])
            n += 1
        return n, None

    def target_probs(self, logits: torch.Tensor, drafts: list[int], history: list[list[int]] | None = None
                     ) -> torch.Tensor | None:
        """AR's distributions p_j at logits [k+1, V], position j after d_1 .. d_j (`history[j]`: what it
        follows, for the penalties); under the grammar each masked by it after the drafts before
        (it ends where the grammar completes; None: at once). Nothing is consumed."""
        c, k = self.grammar, len(drafts)
        if c is None:
            return self.probs(logits, history)
        ps = []
        for j in range(k + 1):
            if c.stopped:
                break
            ps.append(self.probs(c.mask(logits[j : j + 1]), history[j : j + 1] if history else None)[0])
            if j < k:
                c.consume(drafts[j : j + 1])
        c.rollback(min(len(ps), k))
        return torch.stack(ps) if ps else None

    def draw(self, probs: torch.Tensor) -> int:
        """One token drawn from `probs` [V] with the row's generator."""
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def draft(self, logits: torch.Tensor, history: list[list[int]] | None = None, sure: bool = False
              ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
        """A drafter's guesses at logits [D, V] (position j: the token after the row's output and
        guesses 0 .. j-1): greedy the argmax of the processed logits, sampled a draw from AR's
        distribution (penalties reading `history`), under the grammar each masked by it after the
        guesses before (ending where it completes; its state restored after). Returns the tokens,
        sampled the distributions they were drawn from ([n, V], None when none), and with `sure`
        each position's top probability ([D]; None under a grammar, whose drafts are not cut)."""
        c, greedy = self.grammar, self.params.greedy
        if c is None:
            if greedy:
                processed = self.process(logits)
                return (processed.argmax(-1).tolist(), None,
                        processed.softmax(-1).amax(-1) if sure else None)
            q = self.probs(logits, history)
            toks = torch.multinomial(q, 1, generator=self.generator).squeeze(-1).tolist()
            return toks, q, (q.amax(-1) if sure else None)
        toks, qs = [], []
        processed = self.process(logits) if greedy else None
        for j in range(logits.shape[0]):
            if c.stopped:
                break
            if greedy:
                tok = c.argmax(processed[j])
            else:
                q = self.probs(c.mask(logits[j : j + 1]), history[j : j + 1] if history else None)
                tok = int(torch.multinomial(q, 1, generator=self.generator))
            if not c.consume([tok]):
                break
            toks.append(tok)
            if not greedy:
                qs.append(q[0])
        c.rollback(len(toks))
        return toks, (torch.stack(qs) if qs else None), None


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    history: list[list[int]] | None,
    eos_ids: list[int],
) -> torch.Tensor:
    """Penalties and biases, in fp32. logits [N, V]; history[n] = the tokens position n follows
    (for penalties: all seen tokens; for no-repeat n-grams: the last tokens, in order).
    Never modifies its input."""
    logits = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        logits[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    if history is not None and (params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty):
        for n, seen in enumerate(history):
            counts = Counter(t for t in seen if t is not None)
            if not counts:
                continue
            seen_ids = sorted(counts)
            ids = torch.tensor(seen_ids, dtype=torch.long, device=logits.device)
            row = logits[n, ids]
            if params.repetition_penalty != 1.0:
                row = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
            row = row - params.presence_penalty
            if params.frequency_penalty:
                times = torch.tensor([counts[i] for i in seen_ids], dtype=logits.dtype, device=logits.device)
                row = row - params.frequency_penalty * times
            logits[n, ids] = row
    if params.eos_penalty and eos_ids:
        logits[:, eos_ids] -= params.eos_penalty
    if params.ignore_eos and eos_ids:
        logits[:, eos_ids] = -math.inf
    if history is not None and params.no_repeat_ngram_size > 0:
        n = params.no_repeat_ngram_size
        for i, seen in enumerate(history):
            banned = banned_ngram_tokens(seen, n)
            if banned:
                logits[i, list(banned)] = -math.inf
    # extreme (but valid) penalties can overflow: +inf would make the softmax NaN
    return torch.nan_to_num(logits, nan=-math.inf, posinf=_FMAX)


def banned_ngram_tokens(seen: list[int], n: int) -> set[int]:
    """Tokens that would complete an n-gram already present in `seen` (None entries = unknown)."""
    if len(seen) < n or any(t is None for t in seen[len(seen) - (n - 1) :]):
        return set()
    prefix = tuple(seen[len(seen) - (n - 1) :]) if n > 1 else ()
    banned = set()
    for j in range(len(seen) - n + 1):
        gram = seen[j : j + n]
        if None in gram:
            continue
        if tuple(gram[:-1]) == prefix:
            banned.add(gram[-1])
    return banned


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to fp32 logits [N, V] (sampling only)."""
    # shifted so the largest is 0 first: a tiny temperature sends the others to -inf, never the max to +inf
    # (a temperature below fp32's range is floored, since dividing by a zero would give NaN)
    logits = (logits - logits.amax(-1, keepdim=True)) / max(params.temperature, 1e-30)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest set reaching top_p
        drop[..., 0] = False  # and always the most likely token (a top_p below fp32's range rounds to 0)
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(-1, order, sorted_logits)
    return logits


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Processed logits [N, V] -> the greedy tokens [N], as `propose` chooses them (the argmax of the
    softmax: where two logits round to one probability, the first), without the confidences."""
    return logits.softmax(-1).argmax(-1)


def propose(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Processed logits [N, V] -> (tokens [N], confidences [N]) per `params.confidence`.

    Greedy takes the argmax; sampling draws from the filtered distribution. Confidence is measured
    on the distribution the token was drawn from: prob = p(token); margin = p1 - p2;
    entropy = exp(-H) (1 for a certain prediction), so the same threshold scale applies to all three.
    with_entropy: also return each position's entropy H (nats) [N]."""
    if params.greedy:
        probs = logits.softmax(-1)
        tokens = probs.argmax(-1)  # `greedy_tokens`
    else:
        probs = filter_logits(logits, params).softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1) if with_entropy or params.confidence == "entropy" else None
    if params.confidence == "prob":
        conf = probs.gather(-1, tokens[:, None]).squeeze(-1)
    elif params.confidence == "margin":
        top2 = probs.topk(2, dim=-1).values
        conf = top2[:, 0] - top2[:, 1]
    else:
        conf = torch.exp(-ent)
    return (tokens, conf, ent) if with_entropy else (tokens, conf)
