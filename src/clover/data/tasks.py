"""Verifiable, code-shaped tasks: one ``assert <expr> == <answer>`` per line.

Example line::

    assert sorted([31, 7, 19]) == [7, 19, 31]

The *prompt* is everything up to and including ``"== "``; the *answer* is the
rest of the line (a Python literal).  Answers are computed by construction
with ordinary Python semantics, and a model's continuation is checked with
:func:`check_answer`, which only parses literals (``ast.literal_eval``) and
never evaluates code.

Held-out tasks come from :data:`HELDOUT_SEED`; the first :data:`HELDOUT_N`
distinct held-out prompts are excluded from every training stream
(:func:`train_tasks`, :func:`iter_tasks` with ``exclude_heldout=True``).
"""

from __future__ import annotations

import ast
import random
import string
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable, Iterator

TRAIN_SEED = 1234
HELDOUT_SEED = 987654321
HELDOUT_N = 5000  # size of the canonical held-out set excluded from training

PROMPT_SEP = "== "
# Bumped when the generators change what a seed produces (a stream saved under another version is
# not resumed silently). 2: a quarter of the lists hold single digits.
TASKS_VERSION = 2
SMALL_LIST_FRACTION = 0.25


@dataclass(frozen=True)
class Task:
    prompt: str  # ends with "== "
    answer: str  # a Python literal, no newline
    kind: str


def task_line(task: Task) -> str:
    """The full line (without trailing newline): ``prompt + answer``."""
    return task.prompt + task.answer


def _ints(rng: random.Random, lo: int = 2, hi: int = 8, below: int | None = None) -> list[int]:
    """lo..hi integers below `below`; by default below 100, or for SMALL_LIST_FRACTION of the lists
    single digits (models trained on two-digit lists alone sort `[9, 2, 5]` wrongly)."""
    if below is None:
        below = 10 if rng.random() < SMALL_LIST_FRACTION else 100
    return [rng.randrange(below) for _ in range(rng.randint(lo, hi))]


def _mk(kind: str, expr: str, value: object) -> Task:
    return Task(prompt=f"assert {expr} {PROMPT_SEP}", answer=repr(value), kind=kind)


def _sorted(rng):
    xs = _ints(rng)
    return _mk("sorted", f"sorted({xs!r})", sorted(xs))


def _sorted_desc(rng):
    xs = _ints(rng)
    return _mk("sorted_desc", f"sorted({xs!r}, reverse=True)", sorted(xs, reverse=True))


def _add(rng):
    a, b = rng.randrange(1000), rng.randrange(1000)
    return _mk("add", f"{a} + {b}", a + b)


def _sub(rng):
    a, b = rng.randrange(1000), rng.randrange(1000)
    return _mk("sub", f"{a} - {b}", a - b)


def _mul(rng):
    a, b = rng.randrange(100), rng.randrange(10)
    return _mk("mul", f"{a} * {b}", a * b)


def _max(rng):
    xs = _ints(rng)
    return _mk("max", f"max({xs!r})", max(xs))


def _min(rng):
    xs = _ints(rng)
    return _mk("min", f"min({xs!r})", min(xs))


def _reversed(rng):
    xs = _ints(rng)
    return _mk("reversed", f"list(reversed({xs!r}))", xs[::-1])


def _slice_rev(rng):
    xs = _ints(rng)
    return _mk("slice_rev", f"{xs!r}[::-1]", list(reversed(xs)))


def _len(rng):
    xs = _ints(rng)
    return _mk("len", f"len({xs!r})", len(xs))


def _double(rng):
    xs = _ints(rng)
    return _mk("double", f"[x * 2 for x in {xs!r}]", [x * 2 for x in xs])


def _sum(rng):
    xs = _ints(rng)
    return _mk("sum", f"sum({xs!r})", sum(xs))


def _set_len(rng):
    xs = _ints(rng, below=10)  # small range so duplicates are common
    return _mk("set_len", f"len(set({xs!r}))", len(set(xs)))


def _index(rng):
    xs = _ints(rng)
    i = rng.randrange(len(xs))
    return _mk("index", f"{xs!r}[{i}]", xs[i])


def _dict_get(rng):
    keys = rng.sample(string.ascii_lowercase, rng.randint(2, 5))
    d = {k: rng.randrange(100) for k in keys}
    k = rng.choice(keys)
    body = ", ".join(f'"{kk}": {v}' for kk, v in d.items())
    return _mk("dict_get", f'{{{body}}}["{k}"]', d[k])


