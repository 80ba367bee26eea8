"""Request and response bodies (pydantic v2). Field names follow the OpenAI API; the vLLM-style
sampling extras and Clover's decoding options ride along as extra top-level fields."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model

from ..decoding import get_mode, mode_names
from ..decoding.sampling import LIMITS, MAX_N, Limit, SamplingParams


_DEFAULTS = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
             for f in dataclasses.fields(SamplingParams)}  # Clover's own options keep the API's defaults
# the request's names and defaults where they differ from `SamplingParams`' (OpenAI's)
REQUEST_NAMES = {"max_new_tokens": "max_tokens"}
REQUEST_DEFAULTS = {"max_new_tokens": None, "temperature": 1.0, "stop": None}


def _registered_mode(name: str) -> str:
    get_mode(name)  # ValueError "mode: must be one of ..." for an unknown mode
    return name


def _mode_enum(schema: dict) -> None:
    schema["enum"] = list(mode_names())  # the registry at the time the schema is built


def _bounds(lim: Limit) -> dict:
    return {k: getattr(lim, k) for k in ("ge", "gt", "le") if getattr(lim, k) is not None}


def _annotation(lim: Limit):
    """The request type stating what `lim` accepts (a list of strings also takes one string, as
    OpenAI's `stop`)."""
    if lim.choices:
        t = Literal[lim.choices]
    elif lim.kind is list:
        item = Annotated[lim.item, Field(**_bounds(lim), **({"max_length": lim.max_chars} if lim.max_chars else {}))]
        t = Annotated[list[item], Field(max_length=lim.max_items)]
        if lim.item is str:
            return Union[item, t, None]
    elif lim.kind in (int, float):
        t = Annotated[lim.kind, Field(**_bounds(lim))]
    elif lim.kind is str:
        t = Annotated[str, Field(max_length=lim.max_chars)]
    else:
        t = lim.kind
    if lim.words:
        t = Union[t, Literal[lim.words]]
    return Optional[t] if lim.nullable else t


def _field(name: str, lim: Limit):
    default = REQUEST_DEFAULTS.get(name, _DEFAULTS[name])
    t = _annotation(lim)
    if default is None:
        t = Optional[t]
    if isinstance(default, list):
        return t, Field(default_factory=list, description=lim.doc)
    return t, Field(default=default, description=lim.doc)


_TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    provisional: bool = Field(default=False, description=(
        "clover extension: also stream each denoise step's state of the current block and the "
        "tokens each commit adds, as chunks with `choices: []` and a `clover` object (docs/serving.md)"))


class _Request(BaseModel):
    """What /v1/completions and /v1/chat/completions share beside the generation options."""

    # unknown fields are kept so the server can refuse them by name (never silently dropped)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = Field(default=None, max_length=256)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    mode: Annotated[str, AfterValidator(_registered_mode), Field(json_schema_extra=_mode_enum)] | None = Field(
        default=None, description="the decoding mode (null = the model's default: the mode its config states, "
                                     "else diffusion for a Clover checkpoint, ar for an AR one)")
    # structured output (docs/structured-output.md): one of these constrains the output in every mode
    logit_bias: dict[str, float] | None = Field(default=None, description="token id -> bias in [-100, 100] added to its logit")
    response_format: dict | None = Field(default=None, description=(
        '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}'))
    structured_outputs: dict | None = Field(default=None, description=(
        "vLLM's: one of json (a schema), json_object, regex, grammar (Lark or GBNF), choice (strings)"))
    guided_json: Union[dict, str, None] = Field(default=None, description="vLLM's: a JSON schema")
    guided_regex: str | None = Field(default=None, description="vLLM's: a regular expression")
    guided_grammar: str | None = Field(default=None, description="vLLM's: a Lark or GBNF grammar")
    guided_choice: list[str] | None = Field(default=None, description="vLLM's: the output is one of these strings")
    best_of: int | None = Field(default=None, description="not supported (only 1)")


# Every generation option of `clover.decoding.sampling.LIMITS`, under its request name, with the
# bounds and meaning stated there (the table `SamplingParams` checks too): a new option is one row
# of that table.
_Sampling = create_model("_Sampling", __base__=_Request, __doc__=_Request.__doc__ + " The generation options "
                         "come from `clover.decoding.sampling.LIMITS`.",
                         **{REQUEST_NAMES.get(n, n): _field(n, lim) for n, lim in LIMITS.items()})


MAX_PROMPTS = 64  # prompts in one completions request
_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[list[_TokenId], Field(min_length=1)]
PromptType = Union[
    _Text,
    Annotated[list[_Text], Field(min_length=1, max_length=MAX_PROMPTS)],
    _Ids,
    Annotated[list[_Ids], Field(min_length=1, max_length=MAX_PROMPTS)],
]


class CompletionRequest(_Sampling):
    prompt: PromptType
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ToolCallIn(BaseModel):
    """An assistant message's earlier tool call (as the OpenAI API returned it)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: dict


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: Union[str, list[dict], None] = ""
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    max_completion_tokens: int | None = Field(default=None, ge=0)
    tools: list[dict] | None = Field(default=None, max_length=128)
    tool_choice: Union[Literal["auto", "required", "none"], dict, None] = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def message_text(content) -> str:
    """A message's content as text (a list of content parts keeps the text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
