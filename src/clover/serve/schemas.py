"""Request and response bodies (pydantic v2). Field names follow the OpenAI API; the vLLM-style
sampling extras and Clover's decoding options ride along as extra top-level fields."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float = 0.0
    # vLLM-style extras
    top_k: int = Field(default=0, ge=-1)  # -1 or 0: off
    repetition_penalty: float = Field(default=1.0, gt=0)
    presence_penalty: float = 0.0
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    # Clover's decoding options
    mode: Literal["ar", "diffusion", "naive", "speculative"] | None = None
    block_size: int | None = Field(default=None, gt=0)
    threshold: float | None = Field(default=None, gt=0)
    confidence: Literal["prob", "margin", "entropy"] = "prob"
    eos_penalty: float = 0.0
    no_repeat_ngram_size: int = Field(default=0, ge=0)
    expert_budget: int | None = None
    draft_length: int | None = Field(default=None, gt=0)


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_Sampling):
    prompt: PromptType
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
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
    messages: list[ChatMessage] | None = None
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
