"""Structured output and tool calls through the server, with the official openai client: the tool
round trip (call, tool result, final answer) in every mode, streamed and not; response_format;
vLLM's guided fields; 400s for unimplemented fields and bad grammars (the server keeps serving);
mixed concurrent clients with cancellations answer as they would alone."""

from __future__ import annotations

import concurrent.futures
import json
import random

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from test_serve import LiveServer  # noqa: E402

MODEL = "tiny"
MODES = ("ar", "diffusion", "speculative")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12},
               "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}
RF = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server():
    import clover

    with LiveServer(clover.load(), max_batch=16, max_queue=64) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120)


def _call(client, mode, messages, stream, **kw):
    """One chat request; a stream is folded back into (message dict, finish_reason) the way an
    agent framework accumulates the official deltas."""
    extra = {"mode": mode, **kw.pop("extra_body", {})}
    kw = dict(model=MODEL, messages=messages, temperature=0, extra_body=extra, **kw)
    if not stream:
        ch = client.chat.completions.create(**kw).choices[0]
        msg = {"content": ch.message.content,
               "tool_calls": [c.model_dump() for c in ch.message.tool_calls or []]}
        return msg, ch.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            c["id"] = tc.id or c["id"]
            if tc.function:
                c["function"]["name"] += tc.function.name or ""
                c["function"]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_tool_round_trip(client, mode, stream):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    msg, finish = _call(client, mode, messages, stream, tools=TOOLS, tool_choice="required",
                        parallel_tool_calls=False, max_tokens=80)
    assert finish == "tool_calls" and len(msg["tool_calls"]) == 1, msg
    call = msg["tool_calls"][0]
    assert call["id"] and call["type"] == "function"
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call["function"]["name"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]), spec)
    # the tool result goes back as a role "tool" message; the final answer is text
    messages += [{"role": "assistant", "content": None, "tool_calls": msg["tool_calls"]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 12 C"}]
    final, finish = _call(client, mode, messages, stream, tools=TOOLS, tool_choice="none", max_tokens=16)
    assert finish in ("stop", "length") and not final["tool_calls"] and final["content"]


def test_named_tool_and_auto_parsing(client):
    messages = [{"role": "user", "content": "time?"}]
    msg, finish = _call(client, "diffusion", messages, False, tools=TOOLS,
                        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=60)
    assert finish == "tool_calls" and msg["tool_calls"][0]["function"]["name"] == "get_time"
    # auto: the parser finds a call in the output text as the model writes it (forced here by a choice)
    text = 'Checking.\n<tool_call>\n{"name":"get_time","arguments":{"zone":"cet"}}\n</tool_call>'
    for stream in (False, True):
        msg, finish = _call(client, "ar", messages, stream, tools=TOOLS, max_tokens=60,
                            extra_body={"mode": "ar", "guided_choice": [text]})
        assert finish == "tool_calls" and msg["content"] in ("Checking.", "Checking.\n"), msg
        assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"zone": "cet"}


@pytest.mark.parametrize("mode", MODES)
def test_response_format(client, mode):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok?"}], temperature=0,
                                       response_format=RF, max_tokens=40, extra_body={"mode": mode})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=8, temperature=0,
                                  extra_body={"mode": mode, "guided_choice": ["alpha", "beta"]})
    assert r.choices[0].text in ("alpha", "beta")


def test_bad_requests_are_400_and_server_keeps_serving(client):
    msgs = [{"role": "user", "content": "x"}]
    bad = [
        (dict(extra_body={"best_of": 3}), "best_of"),
        (dict(extra_body={"min_p": 0.1}), "min_p"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
         "Invalid type"),
        (dict(extra_body={"guided_regex": "[a-"}), "regex"),
        (dict(extra_body={"guided_json": {"type": "object"}, "guided_regex": "a"}), "not several"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "nope"),
        (dict(tool_choice="required"), "needs tools"),
        (dict(logit_bias={"5": 300}), "logit_bias"),
    ]
    for kw, why in bad:
        with pytest.raises(openai.BadRequestError, match=why):
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, **kw)
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=MODEL, prompt="a", suffix="b", max_tokens=2)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("mode", MODES)
def test_logit_bias_through_the_server(server, client, mode):
    tok = server.app.state.server.tok
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=4, temperature=0, extra_body={"mode": mode})
    base = client.completions.create(**kw).choices[0].text
    first = tok.encode(base)[0]
    banned = client.completions.create(**kw, logit_bias={str(first): -100}).choices[0].text
    assert tok.encode(banned)[0] != first
    boosted = client.completions.create(**kw, logit_bias={"65": 100}).choices[0].text
    assert boosted.startswith(tok.decode([65]))


def _mixed(client, k: int, cancel: bool):
    """Request k of the concurrency mix: (kind, result) or None for a cancelled stream."""
    mode = MODES[k % 3]
    kind = ("plain", "json", "tools")[(k // 3) % 3]
    stream = k % 2 == 1
    kw = {"plain": dict(max_tokens=16), "json": dict(response_format=RF, max_tokens=40),
          "tools": dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60)}[kind]
    messages = [{"role": "user", "content": f"request {k % 5}"}]
    if cancel:  # read a little of the stream, then go away
        s = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, stream=True,
                                           extra_body={"mode": mode}, **kw)
        next(iter(s))
        s.close()
        return None
    return _call(client, mode, messages, stream, **kw)


def _concurrency(client, n: int):
    alone = {k: _mixed(client, k, False) for k in range(min(n, 18))}
    rng = random.Random(0)
    jobs = [(k % 18, rng.random() < 0.2) for k in range(n)]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(_mixed, client, k, c) for k, c in jobs]
        results = [f.result() for f in futs]  # any 5xx raises here
    for (k, cancelled), got in zip(jobs, results):
        if not cancelled:
            assert got[1] == alone[k][1]
            assert got[0]["content"] == alone[k][0]["content"]
            strip = [dict(c, id=None) for c in got[0]["tool_calls"]]
            assert strip == [dict(c, id=None) for c in alone[k][0]["tool_calls"]]


def test_concurrent_mixed_clients_small(client):
    _concurrency(client, 8)


@pytest.mark.slow
def test_concurrent_mixed_clients_32(client):
    _concurrency(client, 32)
