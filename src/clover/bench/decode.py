"""`clover bench decode`: every decoding mode on the same weights and the same held-out prompts.

Workloads (each answer is decoded to its end, as a user would stop it, unless `Workload.to_end` is
off: then every prompt runs to `max_new_tokens`, past its answer)
- `tasks`: held-out task prompts (`assert <expr> == `); the answer is the rest of the line: generation
  stops at the first newline, and the answer is scored by exact match (`check_answer`).
- `code`: held-out `def` headers from the stdlib split; generation stops where the next definition
  at the header's level (or an outer one) begins (`code_stops`); the generated body is cut where the
  function ends (first line indented at or left of the header) and, when the length limit cut it, trimmed to
  whole statements (the last partial line and, if that still does not parse, the last body-level
  statement are dropped). Reported: parse rate (`ast.parse` of header + body) and edit similarity
  (`difflib.SequenceMatcher.ratio`) to the held-out body — the whole body when the generation ended
  the function, else the body's first lines, as many as were generated.
- `chat` (`clover bench chat`, `bench.chat.chat_items`): held-out questions with known answers through
  the model's chat template; a reply is right when it contains an accepted answer.
- `json`: held-out JSON Schemas of the kinds agents send (nested objects, enums, arrays, numbers
  with ranges, strings with patterns, optional fields), each generation constrained by its schema
  (`response_format`). Reported: validity (parses and matches the schema), the share of tokens the
  grammar forced (placed without a model decision: diffusion), and the grammar's time per forward
  against the forward's.

Protocol: greedy, batch 1, one warm-up generation per mode, then for each prompt every mode in turn
(interleaved, so background load on a shared machine hits all modes alike). Per mode: tokens/s over
prompts (median, IQR, min/max), total forwards, tokens/forward, ms/forward, cache bytes (and CUDA
peak memory), experts touched, quality, and ratios to AR.
"""

from __future__ import annotations

import ast
import difflib
import textwrap
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch

from ..decoding import get_mode, mode_names
from .common import config_summary, machine, max_rss_bytes, spread, synchronize, timed

SCHEMA = "clover.bench.decode/1"
WORKLOADS = ("tasks", "code", "both", "json")


# ------------------------------------------------------------------------------ workloads
@dataclass
class Item:
    workload: str  # "tasks" | "code" | "json" | "chat"
    prompt: str | list[int]  # text, or token ids (chat: the templated conversation)
    reference: str  # the task's answer, or the held-out function body
    task: object = None  # clover.data.tasks.Task (tasks), clover.data.instructions.Question (chat)
    schema: dict | None = None  # the json workload: the schema the output must match
    stop: list[str] | None = None  # where the answer ends (tasks: the line; code: the next definition)

    def as_dict(self) -> dict:
        d = {"workload": self.workload, "prompt": self.prompt, "reference": self.reference}
        return d | ({"schema": self.schema} if self.schema is not None else {}) | ({"stop": self.stop} if self.stop else {})


def code_stops(header: str) -> list[str]:
    """Stop strings that end a generated function body: the next definition (or decorator) at the
    header's own indent, or at the top level."""
    first = header.splitlines()[0] if header.strip() else ""
    indents = {"", first[: len(first) - len(first.lstrip(" \t"))]}
    return sorted(f"\n{ind}{kw}" for ind in indents for kw in ("def ", "async def ", "class ", "@"))


