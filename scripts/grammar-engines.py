"""Compare the grammar engines clover could keep (llguidance, xgrammar, outlines-core) on this CPU:
compile time, per-token mask time and fast-forward (forced) tokens on JSON documents of a few
schemas, for each tokenizer given. docs/structured-output.md reports the figures.

    python scripts/grammar-engines.py TOKENIZER_DIR [TOKENIZER_DIR ...]

A tokenizer directory is anything `AutoTokenizer.from_pretrained` reads (a model directory, or a
GGUF vocabulary saved with `save_pretrained`). Single-threaded; a run takes a few minutes."""

from __future__ import annotations

import json
import statistics
import sys
import time

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
             {"name": "Ada Lovelace", "age": 36}),
    "tool_call": ({"type": "object", "properties": {
        "name": {"enum": ["read_file", "search", "run_python"]},
        "arguments": {"type": "object", "properties": {
            "path": {"type": "string", "pattern": "^[a-z/._]+$"},
            "max_lines": {"type": "integer", "minimum": 1, "maximum": 500},
            "flags": {"type": "array", "items": {"enum": ["-n", "-i", "-r"]}, "maxItems": 3}},
            "required": ["path"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
        {"name": "read_file", "arguments": {"path": "src/main.py", "max_lines": 40, "flags": ["-n", "-i"]}}),
    "nested": ({"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                "price": {"type": "number", "minimum": 0}}, "required": ["sku", "qty", "price"],
                "additionalProperties": False}},
            "note": {"type": "string"}}, "required": ["id", "items"], "additionalProperties": False}},
        "required": ["order"], "additionalProperties": False},
        {"order": {"id": "ABC-1234", "items": [{"sku": "pen", "qty": 2, "price": 1.5},
                                                {"sku": "ink", "qty": 1, "price": 7.25}]}}),
}


def doc_tokens(tok, doc) -> list[int]:
    return tok.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)


def bench_llguidance(tok, schema, ids):
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    if not hasattr(tok, "_ll"):
        tok._ll = llguidance.hf.from_tokenizer(tok)
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(tok._ll, llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}))
    compile_s = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    mask = llt.allocate_token_bitmask(1, tok._ll.vocab_size)
    times, forced, i = [], 0, 0
    while i < len(ids):
        t = time.perf_counter()
        llt.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - t)
        assert m.consume_token(ids[i]), (i, m.get_error())
        i += 1
        ff = m.compute_ff_tokens()
        # a forced token counts only when it is the document's own next token
        for f in ff:
            if i < len(ids) and f == ids[i]:
                assert m.consume_token(f)
                forced += 1
                i += 1
            else:
                break
    return compile_s, times, forced


def bench_xgrammar(tok, schema, ids):
    import torch
    import xgrammar as xgr

    if not hasattr(tok, "_xg"):
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        tok._xg = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        tok._xg_n = info.vocab_size
    t0 = time.perf_counter()
    compiled = tok._xg.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t0
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, tok._xg_n)
    times, forced, i = [], 0, 0
    while i < len(ids):
        t = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t)
        assert m.accept_token(ids[i]), i
        i += 1
        s = m.find_jump_forward_string()  # forced text (xgrammar gives a string, not tokens)
        if s:
            ff = tok.encode(s, add_special_tokens=False)
            for f in ff:
                if i < len(ids) and f == ids[i] and m.accept_token(f):
                    forced += 1
                    i += 1
                else:
                    break
    del torch
    return compile_s, times, forced


def bench_outlines(tok, schema, ids):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    if not hasattr(tok, "_oc"):
        vocab: dict[str, list[int]] = {}
        eos = tok.eos_token_id
        for s, i in tok.get_vocab().items():
            if i != eos:
                vocab.setdefault(s, []).append(i)
        tok._oc = Vocabulary(eos, vocab)
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern=r""), tok._oc)
    compile_s = time.perf_counter() - t0
    g = Guide(index)
    times, forced, i = [], 0, 0
    while i < len(ids):
        t = time.perf_counter()
        allowed = g.get_tokens()
        times.append(time.perf_counter() - t)
        assert ids[i] in allowed, i
        g.advance(ids[i])
        i += 1
        nxt = g.get_tokens()  # a single allowed token is forced
        while len(nxt) == 1 and i < len(ids) and nxt[0] == ids[i]:
            g.advance(ids[i])
            forced += 1
            i += 1
            nxt = g.get_tokens()
    return compile_s, times, forced


