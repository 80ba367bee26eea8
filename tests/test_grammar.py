"""Structured output: the grammar package's inputs and errors, and every decoding mode obeying a
grammar on held-out schemas (the bundled model and a tiny random one), constrained speculative ==
constrained AR token for token, naive == diffusion, and logit_bias in every mode."""

from __future__ import annotations

import json
import re

import pytest

import clover
from clover.grammar import GrammarError, GrammarSpec, compile_grammar

jsonschema = pytest.importorskip("jsonschema")

MODES = ("ar", "diffusion", "speculative", "naive")

# held out: none of these is used to tune anything; the kinds agents send
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 10},
            "id": {"type": "integer", "minimum": 1, "maximum": 9999}},
            "required": ["name", "id"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enum_array": {"type": "object", "properties": {
        "action": {"enum": ["read", "write", "delete"]},
        "paths": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "minItems": 1, "maxItems": 3}},
        "required": ["action", "paths"], "additionalProperties": False},
    "ranges_optional": {"type": "object", "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "count": {"type": "integer", "minimum": -5, "maximum": 5},
        "ok": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 6}},
        "required": ["score", "count"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "level": {"enum": ["low", "high"]}}, "required": ["date", "level"], "additionalProperties": False},
}


def _rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def bundled():
    return clover.load()


@pytest.mark.parametrize("which", ["bundled", "tiny"])
def test_every_mode_is_schema_valid(which, bundled, tiny_llm):
    llm = bundled if which == "bundled" else tiny_llm
    schemas = list(SCHEMAS.items()) if which == "bundled" else list(SCHEMAS.items())[::2]
    for k, (name, schema) in enumerate(schemas):
        outs = {}
        for mode in MODES if k == 0 else MODES[:3]:  # naive (== diffusion, uncached) on one schema
            g = llm.generate("Data:", mode=mode, max_new_tokens=128, response_format=_rf(schema))
            assert g.finish_reason == "stop", (which, name, mode, g.text)
            jsonschema.validate(json.loads(g.text), schema)
            outs[mode] = g
        assert outs["speculative"].token_ids == outs["ar"].token_ids, (which, name)
        if "naive" in outs:
            assert outs["naive"].token_ids == outs["diffusion"].token_ids, (which, name)
        # the grammar forces keys and punctuation: diffusion places them without a forward
        assert outs["diffusion"].stats.grammar_forced > 0
        assert outs["diffusion"].stats.forwards < len(outs["diffusion"].token_ids)


def test_json_object_regex_lark_gbnf(bundled):
    # any JSON object: free strings can run past the budget (finish "length"); every token is valid
    m = compile_grammar(GrammarSpec("json_object"), bundled.tokenizer, vocab_size=bundled.config.vocab_size).matcher()
    for mode in ("ar", "diffusion"):
        g = bundled.generate("Answer:", mode=mode, max_new_tokens=32, grammar={"json_object": None})
        assert g.text.startswith("{") and m.valid_prefix(g.token_ids) == len(g.token_ids), (mode, g.text)
        if g.finish_reason == "stop":
            assert isinstance(json.loads(g.text), dict)
    cases = [
        ({"regex": r"[A-Z][a-z]{2,5} [0-9]{3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{3}", t)),
        ({"lark": 'start: "call(" NAME ")"\nNAME: /[a-z]{1,8}/'}, lambda t: re.fullmatch(r"call\([a-z]{1,8}\)", t)),
        ({"gbnf": 'root ::= ("yes" | "no") "!"'}, lambda t: t in ("yes!", "no!")),
    ]
    for grammar, ok in cases:
        for mode in MODES[:3]:
            g = bundled.generate("Answer:", mode=mode, max_new_tokens=64, grammar=grammar)
            assert ok(g.text), (grammar, mode, g.text)


def test_sampling_stays_valid(tiny_llm):
    schema = SCHEMAS["enum_array"]
    for mode in ("ar", "diffusion", "speculative"):
        for seed in range(3):
            g = tiny_llm.generate("x", mode=mode, max_new_tokens=96, temperature=1.0, seed=seed,
                                  response_format=_rf(schema))
            jsonschema.validate(json.loads(g.text), schema)


