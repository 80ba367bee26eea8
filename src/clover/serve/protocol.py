"""What the server answers, in OpenAI's shapes: the error bodies (`APIError`, its `code` by status
in `ERROR_CODES`, the exception handlers), a finished request's response (its choices, their
logprobs, usage) and the server-sent events of a streamed one. It renders what a request's rows
produced; running them is `serving.py`'s, the endpoints are `app.py`'s."""

from __future__ import annotations

import json
import logging
import re
from typing import AsyncIterator

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import StreamEvent
from .schemas import REQUEST_NAMES, ChatCompletionRequest, CompletionRequest
from .structured import StreamCalls, Structured, assistant_message

log = logging.getLogger("clover.serve")

# The `code` of every error this server answers, by status (an error without its own code gets
# its status's first one).
ERROR_CODES = {
    400: ("invalid_value", "invalid_json", "missing_required_parameter", "context_length_exceeded",
          "chat_template_error"),
    401: ("invalid_api_key",),
    404: ("not_found", "model_not_found"),
    405: ("method_not_allowed",),
    413: ("request_too_large",),
    429: ("queue_full",),
    499: ("cancelled",),
    500: ("internal_error", "engine_error"),
    503: ("service_unavailable", "shutting_down", "engine_dead"),
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorResponse(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


_ERROR_DOCS = {
    400: "a bad value (`param` names the field) or malformed JSON",
    401: "missing or wrong `Authorization: Bearer` key",
    404: "unknown model",
    413: "the request body exceeds the server's limit",
    429: "the server is full; retry after `Retry-After` seconds",
    500: "decoding failed for this request",
    503: "the server is shutting down or its engine has died",
}


def errors(*statuses: int) -> dict:
    """A route's `responses` for these error statuses (the OpenAPI schema)."""
    return {s: {"model": ErrorResponse, "description": _ERROR_DOCS[s]} for s in statuses}


STREAMED = {200: {"description": "the response; with `stream: true`, server-sent events (`data: {chunk}` ... `data: [DONE]`)",
                  "content": {"text/event-stream": {"schema": {"description": "one chunk object per event, then [DONE]"}}}}}


_REQUEST_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        code = code or ERROR_CODES.get(status, ("invalid_value" if status < 500 else "internal_error",))[0]
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def value_error(e: Exception, *, prompt_param: str = "prompt", length_param: str | None = None) -> APIError:
    """A ValueError "field: why" from SamplingParams / LLM -> 400 naming the request field. A prompt
    that fits the context alone but not with the length the client asked for (`length_param`:
    max_tokens or max_completion_tokens, as sent) names that field."""
    msg = str(e)
    if "context length" in msg:
        msg = re.sub(r"\bmax_new_tokens\b", length_param or "max_tokens", msg)
        if length_param:
            msg = f"{length_param}: too long for this prompt: {msg.split(': ', 1)[-1]}"
        return APIError(400, msg, param=length_param or prompt_param, code="context_length_exceeded")
    m = re.match(r"^(\w+)[: ]", msg)
    param = REQUEST_NAMES.get(m.group(1), m.group(1)) if m else None
    if param == "prompt":
        param = prompt_param
    if param not in _REQUEST_FIELDS:
        param = None
    msg = re.sub(r"^max_new_tokens\b", "max_tokens", msg)
    return APIError(400, msg, param=param, code="invalid_value")


# ------------------------------------------------------------------------- exception handlers
async def _api_error(request: Request, exc: APIError):
    return exc.response()


async def _validation(request: Request, exc: RequestValidationError):
    errs = exc.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        where = f" at character {first['loc'][1]}" if len(first.get("loc", ())) > 1 else ""
        return APIError(400, f"body: invalid JSON{where}: {ctx.get('error', first.get('msg', ''))}",
                        code="invalid_json").response()
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    why = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    msg = why if param and why.startswith(f"{param}: ") else f"{where}: {why}"
    got = first.get("input")
    if isinstance(got, (str, int, float, bool)) and "got " not in msg and first.get("type") != "missing":
        msg += f", got {got!r}"[:200]
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more)"
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    return APIError(400, msg, param=param, code=code).response()


async def _http(request: Request, exc: StarletteHTTPException):
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
    return APIError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {})).response()


async def _internal(request: Request, exc: Exception):
    log.exception("internal error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error",
                    code="internal_error").response()


EXCEPTION_HANDLERS = {APIError: _api_error, RequestValidationError: _validation, StarletteHTTPException: _http,
                      Exception: _internal}


# ------------------------------------------------------------------------- responses
def finish_reason(reason: str | None) -> str:
    return {"cancelled": "abort", None: "length"}.get(reason, reason)


def usage(prompts: list[list[int]], gens: list) -> dict:
    p = sum(len(x) for x in prompts)
    c = sum(len(g.token_ids) for g in gens)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _response(run, obj: str, choices: list) -> dict:
    """The body of a finished request (`run`: a `serving.Run`)."""
    return {
        "id": run.rid, "object": obj, "created": run.created, "model": run.srv.model_name,
        "choices": choices, "usage": usage(run.prompts, run.results),
        "clover": {"mode": run.mode, "stats": [g.stats.as_dict() for g in run.results]},
    }