# JSON Schema keywords: does the engine accept a schema using it (accepting is not enforcing: an
# engine may ignore a keyword it accepts)
COVERAGE = {
 "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
 "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
 "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
 "$ref/$defs": {"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
 "recursive $ref": {"$defs": {"t": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}}, "$ref": "#/$defs/t"},
 "const": {"const": "x"},
 "enum mixed": {"enum": [1, "a", None]},
 "pattern": {"type": "string", "pattern": "^[a-z]+[0-9]$"},
 "format date-time": {"type": "string", "format": "date-time"},
 "format email": {"type": "string", "format": "email"},
 "min/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
 "integer range": {"type": "integer", "minimum": -3, "maximum": 700},
 "exclusive number range": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1.5},
 "multipleOf": {"type": "integer", "multipleOf": 5},
 "min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
 "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
 "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
 "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
 "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
 "min/maxProperties": {"type": "object", "minProperties": 1, "maxProperties": 2},
 "type list": {"type": ["string", "null"]},
 "if/then/else": {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
 "not": {"not": {"type": "string"}},
}


def coverage(tok) -> None:
    import llguidance
    import llguidance.hf
    import xgrammar as xgr
    from outlines_core.json_schema import build_regex_from_schema

    ll_tok = llguidance.hf.from_tokenizer(tok)
    xg = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)), max_threads=1)

    def ll(s):
        err = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(s), ll_tok)
        if err:
            raise ValueError(err)

    checks = (ll, lambda s: xg.compile_json_schema(json.dumps(s)), lambda s: build_regex_from_schema(json.dumps(s)))
    print("| keyword | llguidance | xgrammar | outlines-core |\n|---|---|---|---|")
    totals = [0, 0, 0]
    for name, schema in COVERAGE.items():
        row = []
        for i, f in enumerate(checks):
            try:
                f(schema)
                row.append("yes")
                totals[i] += 1
            except Exception:  # noqa: BLE001 - any refusal counts as unsupported
                row.append("no")
        print(f"| {name} | " + " | ".join(row) + " |")
    print("| **accepted** | " + " | ".join(f"{t}/{len(COVERAGE)}" for t in totals) + " |")


ENGINES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines}


def main(dirs: list[str]) -> None:
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    coverage(AutoTokenizer.from_pretrained(dirs[0]))
    print("| tokenizer | vocab | engine | schema | tokens | compile ms | mask µs median / p95 | forced tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for d in dirs:
        tok = AutoTokenizer.from_pretrained(d)
        for sname, (schema, doc) in SCHEMAS.items():
            ids = doc_tokens(tok, doc)
            for ename, fn in ENGINES.items():
                try:
                    fn(tok, schema, ids)  # warm (tokenizer tables, caches)
                    compile_s, times, forced = fn(tok, schema, ids)
                except Exception as e:  # noqa: BLE001 - report and continue
                    print(f"| {d.rstrip('/').rsplit('/', 1)[-1]} | {len(tok)} | {ename} | {sname} | {len(ids)} | error: {type(e).__name__}: {str(e)[:80]} | | |")
                    continue
                med = statistics.median(times) * 1e6
                p95 = sorted(times)[int(0.95 * (len(times) - 1))] * 1e6
                print(f"| {d.rstrip('/').rsplit('/', 1)[-1]} | {len(tok)} | {ename} | {sname} | {len(ids)} | "
                      f"{compile_s * 1e3:.1f} | {med:.0f} / {p95:.0f} | {forced} ({forced / len(ids):.0%}) |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