GENERATORS: dict[str, Callable[[random.Random], Task]] = {
    "sorted": _sorted,
    "sorted_desc": _sorted_desc,
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "max": _max,
    "min": _min,
    "reversed": _reversed,
    "slice_rev": _slice_rev,
    "len": _len,
    "double": _double,
    "sum": _sum,
    "set_len": _set_len,
    "index": _index,
    "dict_get": _dict_get,
}
KINDS: tuple[str, ...] = tuple(GENERATORS)


def check_task_weights(weights: dict[str, float] | None) -> dict[str, float] | None:
    """Validate per-kind sampling weights (unlisted kinds weigh 1); None or {} = uniform."""
    if not weights:
        return None
    unknown = sorted(set(weights) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown task kind(s) {unknown}; known: {', '.join(KINDS)}")
    bad = {k: w for k, w in weights.items() if not (isinstance(w, (int, float)) and w >= 0)}
    if bad:
        raise ValueError(f"task weights must be numbers >= 0, got {bad}")
    full = {k: float(weights.get(k, 1.0)) for k in KINDS}
    if sum(full.values()) <= 0:
        raise ValueError("task weights are all zero")
    return full


def sample_task(rng: random.Random, weights: dict[str, float] | None = None) -> Task:
    """One task drawn with ``rng``: kind uniform, or by ``weights`` (a full map from
    :func:`check_task_weights`; training mixes only -- held-out tasks are always uniform)."""
    if weights is None:
        kind = rng.choice(KINDS)
    else:
        kind = rng.choices(KINDS, weights=[weights[k] for k in KINDS])[0]
    return GENERATORS[kind](rng)


def generate_tasks(n: int, seed: int, exclude: Iterable[str] | None = None) -> list[Task]:
    """``n`` tasks drawn deterministically from ``seed``.

    Tasks whose prompt is in ``exclude`` are skipped (and replaced by further
    draws), so exactly ``n`` tasks are returned.  Duplicates are possible.
    """
    ex = frozenset(exclude) if exclude is not None else frozenset()
    rng = random.Random(seed)
    out: list[Task] = []
    while len(out) < n:
        t = sample_task(rng)
        if t.prompt not in ex:
            out.append(t)
    return out


@lru_cache(maxsize=1)
def _heldout_all() -> tuple[Task, ...]:
    rng = random.Random(HELDOUT_SEED)
    seen: set[str] = set()
    out: list[Task] = []
    while len(out) < HELDOUT_N:
        t = sample_task(rng)
        if t.prompt not in seen:
            seen.add(t.prompt)
            out.append(t)
    return tuple(out)


def heldout_tasks(n: int = HELDOUT_N) -> list[Task]:
    """The first ``n`` (<= HELDOUT_N) distinct held-out tasks (seed HELDOUT_SEED)."""
    if n > HELDOUT_N:
        raise ValueError(f"at most HELDOUT_N={HELDOUT_N} held-out tasks are reserved")
    return list(_heldout_all()[:n])


@lru_cache(maxsize=1)
def heldout_prompts() -> frozenset[str]:
    """Prompts of all reserved held-out tasks; never emitted for training."""
    return frozenset(t.prompt for t in _heldout_all())


def train_tasks(n: int, seed: int = TRAIN_SEED) -> list[Task]:
    """``n`` training tasks from ``seed`` with held-out prompts excluded."""
    return generate_tasks(n, seed, exclude=heldout_prompts())


def iter_tasks(rng: random.Random, exclude_heldout: bool = True, weights: dict[str, float] | None = None) -> Iterator[Task]:
    """Endless task stream drawn from ``rng`` (held-out prompts skipped), kinds by ``weights``."""
    ex = heldout_prompts() if exclude_heldout else frozenset()
    w = check_task_weights(weights)
    while True:
        t = sample_task(rng, w)
        if t.prompt not in ex:
            yield t


def _same(a: object, b: object) -> bool:
    """Equality that also requires equal types (so ``True != 1``, ``1.0 != 1``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)  # type: ignore[union-attr,index]
    return a == b


def parse_answer(text: str) -> tuple[bool, object]:
    """Parse a continuation: cut at the first newline, strip, literal-eval.

    Returns ``(ok, value)``; ``ok`` is False if it does not parse as a literal.
    """
    line = text.split("\n", 1)[0].strip()
    if not line or len(line) > 10_000:
        return False, None
    try:
        return True, ast.literal_eval(line)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False, None


def check_answer(task: Task, text: str) -> bool:
    """True iff the model continuation ``text`` (after the prompt) is correct.

    Only the first line counts; it must be a Python literal equal to (and of
    the same type as) the task's answer.  Nothing is ever evaluated.
    """
    ok, value = parse_answer(text)
    if not ok:
        return False
    return _same(value, ast.literal_eval(task.answer))