def completion_response(run, body, seqs: list | None = None, lps: list | None = None) -> dict:
    """/v1/completions' answer; with `logprobs`, `lps` scores the tokens of `seqs` (per row: the
    prompt, the completion and its stop token, `serving.Server.completion_logprobs`)."""
    srv = run.srv
    choices = []
    for i, (r, g) in enumerate(zip(run.req.rows, run.results)):
        text = (srv.tok.decode(r.prompt) if body.echo else "") + g.text
        lp = None
        if lps is not None:
            start = 0 if body.echo else len(r.prompt)
            chosen, tops = lps[i][0][start:], lps[i][1][start:]
            pieces = [srv.piece(t) for t in seqs[i][start:]]
            offsets, off = [], 0 if body.echo else len(srv.tok.decode(r.prompt))
            for s in pieces:
                offsets.append(off)
                off += len(s)
            lp = {
                "tokens": pieces,
                "token_logprobs": chosen,
                "top_logprobs": [None if t is None else {srv.piece(a): b for a, b in t} for t in tops],
                "text_offset": offsets,
            }
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish_reason(g.finish_reason)})
    return _response(run, "text_completion", choices)


def chat_response(run, structured: Structured, lps: list | None = None) -> dict:
    """/v1/chat/completions' answer: each row's message (its tool calls parsed) and, with
    `logprobs`, `lps` scoring each row's prompt + completion."""
    srv = run.srv
    choices = []
    for i, (r, g) in enumerate(zip(run.req.rows, run.results)):
        lp = None
        if lps is not None:
            start = len(r.prompt)
            content = []
            for t, c, top in zip(g.token_ids, lps[i][0][start:], lps[i][1][start:]):
                s = srv.piece(t)
                content.append({"token": s, "logprob": c, "bytes": list(s.encode()),
                                "top_logprobs": [{"token": srv.piece(a), "logprob": b, "bytes": list(srv.piece(a).encode())}
                                                 for a, b in top]})
            lp = {"content": content}
        message, finish = assistant_message(g.text, finish_reason(g.finish_reason), structured)
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
    return _response(run, "chat.completion", choices)


# ------------------------------------------------------------------------- server-sent events
def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def stream_response(srv, req, prompts, body, rid: str, created: int, *, chat: bool,
                    structured: Structured | None = None) -> StreamingResponse:
    """A submitted request's events (`req`: a `scheduler.ServeRequest`) as OpenAI chunks, then
    `[DONE]`; rows still running when the client goes away are cancelled (`srv`: the
    `serving.Server`)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    # tool calls: content passes until a call may start; the calls go out as deltas at the end
    calls = [StreamCalls(structured) for _ in req.rows] if chat and structured and structured.parse_calls else None
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    pieces: dict[int, str] = {}  # token id -> its text, for the provisional events

    def piece(t: int | None) -> str | None:
        if t is not None and t not in pieces:
            pieces[t] = srv.piece(t)
        return None if t is None else pieces[t]

    def extension(index: int, event: str, **fields) -> str:
        """A clover-extension chunk: no choices (as the usage chunk), the event in `clover`."""
        out = {"id": rid, "object": obj, "created": created, "model": srv.model_name, "choices": [],
               "clover": {"index": index, "event": event, **fields}}
        if include_usage:
            out["usage"] = None
        return sse(out)

    def chunk(index: int, text: str | None, finish: str | None = None, role: bool = False,
              tool_calls: list | None = None) -> str:
        if chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        out = {"id": rid, "object": obj, "created": created, "model": srv.model_name, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return sse(out)

    async def events() -> AsyncIterator[str]:
        gens: list = [None] * len(req.rows)
        left = len(req.rows)
        try:
            for i, r in enumerate(req.rows):
                if chat:
                    yield chunk(i, "", role=True)
                elif getattr(body, "echo", False):
                    yield chunk(i, srv.tok.decode(r.prompt))
            while left:
                ev: StreamEvent = await req.queue.get()
                i = ev.index
                if ev.kind == "block":
                    if req.provisional:  # the clover extension (stream_options.provisional)
                        yield extension(i, "commit", token_ids=ev.token_ids, pieces=[piece(t) for t in ev.token_ids],
                                        steps=ev.steps, forced=ev.forced)
                    text = calls[i].feed(ev.text) if calls else ev.text
                    if text:
                        yield chunk(i, text)
                elif ev.kind == "provisional":  # only for requests that asked
                    yield extension(i, "provisional", block=ev.block, step=ev.step, token_ids=ev.token_ids,
                                    pieces=[piece(t) for t in ev.token_ids], steps=ev.steps)
                elif ev.kind == "done":
                    gen = gens[i] = ev.generation
                    left -= 1
                    finish = finish_reason(gen.finish_reason)
                    text, deltas = ev.text, None
                    if calls:
                        text = calls[i].feed(ev.text)
                        rest, deltas, finish = calls[i].finish(finish)
                        text += rest
                    if text:
                        yield chunk(i, text)
                    for d in deltas or ():  # the official deltas: one per call, name and arguments whole
                        yield chunk(i, None, tool_calls=[d])
                    if req.provisional:
                        yield extension(i, "done", finish_reason=finish_reason(gen.finish_reason),
                                        stats=gen.stats.as_dict(), forced_tokens=gen.forced_tokens)
                    yield chunk(i, None if chat else "", finish=finish)
                else:  # "error": the request is over
                    left = 0
                    yield sse({"error": {"message": ev.text, "type": "server_error", "param": None, "code": "engine_error"}})
                    return
            if include_usage:
                yield sse({"id": rid, "object": obj, "created": created, "model": srv.model_name, "choices": [],
                           "usage": usage(prompts, [g for g in gens if g is not None])})
            yield "data: [DONE]\n\n"
        finally:
            if left:
                srv.scheduler.cancel(req)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
