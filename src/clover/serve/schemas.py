"""Request and response bodies (pydantic v2). Field names follow the OpenAI API; the vLLM-style
sampling extras and Clover's decoding options ride along as extra top-level fields."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from ..decoding import get_mode, mode_names
from ..decoding.acceptance import FALLBACKS, POLICIES
from ..decoding.sampling import CONFIDENCE_KINDS, EXPERT_RANKS, LIMITS, MAX_N, SamplingParams


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}  # Clover's own options keep the API's defaults


def _f(name: str, default=None, **extra):
    """A pydantic Field stating the limits `LIMITS[name]` states (one description of each option)."""
    return Field(default=default, **LIMITS[name].field(), **extra)


def _registered_mode(name: str) -> str:
    get_mode(name)  # ValueError "mode: must be one of ..." for an unknown mode
    return name


def _mode_enum(schema: dict) -> None:
    schema["enum"] = list(mode_names())  # the registry at the time the schema is built


_Stop = Annotated[str, Field(max_length=LIMITS["stop"].max_chars)]
_TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    provisional: bool = Field(default=False, description=(
        "clover extension: also stream each denoise step's state of the current block and the "
        "tokens each commit adds, as chunks with `choices: []` and a `clover` object (docs/serving.md)"))


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. The sampling and decoding fields'
    bounds come from `clover.decoding.sampling.LIMITS`, which `SamplingParams` checks too."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = _f("max_new_tokens")
    temperature: float = _f("temperature", 1.0)
    top_p: float = _f("top_p", 1.0)
    seed: int | None = _f("seed")
    stop: Union[_Stop, Annotated[list[_Stop], Field(max_length=LIMITS["stop"].max_items)], None] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    frequency_penalty: float = Field(default=0.0, ge=0, le=0, description="not supported: only 0 is accepted")
    # vLLM-style extras
    top_k: int = _f("top_k", 0)
    repetition_penalty: float = _f("repetition_penalty", 1.0)
    presence_penalty: float = _f("presence_penalty", 0.0)
    stop_token_ids: list[_TokenId] = Field(default_factory=list, max_length=LIMITS["stop_token_ids"].max_items)
    ignore_eos: bool = False
    # Clover's decoding options
    mode: Annotated[str, AfterValidator(_registered_mode), Field(json_schema_extra=_mode_enum)] | None = None
    block_size: Annotated[int, Field(**LIMITS["block_size"].field())] | Literal["auto"] | None = None
    threshold: float | None = _f("threshold")
    confidence: Literal[CONFIDENCE_KINDS] = "prob"  # type: ignore[valid-type]
    policy: Literal[tuple(POLICIES)] | None = None  # type: ignore[valid-type]  # None: the model's
    fallback: Literal[FALLBACKS] = _DEFAULTS["fallback"]  # type: ignore[valid-type]
    factor: float = _f("factor", _DEFAULTS["factor"])
    low_threshold: float = _f("low_threshold", _DEFAULTS["low_threshold"])
    entropy_budget: float = _f("entropy_budget", _DEFAULTS["entropy_budget"])
    sub_block: int | None = _f("sub_block")
    eos_penalty: float = _f("eos_penalty", 0.0)
    no_repeat_ngram_size: int = _f("no_repeat_ngram_size", 0)
    expert_budget: int | None = _f("expert_budget")
    expert_rank: Literal[EXPERT_RANKS] = _DEFAULTS["expert_rank"]  # type: ignore[valid-type]
    draft_length: int | None = _f("draft_length")


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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: Union[str, list[dict], None] = ""
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    max_completion_tokens: int | None = Field(default=None, ge=0)


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