def test_stream_matches_generate(bundled):
    rf = _rf(SCHEMAS["pattern"])
    for mode in ("ar", "diffusion", "speculative"):
        events = list(bundled.stream("Log:", mode=mode, max_new_tokens=64, response_format=rf))
        text = "".join(e.text for e in events if e.kind == "block")
        assert text == bundled.generate("Log:", mode=mode, max_new_tokens=64, response_format=rf).text


def test_batched_rows_each_constrained(bundled):
    gs = bundled.generate(["a", "bb", "ccc"], mode="diffusion", max_new_tokens=96,
                          response_format=_rf(SCHEMAS["nested"]))
    for g in gs:
        jsonschema.validate(json.loads(g.text), SCHEMAS["nested"])


@pytest.mark.parametrize("bad, why", [
    ({"type": "strin"}, "Invalid type"),
    ({"type": "string", "format": "nonsense"}, "format"),
    ({"$ref": "#/definitions/missing"}, "does not exist"),
])
def test_bad_schema_is_a_clear_error(bundled, bad, why):
    with pytest.raises(GrammarError, match=why):
        bundled.generate("x", max_new_tokens=4, response_format=_rf(bad))


def test_bad_inputs(bundled):
    tok = bundled.tokenizer
    with pytest.raises(GrammarError, match="unclosed group"):
        compile_grammar(GrammarSpec("regex", "[a-z]+("), tok, vocab_size=bundled.config.vocab_size)
    with pytest.raises(GrammarError, match="unknown name"):
        compile_grammar(GrammarSpec("lark", "start: foo"), tok, vocab_size=bundled.config.vocab_size)
    with pytest.raises(GrammarError, match="not valid JSON"):
        GrammarSpec.json_schema("{nope")
    with pytest.raises(GrammarError, match="at most"):
        GrammarSpec("regex", "a" * 300_000)
    with pytest.raises(GrammarError, match="response_format: type"):
        bundled.generate("x", response_format={"type": "yaml"})
    with pytest.raises(GrammarError, match="took longer"):
        big = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "^[a-z]{1,40}[0-9]{1,9}$"}
                                                 for i in range(300)}}
        compile_grammar(GrammarSpec.json_schema(big), tok, vocab_size=bundled.config.vocab_size, timeout_s=1e-4)


def test_grammar_file_kinds(tmp_path):
    (tmp_path / "s.json").write_text('{"type": "integer"}')
    (tmp_path / "g.lark").write_text('start: "a"')
    assert GrammarSpec.from_file(tmp_path / "s.json").kind == "json_schema"
    assert GrammarSpec.from_file(tmp_path / "g.lark").kind == "lark"
    with pytest.raises(GrammarError, match="suffix"):
        GrammarSpec.from_file(tmp_path / "g.txt")


def test_logit_bias_in_every_mode(bundled):
    for mode in MODES:
        base = bundled.generate("Once upon a time", mode=mode, max_new_tokens=8)
        banned = base.token_ids[0]
        g = bundled.generate("Once upon a time", mode=mode, max_new_tokens=8, logit_bias={str(banned): -100})
        assert banned not in g.token_ids, mode
        boost = bundled.generate("Once upon a time", mode=mode, max_new_tokens=4, logit_bias={65: 100})
        assert boost.token_ids[0] == 65, mode
    with pytest.raises(ValueError, match="logit_bias: the bias"):
        bundled.generate("x", logit_bias={1: 500})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bundled.generate("x", logit_bias={10**7: 1})


def test_bench_json_workload(tiny_llm):
    from clover.bench.decode import Workload, run_decode

    res = run_decode(tiny_llm, Workload("json", prompts=2, max_new_tokens=160), modes=["ar", "diffusion", "speculative"],
                     warmup=False)
    for mode, r in res["modes"].items():
        j = r["quality"]["json"]
        assert j["n"] == 2 and j["valid_when_finished"] == 1.0, (mode, j)
        assert j["grammar_ms_per_forward"] is not None
    assert res["modes"]["diffusion"]["quality"]["json"]["grammar_forced_share"] > 0
    assert res["modes"]["speculative"]["matches_ar"] == 1.0


def test_a_mode_without_grammar_support_refuses_one(bundled):
    from clover.decoding import get_mode
    from clover.decoding.modes import mode_names

    for name in mode_names():
        if not get_mode(name).grammar:
            with pytest.raises(GrammarError, match="does not support structured output"):
                bundled.compile_grammar({"regex": "a"}, bundled.params("ar", {}), mode=name)