# held out: never used to tune anything; the kinds of schema agents send
JSON_SCHEMAS = [
    ("Call a tool to read the first lines of a file.", {"type": "object", "properties": {
        "name": {"enum": ["read_file", "search", "run_python"]},
        "arguments": {"type": "object", "properties": {
            "path": {"type": "string", "pattern": "^[a-z][a-z0-9_/]{0,20}\\.py$"},
            "max_lines": {"type": "integer", "minimum": 1, "maximum": 500}},
            "required": ["path"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False}),
    ("Describe the user as JSON.", {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
            "required": ["name", "age"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False}),
    ("List the order's items.", {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0, "maximum": 1000}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}}},
        "required": ["order_id", "items"], "additionalProperties": False}),
    ("Classify the ticket.", {"type": "object", "properties": {
        "priority": {"enum": ["low", "medium", "high", "urgent"]},
        "labels": {"type": "array", "items": {"enum": ["bug", "feature", "docs", "question"]}, "maxItems": 3},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "assignee": {"type": "string", "maxLength": 12}},
        "required": ["priority", "labels", "confidence"], "additionalProperties": False}),
    ("Search the code base.", {"type": "object", "properties": {
        "name": {"const": "search"},
        "arguments": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 24},
            "case_sensitive": {"type": "boolean"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
            "required": ["query"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False}),
    ("Report the weather.", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
        "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
        "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 300}},
        "required": ["city", "date", "temperature_c", "conditions"], "additionalProperties": False}),
]


def json_items(n: int) -> list[Item]:
    """n items of the json workload (the schemas in turn)."""
    out = []
    for i in range(n):
        prompt, schema = JSON_SCHEMAS[i % len(JSON_SCHEMAS)]
        out.append(Item("json", f"{prompt}\nJSON:", "", schema=schema))
    return out


def json_valid(schema: dict, text: str) -> bool:
    """The text parses as JSON and matches the schema (jsonschema when installed, else parse only)."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def load_items(workload: str, n: int, *, seed: int = 0) -> list[Item]:
    """n held-out prompts per workload ("both": n of each, tasks first)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload: must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    if n <= 0:
        raise ValueError(f"prompts: must be a positive integer, got {n}")
    items: list[Item] = []
    if workload in ("tasks", "both"):
        from ..data.tasks import heldout_tasks

        items += [Item("tasks", t.prompt, t.answer, t, stop=["\n"]) for t in heldout_tasks(n)]
    if workload in ("code", "both"):
        from ..data.corpus import heldout_functions

        items += [Item("code", h, b, stop=code_stops(h)) for h, b in heldout_functions(n, seed=seed)]
    if workload == "json":
        items += json_items(n)
    return items


# -------------------------------------------------------------------------------- scoring
def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _parses(src: str) -> bool:
    try:
        ast.parse(textwrap.dedent(src))
        return True
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False


def trim_body(header: str, text: str, *, truncated: bool) -> tuple[str, bool, bool]:
    """Generated continuation of `header` -> (body, parses, ended).

    `ended`: the function visibly ended (a line at or left of the header's indent) or generation
    stopped on its own; `truncated`: the length limit cut it (the last line may be partial)."""
    h_ind = _indent(header.splitlines()[0]) if header.strip() else 0
    lines = text.split("\n")
    if truncated and lines:
        lines = lines[:-1]  # the partial last line (or the empty string after a final newline)
    body_lines: list[str] = []
    ended = not truncated
    for ln in lines:
        if ln.strip() and _indent(ln) <= h_ind:
            ended = True
            break
        body_lines.append(ln)
    while body_lines and not body_lines[-1].strip():
        body_lines.pop()
    if not any(ln.strip() for ln in body_lines):
        return "", False, ended
    body = "\n".join(body_lines) + "\n"
    if _parses(header + body):
        return body, True, ended
    if not ended:  # drop the last body-level statement: the limit may have cut it mid-way
        b_ind = min(_indent(ln) for ln in body_lines if ln.strip())
        starts = [i for i, ln in enumerate(body_lines) if ln.strip() and _indent(ln) == b_ind]
        if len(starts) > 1:
            cut = "\n".join(body_lines[: starts[-1]]).rstrip("\n") + "\n"
            if _parses(header + cut):
                return cut, True, ended
    return body, False, ended


def score(item: Item, text: str, finish_reason: str) -> dict:
    if item.workload == "json":
        return {"valid": json_valid(item.schema, text), "finish_reason": finish_reason}
    if item.workload == "chat":
        return {"correct": item.task.check(text), "kind": item.task.kind}
    if item.workload == "tasks":
        from ..data.tasks import check_answer

        return {"exact": bool(check_answer(item.task, text)), "answer": text.split("\n", 1)[0], "kind": item.task.kind}
    body, ok, ended = trim_body(item.prompt, text, truncated=finish_reason == "length")
    ref = item.reference
    if not ended:
        n = max(1, len(body.splitlines()))
        ref = "".join(item.reference.splitlines(keepends=True)[:n])
    sim = difflib.SequenceMatcher(None, body, ref).ratio() if body else 0.0
    return {"parses": ok, "similarity": round(sim, 4), "ended": ended}


def by_kind(runs: list[dict], hit: str, name: str) -> dict:
    """Per question kind (`score["kind"]`): how many, the share with `score[hit]` true (as `name`),
    tokens/forward."""
    kinds: dict[str, list[dict]] = {}
    for r in runs:
        kinds.setdefault(r["score"].get("kind", "?"), []).append(r)
    return {k: {"n": len(rs), name: sum(r["score"][hit] for r in rs) / len(rs),
                "tokens_per_forward": sum(r["tokens"] for r in rs) / max(1, sum(r["forwards"] for r in rs))}
            for k, rs in sorted(kinds.items())}


def quality(runs: list[dict]) -> dict:
    """Quality of one mode's runs, per workload."""
    out: dict = {}
    task_runs = [r for r in runs if r["workload"] == "tasks"]
    tasks = [r["score"] for r in task_runs]
    code = [r["score"] for r in runs if r["workload"] == "code"]
    chat = [r for r in runs if r["workload"] == "chat"]
    if chat:
        out["chat"] = {"n": len(chat), "accuracy": sum(r["score"]["correct"] for r in chat) / len(chat),
                       "by_kind": by_kind(chat, "correct", "accuracy")}
    js = [r for r in runs if r["workload"] == "json"]
    if js:
        tokens = sum(r["tokens"] for r in js)
        forwards = sum(r["forwards"] for r in js)
        out["json"] = {
            "n": len(js),
            "valid": sum(r["score"]["valid"] for r in js) / len(js),
            # outputs the token budget cut before the grammar was complete (a valid prefix)
            "cut_by_length": sum(r["finish_reason"] == "length" for r in js) / len(js),
            "valid_when_finished": (sum(r["score"]["valid"] for r in js if r["finish_reason"] != "length")
                                    / max(1, sum(r["finish_reason"] != "length" for r in js))),
            "grammar_forced_share": sum(r["grammar_forced"] for r in js) / tokens if tokens else 0.0,
            "grammar_ms_per_forward": 1e3 * sum(r["grammar_seconds"] for r in js) / forwards if forwards else None,
        }
    if tasks:
        out["tasks"] = {"n": len(tasks), "exact_match": sum(s["exact"] for s in tasks) / len(tasks),
                        "by_kind": by_kind(task_runs, "exact", "exact_match")}
    if code:
        out["code"] = {
            "n": len(code),
            "parse_rate": sum(s["parses"] for s in code) / len(code),
            "edit_similarity": sum(s["similarity"] for s in code) / len(code),
        }
    return out


# ------------------------------------------------------------------------------- measuring
class CacheProbe:
    """Records the largest decoding cache (bytes) the engines build while active."""

    def __init__(self, model) -> None:
        self.model = model
        self.peak = 0
        self._last = None

    def __enter__(self) -> "CacheProbe":
        original = self.model.make_cache

        def make_cache(batch_size: int, capacity: int):
            cache = original(batch_size, capacity)
            self.peak = max(self.peak, cache.nbytes())
            self._last = cache
            return cache

        self.model.make_cache = make_cache  # instance attribute shadows the method
        return self

    def __exit__(self, *exc) -> None:
        del self.model.make_cache
        if self._last is not None:  # a cache may have grown after it was made
            self.peak = max(self.peak, self._last.nbytes())
        self._last = None


def generate_once(llm, item: Item, mode: str, kwargs: dict) -> dict:
    """One generation with its timing, cache bytes and (CUDA) peak memory."""
    device = llm.model.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if item.stop and "stop" not in kwargs:  # the answer's own end
        kwargs = dict(kwargs, stop=item.stop)
    if item.schema is not None:
        kwargs = dict(kwargs, response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": item.schema}})
    with CacheProbe(llm.model) as probe:
        gen, seconds = timed(lambda: llm.generate(item.prompt, mode=mode, **kwargs), device)
    s = gen.stats
    rec = {
        "workload": item.workload,
        "mode": mode,
        "tokens": s.tokens,
        "forwards": s.forwards,
        "seconds": seconds,
        "tokens_per_second": s.tokens / seconds if seconds > 0 else 0.0,
        "tokens_per_forward": s.tokens / s.forwards if s.forwards else 0.0,
        "experts_touched": s.experts_touched,
        "block_steps": list(s.block_steps),
        "forced_steps": s.forced_steps,
        "forced_tokens": list(gen.forced_tokens),
        "accept_lengths": list(s.accept_lengths),
        "grammar_forced": s.grammar_forced,
        "grammar_seconds": s.grammar_seconds,
        "draft_forwards": s.draft_forwards,
        "finish_reason": gen.finish_reason,
        "cache_bytes": probe.peak,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "text": gen.text,
        "token_ids": list(gen.token_ids),
    }
    rec["score"] = score(item, gen.text, gen.finish_reason)
    return rec


def summarize(runs: list[dict], modes: Iterable[str], key: str = "mode") -> dict:
    """Per-mode aggregates and ratios to AR from the per-(prompt, mode) records. `key` names the
    record field that groups runs (the sweep groups by configuration label; "ar" is the baseline)."""
    modes = list(modes)
    per: dict[str, dict] = {}
    for m in modes:
        rs = [r for r in runs if r[key] == m]
        if not rs:
            continue
        tokens = sum(r["tokens"] for r in rs)
        forwards = sum(r["forwards"] for r in rs)
        seconds = sum(r["seconds"] for r in rs)
        et = [r["experts_touched"] for r in rs if r["experts_touched"] is not None]
        cuda = [r["cuda_peak_bytes"] for r in rs if r["cuda_peak_bytes"] is not None]
        per[m] = {
            "prompts": len(rs),
            "tokens": tokens,
            "forwards": forwards,
            "seconds": seconds,
            "tokens_per_forward": tokens / forwards if forwards else 0.0,
            "ms_per_forward": 1e3 * seconds / forwards if forwards else None,
            "tokens_per_second": dict(spread([r["tokens_per_second"] for r in rs]),
                                      aggregate=tokens / seconds if seconds > 0 else 0.0),
            "experts_touched": sum(et) / len(et) if et else None,
            # tokens gained per verify (speculative, dflash: accepted drafts + the model's own token)
            "accepted_length": sum(sum(r.get("accept_lengths", ())) for r in rs) / n_acc
            if (n_acc := sum(len(r.get("accept_lengths", ())) for r in rs)) else None,
            "draft_forwards": sum(r.get("draft_forwards", 0) for r in rs),
            # share of forwards that committed one position below the threshold (diffusion, naive)
            "forced_share": sum(r["forced_steps"] for r in rs) / forwards
            if forwards and get_mode(s_mode(m, runs, key)).threshold_commit else None,
            "cache_bytes": max(r["cache_bytes"] for r in rs),
            "cuda_peak_bytes": max(cuda) if cuda else None,
            "quality": quality(rs),
        }
    if "ar" in per:
        ar = per["ar"]
        ar_by_item = {r.get("item", i): r for i, r in enumerate(r for r in runs if r[key] == "ar")}
        for m, s in per.items():
            mine = {r.get("item", i): r for i, r in enumerate(r for r in runs if r[key] == m)}
            pairs = [(ar_by_item[k], b) for k, b in mine.items() if k in ar_by_item]
            paired = [b["tokens_per_second"] / a["tokens_per_second"] for a, b in pairs if a["tokens_per_second"] > 0]
            s["vs_ar"] = {
                "tokens_per_second": s["tokens_per_second"]["aggregate"] / ar["tokens_per_second"]["aggregate"]
                if ar["tokens_per_second"]["aggregate"] else None,
                "tokens_per_second_paired_median": spread(paired)["median"],
                "forwards": s["forwards"] / ar["forwards"] if ar["forwards"] else None,
                "tokens_per_forward": s["tokens_per_forward"] / ar["tokens_per_forward"] if ar["tokens_per_forward"] else None,
            }
            mode = get_mode(s_mode(m, runs, key))
            if mode.reference == "ar":  # lossless: its greedy tokens must be AR's
                same = [a["token_ids"] == b["token_ids"] for a, b in pairs]
                s["matches_ar"] = sum(same) / len(same) if same else None
            elif mode.threshold_commit and pairs:
                s["vs_ar"]["divergence"] = divergence(pairs)
    return per


def divergence(pairs: list[tuple[dict, dict]]) -> dict:
    """Where a threshold decode leaves greedy AR on the same prompt: the share of prompts whose tokens
    differ, and of those the share whose first differing token was a forced commit (no position had
    reached the threshold). A high forced share says the gap is in the steps the model was unsure of."""
    diverged = at_forced = 0
    for a, b in pairs:
        x, y = a["token_ids"], b["token_ids"]
        if x == y:
            continue
        diverged += 1
        first = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        at_forced += first in set(b.get("forced_tokens", ()))
    return {"prompts": len(pairs), "diverged": diverged / len(pairs),
            "first_at_forced_commit": at_forced / diverged if diverged else None}


def s_mode(label: str, runs: list[dict], key: str) -> str | None:
    """The decoding mode behind a group label."""
    for r in runs:
        if r[key] == label:
            return r["mode"]
    return None


# ----------------------------------------------------------------------------------- driver
def usable_modes(llm, modes: Iterable[str]) -> tuple[list[str], list[str]]:
    modes = list(dict.fromkeys(modes))
    for m in modes:
        get_mode(m)  # ValueError naming the registered modes
    return [m for m in modes if llm.mode_available(m)], [m for m in modes if not llm.mode_available(m)]


@dataclass(frozen=True)
class Workload:
    """What the decode, sweep and experts benchmarks generate from: `prompts` held-out prompts of a
    kind (`load_items`; or the `items` given), `max_new_tokens` each, greedy; each answer decoded to
    its end (the item's own stop) unless `to_end` is off, every generation stopped at the first
    newline when `stop_newline`."""

    kind: str = "tasks"
    prompts: int = 8
    max_new_tokens: int = 64
    stop_newline: bool = False
    items: list[Item] | None = None
    to_end: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens: must be a positive integer, got {self.max_new_tokens}")

    def load(self) -> list[Item]:
        items = self.items if self.items is not None else load_items(self.kind, self.prompts)
        return items if self.to_end else [replace(it, stop=None) for it in items]

    def kwargs(self, block_size: int | None = None, threshold: float | None = None) -> dict:
        """The generation options of one run (block size and threshold: None, the model's)."""
        kw: dict = {"max_new_tokens": self.max_new_tokens}
        if block_size is not None:
            kw["block_size"] = block_size
        if threshold is not None:
            kw["threshold"] = threshold
        if self.stop_newline:
            kw["stop"] = ["\n"]
        return kw

    def settings(self, items: list[Item]) -> dict:
        """The result's record of it."""
        return {"workload": self.kind, "prompts": len(items), "max_new_tokens": self.max_new_tokens,
                "stop_newline": self.stop_newline, "to_end": self.to_end}


def interleaved(llm, items: list[Item], configs: list[dict], kwargs: Callable[[dict], dict], *, warm_tokens: int,
                warm: Callable[[dict], bool] | bool = True, keep_text: bool = True,
                progress: Callable[[str], None] | None = None) -> list[dict]:
    """Every prompt through each configuration (a dict with `mode`, and `label` when several share a
    mode) in turn, interleaved so that drift hits all alike, after one short warm-up generation
    (`warm_tokens`) of each configuration `warm` selects. One `generate_once` record per (prompt,
    configuration), with `item` (and `label`)."""
    if warm and items:
        for c in configs:
            if warm is True or warm(c):
                llm.generate(items[0].prompt, mode=c["mode"], **dict(kwargs(c), max_new_tokens=warm_tokens))
        synchronize(llm.model.device)
    runs = []
    for i, item in enumerate(items):
        for c in configs:
            rec = generate_once(llm, item, c["mode"], kwargs(c))
            rec["item"] = i
            if "label" in c:
                rec["label"] = c["label"]
            if not keep_text:
                rec.pop("text", None)
            runs.append(rec)
        if progress:
            progress(f"prompt {i + 1}/{len(items)}")
    return runs


def run_decode(llm, work: Workload = Workload("both"), *, modes: Iterable[str] | None = None, block_size: int | None = None,
               threshold: float | None = None, warmup: bool = True, progress: Callable[[str], None] | None = None,
               model_note: str | None = None) -> dict:
    """The decode benchmark; returns the JSON-ready result (schema `SCHEMA`). `block_size` /
    `threshold` None: each mode runs with its own defaults (the model's block size and acceptance
    policy; speculative's adaptive draft), as a user's `generate` does."""
    modes, skipped = usable_modes(llm, mode_names() if modes is None else modes)
    if not modes:
        raise ValueError("modes: none of the requested modes can run on this (AR-only) checkpoint")
    items = work.load()
    kw = work.kwargs(block_size, threshold)
    defaults = block_size is None and threshold is None
    block_size = block_size if block_size is not None else llm.config.block_size
    threshold = threshold if threshold is not None else llm.config.threshold
    runs = interleaved(llm, items, [{"mode": m} for m in modes], lambda c: kw, warm=warmup,
                       warm_tokens=min(work.max_new_tokens, 2 * block_size), progress=progress)
    return {
        "schema": SCHEMA,
        "model": str(llm.path),
        "model_note": model_note,
        "config": config_summary(llm.config, str(llm.model.dtype).replace("torch.", "")),
        "settings": {
            **work.settings(items), "modes": modes, "skipped_modes": skipped, "block_size": block_size,
            "threshold": threshold, "defaults": defaults, "policy": llm.config.policy if defaults else None,
            "greedy": True, "batch_size": 1, "interleaved": True, "warmup": warmup,
        },
        "machine": machine(llm.model.device),
        "max_rss_bytes": max_rss_bytes(),
        "modes": summarize(runs, modes),
        "items": [it.as_dict() for it in items],
        "runs": runs,
    }


# ---------------------------------------------------------------------------------- output
def fmt(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def quality_text(q: dict) -> str:
    parts = []
    if "chat" in q:
        parts.append(f"accuracy {q['chat']['accuracy']:.0%}")
    if "tasks" in q:
        parts.append(f"EM {q['tasks']['exact_match']:.0%}")
    if "code" in q:
        parts.append(f"parse {q['code']['parse_rate']:.0%} · sim {q['code']['edit_similarity']:.2f}")
    if "json" in q:
        j = q["json"]
        parts.append(f"valid {j['valid']:.0%} (cut by length {j['cut_by_length']:.0%}) · "
                     f"grammar-forced {j['grammar_forced_share']:.0%} · "
                     f"grammar {fmt(j['grammar_ms_per_forward'], '.2f')} ms/fwd")
    return " · ".join(parts) or "-"


def options_label(s: dict) -> str:
    """A result's block size and threshold as run: given to every mode, or each mode's own defaults."""
    if s.get("defaults"):
        return (f"each mode's defaults (the model's block {s['block_size']}, {s.get('policy')} policy, "
                f"threshold {s['threshold']})")
    return f"block {s['block_size']} · threshold {s['threshold']}"


def decode_table(result: dict):
    """A rich Table of the per-mode summary."""
    from rich.table import Table

    s = result["settings"]
    note = f" ({result['model_note']})" if result.get("model_note") else ""
    title = (f"clover bench decode · {result['model']}{note} · {s['workload']} · {s['prompts']} prompts · "
             f"{s['max_new_tokens']} new tokens · {options_label(s)}")
    t = Table(title=title, title_justify="left")
    for col in ("mode", "tok/s median", "IQR", "×AR", "forwards", "tok/fwd", "acc len", "forced", "ms/fwd", "experts",
                "cache MiB", "quality"):
        t.add_column(col, justify="left" if col in ("mode", "quality") else "right")
    for m, r in result["modes"].items():
        tps = r["tokens_per_second"]
        vs = r.get("vs_ar", {})
        mem = r["cuda_peak_bytes"] if r["cuda_peak_bytes"] is not None else r["cache_bytes"]
        q = quality_text(r["quality"])
        if "matches_ar" in r:
            q += f" · =AR {r['matches_ar']:.0%}"
        d = vs.get("divergence")
        if d:
            q += f" · ≠AR {d['diverged']:.0%}" + (f" ({d['first_at_forced_commit']:.0%} at forced)"
                                                   if d["first_at_forced_commit"] is not None else "")
        t.add_row(
            m, fmt(tps["median"], ".1f"), f"{fmt(tps['q1'], '.1f')}–{fmt(tps['q3'], '.1f')}",
            fmt(vs.get("tokens_per_second"), ".2f"),
            str(r["forwards"]) + (f" +{r['draft_forwards']} draft" if r.get("draft_forwards") else ""),
            fmt(r["tokens_per_forward"]), fmt(r.get("accepted_length")), fmt(r["forced_share"], ".0%"), fmt(r["ms_per_forward"], ".1f"), fmt(r["experts_touched"], ".1f"),
            f"{mem / 2**20:.2f}", q,
        )
    return t


def plot_decode(result: dict, directory) -> str:
    """decode.png in `directory`: tokens/s (median, IQR bars) and tokens/forward per mode."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    modes = list(result["modes"])
    rs = [result["modes"][m] for m in modes]
    med = [r["tokens_per_second"]["median"] for r in rs]
    lo = [m - r["tokens_per_second"]["q1"] for m, r in zip(med, rs)]
    hi = [r["tokens_per_second"]["q3"] - m for m, r in zip(med, rs)]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3), dpi=100)
    a1.bar(modes, med, yerr=[lo, hi], color="#4c72b0", capsize=3)
    a1.set_ylabel("tokens/s (median, IQR)")
    a2.bar(modes, [r["tokens_per_forward"] for r in rs], color="#55a868")
    a2.set_ylabel("tokens / forward")
    for ax, r_vals in ((a2, rs),):
        for x, r in enumerate(r_vals):
            ax.text(x, r["tokens_per_forward"], quality_text(r["quality"]).replace(" · ", "\n"),
                    ha="center", va="bottom", fontsize=6)
    note = f" ({result['model_note']})" if result.get("model_note") else ""
    fig.suptitle(f"{Path(result['model']).name}{note} · {result['settings']['workload']} · "
                 f"{result['machine']['device']} ({result['machine']['torch_threads']} threads)", fontsize=8)
    fig.tight_layout()
    path = d / "decode.png"
    fig.savefig(path)
    plt.close(fig)
    return str(path)
