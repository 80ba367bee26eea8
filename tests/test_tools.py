"""Tool calls and structured-output requests, below the HTTP layer: the parsers (hermes,
qwen3_xml) round-trip their own rendering, their grammars make every mode emit a call that parses
and matches the tool's schema, and a request's fields resolve to one grammar or a clear error."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import clover
from clover.grammar import GrammarError
from clover.serve.structured import RequestError, StreamCalls, assistant_message, request_structure
from clover.serve.tools import PARSERS, get_parser

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12},
               "days": {"type": "integer", "minimum": 1, "maximum": 7},
               "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 20}}, "required": ["q"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]


def body(**kw):
    base = dict(response_format=None, structured_outputs=None, guided_json=None, guided_regex=None,
                guided_grammar=None, guided_choice=None, tools=None, tool_choice=None, parallel_tool_calls=None)
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(scope="module")
def bundled():
    return clover.load()


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_parser_round_trip(name):
    p = get_parser(name)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3, "unit": "c"}'}}
    text = "Let me check.\n" + p.render_call(call)
    content, calls = p.parse(text, TOOLS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo", "days": 3, "unit": "c"})]
    assert p.parse("no call here", TOOLS) == ("no call here", [])
    assert p.may_start("<tool") and p.may_start("  <tool_call>\n") and not p.may_start("Hello")


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_required_and_named_grammar_in_every_mode(bundled, name):
    p = get_parser(name)
    for choice, want in (("required", None), ({"type": "function", "function": {"name": "search"}}, "search")):
        s = request_structure(body(tools=TOOLS, tool_choice=choice, parallel_tool_calls=False), p, chat=True)
        assert s.forced_calls and s.grammar is not None
        for mode in ("ar", "diffusion", "speculative"):
            g = bundled.generate("Hi", mode=mode, max_new_tokens=120, grammar=s.grammar)
            msg, finish = assistant_message(g.text, g.finish_reason, s)
            assert finish == "tool_calls", (name, mode, g.text)
            (call,) = msg["tool_calls"]
            fn = call["function"]
            assert want is None or fn["name"] == want
            schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[fn["name"]]
            jsonschema.validate(json.loads(fn["arguments"]), schema)


def test_request_structure_sources():
    p = get_parser("hermes")
    assert request_structure(body(), p, chat=True).grammar is None
    assert request_structure(body(response_format={"type": "json_object"}), p, chat=True).grammar.kind == "json_object"
    assert request_structure(body(guided_regex="[0-9]+"), p, chat=True).grammar.kind == "regex"
    assert request_structure(body(guided_choice=["yes", "no"]), p, chat=True).grammar.kind == "lark"
    assert request_structure(body(structured_outputs={"json": {"type": "integer"}}), p, chat=True).grammar.kind == "json_schema"
    assert request_structure(body(guided_grammar='root ::= "a"'), p, chat=True).grammar.kind == "gbnf"
    auto = request_structure(body(tools=TOOLS), p, chat=True)
    assert auto.parse_calls and not auto.forced_calls and auto.grammar is None
    none = request_structure(body(tools=TOOLS, tool_choice="none"), p, chat=True)
    assert not none.parse_calls
    with pytest.raises(RequestError, match="not one of the request's tools"):
        request_structure(body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), p, chat=True)
    with pytest.raises(RequestError, match="needs tools"):
        request_structure(body(tool_choice="required"), p, chat=True)
    with pytest.raises(RequestError, match="cannot be combined"):
        request_structure(body(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), p, chat=True)
    with pytest.raises(RequestError, match="not several"):
        request_structure(body(guided_regex="a", guided_json={"type": "integer"}), p, chat=True)
    with pytest.raises(RequestError, match="response_format"):
        request_structure(body(response_format={"type": "xml"}), p, chat=True)
    with pytest.raises(GrammarError):
        request_structure(body(guided_json="{nope"), p, chat=True)


def test_stream_calls_holds_back_the_call():
    p = get_parser("hermes")
    s = request_structure(body(tools=TOOLS), p, chat=True)
    st = StreamCalls(s)
    out = st.feed("Sure. <tool") + st.feed("_call>\n{\"name\": \"search\", ") + st.feed('"arguments": {"q": "x"}}\n</tool_call>')
    assert out == "Sure. "
    rest, calls, finish = st.finish("stop")
    assert rest == ""
    assert finish == "tool_calls" and calls[0]["function"]["name"] == "search" and calls[0]["index"] == 0
    plain = StreamCalls(s)
    assert plain.feed("Hello ") + plain.feed("world") == "Hello world"
    assert plain.finish("stop") == ("", [], "stop")
