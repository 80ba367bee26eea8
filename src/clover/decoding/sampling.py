"""Decoding parameters, logits processing, sampling and confidence — shared by every strategy."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

CONFIDENCE_KINDS = ("prob", "margin", "entropy")
MODES = ("ar", "diffusion", "naive", "speculative")


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
    eos_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    # diffusion
    block_size: int | None = None  # None: the model's config
    threshold: float | None = None  # None: the model's config
    confidence: str = "prob"
    expert_budget: int | None = None
    # speculative
    draft_length: int | None = None

    def validate(self) -> "SamplingParams":
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        if self.stop is None:  # as in the OpenAI API: null = no stop strings
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            bad("max_new_tokens", f"must be an integer >= 0, got {self.max_new_tokens!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            bad("top_k", f"must be >= 0 (0 = off), got {self.top_k!r}")
        if not (self.repetition_penalty > 0):
            bad("repetition_penalty", f"must be > 0 (1 = off), got {self.repetition_penalty!r}")
        if self.no_repeat_ngram_size < 0:
            bad("no_repeat_ngram_size", f"must be >= 0, got {self.no_repeat_ngram_size!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size <= 0):
            bad("block_size", f"must be a positive integer, got {self.block_size!r}")
        if self.threshold is not None and not (self.threshold > 0):
            bad("threshold", f"must be > 0 (values > 1 decode one token per step), got {self.threshold!r}")
        if self.confidence not in CONFIDENCE_KINDS:
            bad("confidence", f"must be one of {', '.join(CONFIDENCE_KINDS)}, got {self.confidence!r}")
        if self.draft_length is not None and self.draft_length <= 0:
            bad("draft_length", f"must be a positive integer, got {self.draft_length!r}")
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


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(int(seed))


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
    if history is not None and (params.repetition_penalty != 1.0 or params.presence_penalty):
        for n, seen in enumerate(history):
            known = {t for t in seen if t is not None}
            if not known:
                continue
            ids = torch.tensor(sorted(known), dtype=torch.long, device=logits.device)
            row = logits[n, ids]
            if params.repetition_penalty != 1.0:
                row = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
            logits[n, ids] = row - params.presence_penalty
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
    return logits


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
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(-1, order, sorted_logits)
    return logits


def propose(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed logits [N, V] -> (tokens [N], confidences [N]) per `params.confidence`.

    Greedy takes the argmax; sampling draws from the filtered distribution. Confidence is measured
    on the distribution the token was drawn from: prob = p(token); margin = p1 - p2;
    entropy = exp(-H) (1 for a certain prediction), so the same threshold scale applies to all three."""
    if params.greedy:
        probs = logits.softmax(-1)
        tokens = probs.argmax(-1)
    else:
        probs = filter_logits(logits, params).softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if params.confidence == "prob":
        conf = probs.gather(-1, tokens[:, None]).squeeze(-1)
    elif params.confidence == "margin":
        top2 = probs.topk(2, dim=-1).values
        conf = top2[:, 0] - top2[:, 1]
    else:
        ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        conf = torch.exp(-ent)
    return tokens, conf
