"""Tool calls for the OpenAI surface: one small parser class per model family's tool format,
registered by name (as vLLM's `--tool-call-parser`).

A parser knows its family's format three ways:
- `render_*`: tools, an assistant's earlier tool calls and `role: "tool"` results as prompt text,
  for chat templates that do not handle tools themselves (a template that does gets them as
  `tools=` / `tool_calls` and renders them its own way);
- `grammar(tools, name, parallel)`: the Lark grammar (llguidance's, with `%json` for the
  arguments) that `tool_choice: "required"` or a named function constrains the output to, so the
  call is well-formed in every mode;
- `parse(text)`: the tool calls in a finished output (`tool_choice: "auto"` finds them in free text),
  and `may_start(text)`: whether a stream must hold text back because it may be a call's start.

Formats: `hermes` (Qwen2.5 / Qwen3 / SmolLM3 / Hermes: `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`), `qwen3_xml` (Qwen3.5 / 3.6 and Qwen3-Coder: `<tool_call>\\n<function=NAME>\\n
<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

PARSERS: dict[str, type["ToolParser"]] = {}
MAX_PARALLEL_CALLS = 8  # calls one constrained output may hold with parallel_tool_calls
MAX_RAW_STRING = 256  # qwen3_xml: characters of a string parameter without maxLength


def register(cls):
    PARSERS[cls.name] = cls
    return cls


def get_parser(name: str) -> "ToolParser":
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_parser: must be one of {', '.join(PARSERS)}, got {name!r}") from None


def parser_for(chat_template: str | None) -> "ToolParser":
    """The parser a chat template's tool format calls for (hermes when it names none)."""
    t = chat_template or ""
    if "<function=" in t:
        return get_parser("qwen3_xml")
    return get_parser("hermes")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def call_arguments(call: dict) -> dict:
    """An OpenAI tool call's arguments as a dict (the API sends them as a JSON string)."""
    args = call["function"].get("arguments") or "{}"
    return json.loads(args) if isinstance(args, str) else args


def _functions(tools) -> list[dict]:
    return [t["function"] for t in tools]


def _no_ws(schema: dict) -> dict:
    return {"x-guidance": {"whitespace_flexible": False}, **schema}


def _lark_str(s: str) -> str:
    return json.dumps(s)


class ToolParser:
    name = ""
    start = "<tool_call>"

    # ---------------------------------------------------------------- the prompt
    def render_tools(self, tools) -> str:
        raise NotImplementedError

    def render_call(self, call: dict) -> str:
        raise NotImplementedError

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    # --------------------------------------------------------------- the output
    def grammar(self, tools, name: str | None, parallel: bool) -> str:
        """Lark text: one call (of function `name`, or any of `tools`), or with `parallel` up to
        MAX_PARALLEL_CALLS of them."""
        fns = [f for f in _functions(tools) if name is None or f["name"] == name]
        calls = " | ".join(f"call_{i}" for i in range(len(fns)))
        rules = [self._call_rule(f"call_{i}", f) for i, f in enumerate(fns)]
        more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return "\n".join([f"start: call{more}", f"call: {calls}", *rules]) + "\n"

    def _call_rule(self, rule: str, fn: dict) -> str:
        raise NotImplementedError

    def may_start(self, text: str) -> bool:
        """The (stripped) text so far is, or may grow into, a tool call."""
        s = text.lstrip()
        return s.startswith(self.start) or self.start.startswith(s)

    def parse(self, text: str, tools=None) -> tuple[str | None, list[ToolCall]]:
        """(content before the calls or None, the calls) of a finished output; no calls: (text, []).
        `tools`: the request's (a format that writes strings raw needs their parameter types)."""
        raise NotImplementedError


@register
class Hermes(ToolParser):
    name = "hermes"
    _CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)

    def render_tools(self, tools) -> str:
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_call(self, call: dict) -> str:
        fn, args = call["function"], call_arguments(call)
        return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False) + "\n</tool_call>"

    def _call_rule(self, rule: str, fn: dict) -> str:
        params = fn.get("parameters") or {"type": "object"}
        schema = _no_ws({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                         "required": ["name", "arguments"], "additionalProperties": False})
        return f'{rule}: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"'

    def parse(self, text: str, tools=None):
        calls = []
        for m in self._CALL.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                args = obj.get("arguments", obj.get("parameters", {}))
                calls.append(ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        content = text[: text.find(self.start)].strip()
        return content or None, calls


@register
class Qwen3XML(ToolParser):
    name = "qwen3_xml"
    _CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>\s*(.*?)</function>\s*</tool_call>", re.S)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def render_tools(self, tools) -> str:
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou have access to the following functions:\n\n<tools>\n" + lines + "\n</tools>\n\n"
                "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
                "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
                "</parameter>\n</function>\n</tool_call>")

    def render_call(self, call: dict) -> str:
        fn, args = call["function"], call_arguments(call)
        out = f"<tool_call>\n<function={fn['name']}>\n"
        for k, v in args.items():
            out += f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
        return out + "</function>\n</tool_call>"

    def _call_rule(self, rule: str, fn: dict) -> str:
        params = fn.get("parameters") or {}
        props = params.get("properties", {})
        required = set(params.get("required", ()))
        parts, extra = [], []
        for j, (p, schema) in enumerate(props.items()):
            sub = f"{rule}_p{j}"
            if schema.get("type") == "string" and "enum" not in schema:
                # raw text, as the format writes strings (bounded: a model that never closes it stops)
                value = f"/[^<]{{0,{int(schema.get('maxLength', MAX_RAW_STRING))}}}/"
            elif "enum" in schema and all(isinstance(e, str) for e in schema["enum"]):
                value = "(" + " | ".join(_lark_str(e) for e in schema["enum"]) + ")"
            else:
                value = f"%json {json.dumps(_no_ws(schema))}"
            extra.append(f'{sub}: "<parameter={p}>\\n" {value} "\\n</parameter>\\n"')
            parts.append(sub if p in required else f"{sub}?")
        head = _lark_str(f"<tool_call>\n<function={fn['name']}>\n")
        return "\n".join([f'{rule}: {head} {" ".join(parts)} "</function>\\n</tool_call>"', *extra])

    def parse(self, text: str, tools=None):
        strings = {(f["name"], p) for f in _functions(tools or []) for p, s in
                   ((f.get("parameters") or {}).get("properties") or {}).items() if s.get("type") == "string"}
        calls = []
        for m in self._CALL.finditer(text):
            args = {}
            name = m.group(1).strip()
            for pm in self._PARAM.finditer(m.group(2)):
                key, raw = pm.group(1), pm.group(2)
                if (name, key) in strings:
                    args[key] = raw
                    continue
                try:
                    args[key] = json.loads(raw)
                except ValueError:
                    args[key] = raw
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        content = text[: text.find(self.start)].strip()
        return content or None, calls
