"""Grammar specs, their compilation for a tokenizer (llguidance), and the per-row matcher."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")
COMPILE_TIMEOUT_S = 5.0  # a grammar that takes longer to compile is refused
MAX_GRAMMAR_CHARS = 200_000  # a schema / grammar text longer than this is refused before compiling
# llguidance's resource limits: a grammar past them is an error, not a stall
_LIMITS = dict(max_grammar_size=200_000, max_lexer_states=100_000, initial_lexer_fuel=1_000_000,
               step_lexer_fuel=200_000, step_max_items=50_000, verbose_errors=False)
# compact JSON (no whitespace between tokens): the braces, keys, colons and commas a schema fixes
# are then forced, so a diffusion block fills them without a model decision
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The grammar or schema cannot be used: the message says what is wrong ("grammar: ...")."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. kind: json_schema (source: the schema, a dict or its JSON text),
    json_object (any JSON object; no source), regex, lark or gbnf (source: the text)."""

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"grammar: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise GrammarError(f"grammar: the {self.kind} source must be text")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"grammar: the {self.kind} is {len(self.source)} characters; at most {MAX_GRAMMAR_CHARS}")
        if self.kind != "json_object" and not self.source.strip():
            raise GrammarError(f"grammar: the {self.kind} is empty")

    @classmethod
    def json_schema(cls, schema) -> "GrammarSpec":
        if isinstance(schema, (dict, bool)):
            schema = json.dumps(schema)
        elif isinstance(schema, str):
            try:
                parsed = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"grammar: the JSON schema is not valid JSON ({e})") from None
            if not isinstance(parsed, (dict, bool)):
                raise GrammarError("grammar: a JSON schema must be a JSON object")
        else:
            raise GrammarError(f"grammar: a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", schema)

    @classmethod
    def from_file(cls, path: str | Path, kind: str | None = None) -> "GrammarSpec":
        """A grammar from a file: kind from the suffix when not given (.json: a JSON schema, .lark,
        .gbnf, .regex / .re)."""
        path = Path(path)
        if kind is None:
            kind = {".json": "json_schema", ".lark": "lark", ".gbnf": "gbnf", ".regex": "regex", ".re": "regex"}.get(
                path.suffix.lower())
            if kind is None:
                raise GrammarError(f"grammar: {path}: cannot tell the grammar kind from the suffix; "
                                   "use .json (JSON schema), .lark, .gbnf or .regex")
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise GrammarError(f"grammar: cannot read {path}: {e.strerror or e}") from None
        return cls.json_schema(text) if kind == "json_schema" else cls(kind, text)

    @classmethod
    def from_response_format(cls, rf) -> "GrammarSpec | None":
        """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"}, or
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
        if rf is None:
            return None
        if hasattr(rf, "model_dump"):
            rf = rf.model_dump(exclude_none=True, by_alias=True)
        if not isinstance(rf, dict) or "type" not in rf:
            raise GrammarError('response_format: must be an object with a "type" (text, json_object or json_schema)')
        kind = rf["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object")
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise GrammarError('response_format: json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
            return cls.json_schema(js["schema"])
        raise GrammarError(f"response_format: type must be text, json_object or json_schema, got {kind!r}")

    @classmethod
    def coerce(cls, grammar) -> "GrammarSpec":
        """A GrammarSpec as given, or a dict {"json_schema"|"regex"|"lark"|"gbnf"|"json_object": source}."""
        if isinstance(grammar, GrammarSpec):
            return grammar
        if isinstance(grammar, dict) and len(grammar) == 1:
            (kind, src), = grammar.items()
            if kind == "json_schema":
                return cls.json_schema(src)
            if kind == "json_object":
                return cls("json_object")
            return cls(kind, src)
        raise GrammarError("grammar: give a GrammarSpec or a dict with one of "
                           f"{', '.join(KINDS)} mapped to its source, got {type(grammar).__name__}")

    def llguidance(self) -> str:
        """The llguidance grammar text (not yet checked)."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=_JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "gbnf":
            try:
                return llguidance.grammar_from("gbnf", self.source)
            except Exception as e:  # noqa: BLE001 - the converter raises bare exceptions
                raise GrammarError(f"grammar: the GBNF grammar does not parse: {e}") from None
        return llguidance.LLMatcher.grammar_from_lark(self.source)


# ------------------------------------------------------------------ the tokenizer's index
_TOKENIZERS: dict = {}
_TOK_LOCK = threading.Lock()


def _ll_tokenizer(hf_tokenizer, vocab_size: int, eos_ids):
    """llguidance's view of a tokenizer (~1 s to build for a 150k vocabulary: built once per
    tokenizer, vocabulary size and EOS set)."""
    import llguidance.hf

    key = (id(hf_tokenizer), vocab_size, tuple(sorted(eos_ids)))
    with _TOK_LOCK:
        hit = _TOKENIZERS.get(key)
        if hit is None or hit[0] is not hf_tokenizer:
            eos = sorted(eos_ids) or None
            hit = (hf_tokenizer, llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos))
            _TOKENIZERS[key] = hit
        return hit[1]


