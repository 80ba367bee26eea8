"""The OpenAI surface of structured output and tool calls, between a request body and the engine:
which grammar a request asks for (`response_format`, `tools` + `tool_choice`, vLLM's
`structured_outputs` / `guided_*`), the chat messages with tools for the template, the fields the
server does not implement (a 400 naming them), and the assistant message (or stream deltas) with
`tool_calls` read back from the output. The tool formats themselves are in `tools.py`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..grammar import GrammarError, GrammarSpec
from .tools import ToolCall, ToolParser

# OpenAI / vLLM request fields this server does not implement: a request naming one with a
# non-default value is a 400 (never silently dropped)
UNIMPLEMENTED = ("best_of", "suffix", "functions", "function_call", "audio", "modalities", "prediction",
                 "web_search_options", "reasoning_effort", "logit_bias_processors", "guided_decoding_backend",
                 "guided_whitespace_pattern", "response_format_schema")
VLLM_GUIDED = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")


class RequestError(ValueError):
    """A bad structured-output / tool request: `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def unimplemented_fields(body, extra: dict | None) -> list[str]:
    """The request's fields the server does not implement: known-unimplemented ones set to a
    value other than their default (None, or OpenAI's best_of=1), and unknown ones."""
    out = []
    for name in UNIMPLEMENTED:
        v = getattr(body, name, None) if name in type(body).model_fields else (extra or {}).get(name)
        if v is not None and not (name == "best_of" and v == 1):
            out.append(name)
    out += sorted(k for k in (extra or {}) if k not in UNIMPLEMENTED)
    return out


def _choice_spec(choices) -> GrammarSpec:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("grammar: a choice must be a non-empty list of strings")
    return GrammarSpec("lark", "start: " + " | ".join(json.dumps(c) for c in choices) + "\n")


def _vllm_spec(so: dict, param: str) -> GrammarSpec:
    """vLLM's structured_outputs: {"json": schema | "json_object": true | "regex" | "grammar" | "choice"}."""
    keys = [k for k in ("json", "json_object", "regex", "grammar", "choice") if so.get(k) not in (None, False)]
    if len(keys) != 1:
        raise RequestError(param, f"{param}: give exactly one of json, json_object, regex, grammar, choice")
    k, v = keys[0], so[keys[0]]
    if k == "json":
        return GrammarSpec.json_schema(v)
    if k == "json_object":
        return GrammarSpec("json_object")
    if k == "regex":
        return GrammarSpec("regex", v)
    if k == "choice":
        return _choice_spec(v)
    return GrammarSpec("gbnf" if "::=" in v else "lark", v)  # vLLM takes either


@dataclass
class Structured:
    """What one request asks of the output: a grammar (or None), and for tool calls the parser,
    the tools and whether the output is read for calls."""

    grammar: GrammarSpec | None = None
    tools: list[dict] = field(default_factory=list)
    parser: ToolParser | None = None
    parse_calls: bool = False  # read tool calls back from the output (tool_choice other than none)
    forced_calls: bool = False  # the grammar makes the output tool calls (required / named)


def request_structure(body, parser: ToolParser | None, *, chat: bool) -> Structured:
    """The grammar and tool handling a request asks for. RequestError (400, naming the field)
    for a contradictory or malformed request; GrammarError for a bad schema / grammar."""
    sources = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        try:
            spec = GrammarSpec.from_response_format(rf)
        except GrammarError as e:
            raise RequestError("response_format", str(e).replace("grammar: ", "", 1)) from None
        if spec is not None:
            sources.append(("response_format", spec))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise RequestError("structured_outputs", "structured_outputs: must be an object")
        sources.append(("structured_outputs", _vllm_spec(so, "structured_outputs")))
    for name in VLLM_GUIDED:
        v = getattr(body, name, None)
        if v is None:
            continue
        if name == "guided_json":
            spec = GrammarSpec.json_schema(v)
        elif name == "guided_regex":
            spec = GrammarSpec("regex", v)
        elif name == "guided_choice":
            spec = _choice_spec(v)
        else:
            spec = GrammarSpec("gbnf" if "::=" in v else "lark", v)
        sources.append((name, spec))
    out = Structured()
    tools = getattr(body, "tools", None) or []
    choice = getattr(body, "tool_choice", None)
    if tools:
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict) \
                    or not isinstance(t["function"].get("name"), str):
                raise RequestError("tools", f'tools.{i}: must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}')
        out.tools, out.parser = tools, parser
        if choice is None:
            choice = "auto"
        if choice == "auto":
            out.parse_calls = True
        elif choice == "required" or isinstance(choice, dict):
            name = None
            if isinstance(choice, dict):
                name = (choice.get("function") or {}).get("name")
                if choice.get("type", "function") != "function" or not isinstance(name, str):
                    raise RequestError("tool_choice", 'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}')
                if name not in {t["function"]["name"] for t in tools}:
                    raise RequestError("tool_choice", f"tool_choice: {name!r} is not one of the request's tools")
            if sources:
                raise RequestError(sources[0][0], f"{sources[0][0]}: cannot be combined with tool_choice "
                                   f"{'required' if name is None else 'naming a function'}")
            parallel = getattr(body, "parallel_tool_calls", None) is not False and name is None
            sources.append(("tool_choice", GrammarSpec("lark", parser.grammar(tools, name, parallel))))
            out.parse_calls = out.forced_calls = True
        elif choice != "none":
            raise RequestError("tool_choice", f'tool_choice: must be "auto", "required", "none" or a named function, got {choice!r}')
    elif choice not in (None, "none"):
        raise RequestError("tool_choice", "tool_choice: needs tools")
    if len(sources) > 1:
        raise RequestError(sources[1][0], f"{sources[1][0]}: give one of {', '.join(n for n, _ in sources)}, not several")
    out.grammar = sources[0][1] if sources else None
    return out


# ------------------------------------------------------------------ the prompt
def chat_messages_with_tools(messages: list, structured: Structured, native: bool) -> list[dict]:
    """The messages as the chat template takes them. `native`: the template renders tools,
    assistant `tool_calls` and `role: "tool"` itself (arguments as objects); otherwise the tool
    parser writes them as text in the family's format (the tool list as a system message)."""
    from .schemas import message_text

    parser = structured.parser
    out = []
    for m in messages:
        d = {"role": m.role, "content": message_text(m.content)}
        calls = getattr(m, "tool_calls", None) or []
        if native:
            if calls:
                d["tool_calls"] = [_native_call(c) for c in calls]
            if m.role == "tool" and getattr(m, "tool_call_id", None):
                d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        elif parser is not None or calls or m.role == "tool":
            p = parser or _default_parser()
            if calls:
                d["content"] = "\n".join(x for x in [d["content"]] + [p.render_call(_plain(c)) for c in calls] if x)
            if m.role == "tool":
                d["content"] = p.render_result(d["content"])
        out.append(d)
    if structured.tools and not native:
        text = parser.render_tools(structured.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _default_parser():
    from .tools import get_parser

    return get_parser("hermes")


def _plain(call) -> dict:
    return call if isinstance(call, dict) else call.model_dump()


def _native_call(call) -> dict:
    c = _plain(call)
    fn = dict(c.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except ValueError:
            raise RequestError("messages", f"messages: tool call arguments are not JSON: {args[:80]!r}") from None
    return {"type": "function", "id": c.get("id"), "function": fn}


# ------------------------------------------------------------------ the answer
def assistant_message(text: str, finish_reason: str, structured: Structured) -> tuple[dict, str]:
    """The assistant message and finish_reason of a finished chat choice."""
    if structured.parse_calls and structured.parser is not None:
        content, calls = structured.parser.parse(text, structured.tools)
        if calls:
            return ({"role": "assistant", "content": content,
                     "tool_calls": [c.as_openai() for c in calls]},
                    "tool_calls" if finish_reason == "stop" else finish_reason)
    return {"role": "assistant", "content": text}, finish_reason


class StreamCalls:
    """A streamed chat choice with tools: content deltas pass until the text may be a tool call's
    start; from there the text is held, and at the end the calls go out as the official deltas
    (`tool_calls[i]` with id, type, function name and the arguments)."""

    def __init__(self, structured: Structured) -> None:
        self.s = structured
        self.text = ""
        self.sent = 0  # characters of content emitted

    def feed(self, delta: str) -> str:
        """The content that may go out now."""
        self.text += delta
        start = self.s.parser.start
        cut = self.text.find(start)
        if cut < 0:
            cut = len(self.text)
            for k in range(min(len(start) - 1, len(self.text)), 0, -1):  # a possible start of the marker
                if self.text.endswith(start[:k]):
                    cut = len(self.text) - k
                    break
        if self.s.forced_calls:
            cut = 0
        out = self.text[self.sent:cut] if cut > self.sent else ""
        self.sent = max(self.sent, cut)
        return out

    def finish(self, finish_reason: str) -> tuple[str, list[dict], str]:
        """(content still to emit, tool_calls deltas, finish_reason) at the end of the choice."""
        content, calls = self.s.parser.parse(self.text, self.s.tools)
        if not calls:
            rest = self.text[self.sent:]
            self.sent = len(self.text)
            return rest, [], finish_reason
        before = (content or "")[self.sent:] if content else ""
        return before, [c.as_openai(i) for i, c in enumerate(calls)], ("tool_calls" if finish_reason == "stop" else finish_reason)


__all__ = ["RequestError", "Structured", "StreamCalls", "ToolCall", "assistant_message", "chat_messages_with_tools",
           "request_structure", "unimplemented_fields"]