_POOL = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="clover-grammar")
_COMPILED: "collections.OrderedDict[tuple, CompiledGrammar]" = collections.OrderedDict()
_CACHE_SIZE = 64


def _build(ll_tok, text: str):
    import llguidance

    limits = llguidance.LLParserLimits(**_LIMITS)
    err = llguidance.LLMatcher.validate_grammar(text, ll_tok, limits=limits)
    if err:
        return None, err
    m = llguidance.LLMatcher(ll_tok, text, log_level=0, limits=limits)
    if m.is_error():
        return None, m.get_error()
    return m, ""


def compile_grammar(spec: GrammarSpec, tokenizer, *, vocab_size: int, eos_ids=(),
                    timeout_s: float = COMPILE_TIMEOUT_S) -> "CompiledGrammar":
    """Compile `spec` for `tokenizer` (a clover Tokenizer or a transformers fast tokenizer) whose
    model has `vocab_size` logits; `eos_ids` end the output once the grammar is complete.
    GrammarError when it does not compile, is too large, or takes longer than `timeout_s`
    (compilation runs on a worker thread; recently compiled grammars are reused)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    key = (spec, id(hf), vocab_size, tuple(sorted(eos_ids)))
    hit = _COMPILED.get(key)
    if hit is not None and hit.hf is hf:
        _COMPILED.move_to_end(key)
        return hit
    t0 = time.perf_counter()
    text = spec.llguidance()
    ll_tok = _ll_tokenizer(hf, vocab_size, eos_ids)
    fut = _POOL.submit(_build, ll_tok, text)
    try:
        template, err = fut.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise GrammarError(f"grammar: the {spec.kind} took longer than {timeout_s:g} s to compile; simplify it") from None
    if err:
        raise GrammarError(f"grammar: the {spec.kind.replace('_', ' ')} does not compile: {_short(err)}")
    out = CompiledGrammar(spec, hf, template, vocab_size, time.perf_counter() - t0)
    _COMPILED[key] = out
    while len(_COMPILED) > _CACHE_SIZE:
        _COMPILED.popitem(last=False)
    return out


def _short(err: str) -> str:
    err = " ".join(str(err).split())
    return err if len(err) <= 300 else err[:297] + "..."


class CompiledGrammar:
    """A grammar compiled for one tokenizer; `matcher()` gives each row its own state."""

    def __init__(self, spec: GrammarSpec, hf, template, vocab_size: int, seconds: float) -> None:
        self.spec, self.hf, self.template, self.vocab_size = spec, hf, template, vocab_size
        self.compile_seconds = seconds

    def matcher(self) -> "Constraint":
        return Constraint(self.template.deep_copy(), self.vocab_size)


_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


class Constraint:
    """One row's grammar state: the tokens consumed so far (the row's output). Every call adds its
    time to `seconds` (what `bench decode --workload json` reports as grammar time)."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.m = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.buf = torch.zeros(self.words, dtype=torch.int32)
        self.seconds = 0.0
        self.forced_tokens = 0  # tokens placed because the grammar forced them (diffusion)

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens that keep the output valid next."""
        t = time.perf_counter()
        self.m.unsafe_compute_mask_ptr(self.buf.data_ptr(), self.words * 4)
        out = ((self.buf[:, None] & _BITS) != 0).view(-1)[: self.vocab_size]
        self.seconds += time.perf_counter() - t
        return out

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] with -inf where a token would break the grammar (a new tensor)."""
        allowed = self.allowed().to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))

    def allows(self, token: int) -> bool:
        """Whether `token` keeps the output valid next (one check, no mask)."""
        return self.valid_prefix([token]) == 1

    def argmax(self, logits: torch.Tensor) -> int:
        """The grammar-allowed token of highest logit in logits [V] (or [1, V]): the plain argmax
        when the grammar allows it (no mask is computed), else the argmax of the masked logits."""
        tok = int(logits.argmax())
        return tok if self.allows(tok) else int(self.mask(logits).argmax())

    def consume(self, tokens) -> bool:
        t = time.perf_counter()
        ok = self.m.consume_tokens(list(tokens)) if tokens else True
        self.seconds += time.perf_counter() - t
        return ok

    def valid_prefix(self, tokens) -> int:
        """How many of `tokens`, from the left, keep the output valid (nothing is consumed)."""
        t = time.perf_counter()
        n = self.m.validate_tokens(list(tokens)) if tokens else 0
        self.seconds += time.perf_counter() - t
        return n

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (fast-forward tokens; nothing is consumed)."""
        t = time.perf_counter()
        out = [] if self.m.is_stopped() else list(self.m.compute_ff_tokens())
        self.seconds += time.perf_counter() - t
        return out

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and admits nothing more (or the matcher failed)."""
        return self.m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.m.is_accepting()

    @property
    def error(self) -> str | None:
        return self.m.get_error() if self.m.is_error() else None
