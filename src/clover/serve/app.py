"""The OpenAI-compatible HTTP API: `create_app(llm, ...)`, and `serve` / `run_app` to run it.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
GET /v1/models, GET /health, GET /metrics, POST /tokenize, POST /detokenize, and the playground
(`playground.py`: the page at GET / and /playground, GET /v1/clover/modes).
Generation goes through the `Scheduler` (one engine thread batching rows of all requests).

Before a route runs, `_Guard` checks the API key and reads the body up to `max_body_bytes` (413
beyond), so neither an unauthenticated nor an oversized body is ever parsed. Tokenization, chat
templates and parameter checks run on one worker thread (`Server.off_loop`), never on the event
loop. Every error is OpenAI-shaped with a non-null `code` (see `ERROR_CODES`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import re
import secrets
import sys
import time
import uuid
from typing import Annotated, AsyncIterator

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import Generation, StreamEvent
from ..decoding import Mode
from ..decoding.sampling import LIMITS, SamplingParams
from ..grammar import GrammarError
from . import playground
from .defaults import HOST, MAX_BATCH, MAX_BODY_BYTES, MAX_QUEUE, PORT
from .metrics import Metrics
from ..tokenizer import ChatTemplateError
from .scheduler import EngineDead, NotAccepting, QueueFull, Scheduler, ServeRequest
from .structured import (RequestError, StreamCalls, Structured, assistant_message, chat_messages_with_tools,
                         request_structure, unimplemented_fields)
from .tools import get_parser, parser_for
from .schemas import (CHAT_ROLES, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                      message_text)

log = logging.getLogger("clover.serve")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint
CHAT_DEFAULT_MAX_TOKENS = 512  # clipped to what the context leaves
# SamplingParams' names that differ from the request's
_PARAM_NAMES = {"max_new_tokens": "max_tokens"}
SEED_MOD = 2**64  # choice i of n samples with (seed + i) mod 2^64

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


def _errors(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": _ERROR_DOCS[s]} for s in statuses}


_STREAMED = {200: {"description": "the response; with `stream: true`, server-sent events (`data: {chunk}` ... `data: [DONE]`)",
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


def _value_error(e: Exception, *, prompt_param: str = "prompt", length_param: str | None = None) -> APIError:
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
    param = _PARAM_NAMES.get(m.group(1), m.group(1)) if m else None
    if param == "prompt":
        param = prompt_param
    if param not in _REQUEST_FIELDS:
        param = None
    msg = re.sub(r"^max_new_tokens\b", "max_tokens", msg)
    return APIError(400, msg, param=param, code="invalid_value")


def _finish_reason(reason: str | None) -> str:
    return {"cancelled": "abort", None: "length"}.get(reason, reason)


class Server:
    """The state behind one app: the model, its scheduler and metrics."""

    def __init__(self, llm, *, model_name: str, max_batch: int, max_queue: int, api_key: str | None,
                 drain_timeout: float = 10.0, max_body_bytes: int = MAX_BODY_BYTES,
                 tool_parser: str | None = None) -> None:
        self.llm = llm
        self.tok = llm.tokenizer
        # the model family's tool-call format (serve/tools.py): named, or read off the chat template
        self.tool_parser = get_parser(tool_parser) if tool_parser else parser_for(self.tok.chat_template)
        self.model_name = model_name
        self.aliases = {model_name} | ({str(llm.path)} if getattr(llm, "path", None) else set())
        self.api_key = api_key
        self.drain_timeout = drain_timeout
        self.metrics = Metrics()
        self.scheduler = Scheduler(llm, max_batch=max_batch, max_queue=max_queue, metrics=self.metrics)
        self.created = int(time.time())
        im_end = self.tok.end_of_turn_id()
        self.chat_stop_ids = [] if im_end is None else [im_end]
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be >= 1, got {max_body_bytes}")
        self.max_body_bytes = max_body_bytes
        # A prompt longer than this many characters cannot fit the context whatever it encodes to
        # (no token spans more characters than the longest vocabulary entry; x2 for normalizers
        # that merge characters), so it is refused before tokenization.
        vocab = self.tok.raw.get_vocab()  # (transformers' tokenizer loads on the prepare worker: `warm`)
        self.max_prompt_chars = 2 * llm.context_length * max((len(t) for t in vocab), default=64)
        # tokenization, chat templates and parameter checks: one worker (the tokenizer is not
        # safe to encode from several threads at once), off the event loop
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="clover-prepare")

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ----------------------------------------------------------------- checks
    def authorized(self, header: str) -> bool:
        if not self.api_key:
            return True
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())

    def check_model(self, name: str | None) -> None:
        """An absent or empty `model` means the served one (as vLLM); another name is a 404."""
        if name and name not in self.aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_prompt_size(self, prompts: list, param: str) -> None:
        """Refuse, before tokenizing, prompts that cannot fit the context whatever they encode to."""
        for p in prompts:
            too_long = len(p) > self.max_prompt_chars if isinstance(p, str) else len(p) > self.llm.context_length
            if too_long:
                unit = "characters" if isinstance(p, str) else "tokens"
                raise APIError(400, f"{param}: {len(p)} {unit} cannot fit the context length {self.llm.context_length}",
                               param=param, code="context_length_exceeded")

    def chat_messages(self, messages, structured: Structured | None = None) -> list[dict]:
        """The messages as the chat template takes them: tools, earlier tool calls and `role: "tool"`
        results rendered natively when the template handles tools, else in the tool format."""
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise APIError(400, f"messages.{i}.role: {m.role!r} is not a chat role; use one of {', '.join(CHAT_ROLES)}",
                               param="messages", code="invalid_value")
            if m.role in ("user", "system", "developer") and ("content" not in m.model_fields_set or m.content is None):
                raise APIError(400, f"messages.{i}.content: a {m.role} message needs content", param="messages",
                               code="invalid_value")
        try:
            msgs = chat_messages_with_tools(messages, structured or Structured(), self.tok.supports_tools())
        except RequestError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        self.check_prompt_size(["".join(m["content"] for m in msgs)], "messages")
        return msgs

    def chat_ids(self, msgs: list[dict], add_generation_prompt: bool, tools: list | None = None) -> list[int]:
        try:
            return self.tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                                tools=tools if tools and self.tok.supports_tools() else None)
        except ChatTemplateError as e:
            raise APIError(400, f"messages: {e}", param="messages", code="chat_template_error") from None

    def structure(self, body, *, chat: bool) -> Structured:
        """What the request asks of the output (a grammar, tool calls); a 400 naming the field for
        an unimplemented field or a contradictory / malformed structured-output request."""
        bad = unimplemented_fields(body, body.model_extra)
        if bad:
            raise APIError(400, f"{bad[0]}: not supported by this server" + (f" (nor {', '.join(bad[1:])})" if bad[1:] else "")
                           + "; remove it", param=bad[0], code="invalid_value")
        try:
            return request_structure(body, self.tool_parser, chat=chat)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        except GrammarError as e:
            raise APIError(400, str(e), param=_grammar_param(body), code="invalid_value") from None

    def compile(self, structured: Structured, params: SamplingParams, body, mode: Mode | None = None):
        """The request's grammar compiled (within the compile time limit), or None; a 400 saying why."""
        try:
            return self.llm.compile_grammar(structured.grammar, params, mode=mode)
        except GrammarError as e:
            raise APIError(400, str(e), param=_grammar_param(body), code="invalid_value") from None

    def encode(self, prompt, param: str = "prompt") -> list[int]:
        try:
            return self.llm.encode_prompt(prompt)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"{param}: {str(e).split(': ', 1)[-1]}", param=param, code="invalid_value") from None

    # ------------------------------------------------------------ generation
    def params(self, body, prompts: list[list[int]], *, default_max: int, prompt_param: str,
               extra_stop_ids: list[int] = ()) -> tuple[Mode, SamplingParams]:
        """The request's mode (None: the model's default, as everywhere) and its checked options."""
        if body.frequency_penalty:
            raise APIError(400, "frequency_penalty: not supported; use presence_penalty or repetition_penalty",
                           param="frequency_penalty", code="invalid_value")
        max_tokens = getattr(body, "max_completion_tokens", None)
        max_tokens = body.max_tokens if body.max_tokens is not None else max_tokens
        # every generation option of `LIMITS`, under its request name (the schema states each one)
        kw = {name: getattr(body, _PARAM_NAMES.get(name, name)) for name in LIMITS}
        kw["max_new_tokens"] = max_tokens if max_tokens is not None else default_max
        kw["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        kw["stop_token_ids"] = list(body.stop_token_ids) + [t for t in extra_stop_ids if t not in body.stop_token_ids]
        kw["logit_bias"] = body.logit_bias
        try:
            mode = self.llm.mode(body.mode)
            params = self.llm.params(mode, kw)
            if max_tokens is None:  # the default length, clipped to what the context leaves
                params.max_new_tokens = min(default_max, self.llm.room(max(len(p) for p in prompts), params, mode))
            for p in prompts:
                self.llm.check_length(len(p), params, mode)
        except ValueError as e:
            sent = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
            fits = max(len(p) for p in prompts) < self.llm.context_length  # then the length asked is too long
            raise _value_error(e, prompt_param=prompt_param,
                               length_param=sent if max_tokens is not None and fits else None) from None
        except TypeError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        return mode, params

    def submit(self, prompts: list[list[int]], mode: Mode, params: SamplingParams, n: int,
               provisional: bool = False, grammar=None) -> ServeRequest:
        rows = []
        for p in prompts:
            for i in range(n):
                pi = dataclasses.replace(params, seed=(params.seed + i) % SEED_MOD) if params.seed is not None and i else params
                rows.append(self.llm.row(p, pi, grammar))
        req = ServeRequest(rows, mode.spec(params, provisional), asyncio.get_running_loop(), provisional=provisional)
        if len(rows) > self.scheduler.capacity():
            raise APIError(400, f"n: {len(rows)} rows exceed what this server holds ({self.scheduler.capacity()})",
                           param="n", code="invalid_value")
        self.scheduler.start()
        try:
            self.scheduler.submit(req)
        except QueueFull as e:
            raise APIError(429, f"{e}; retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except NotAccepting as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down") from None
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        return req

    async def collect(self, request: Request, req: ServeRequest) -> list[Generation]:
        """Wait for every row of `req`: its Generations in row order. A client that disconnects
        meanwhile has its rows cancelled."""
        out: list = [None] * len(req.rows)
        left = len(req.rows)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while left:
                get = asyncio.ensure_future(req.queue.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    self.scheduler.cancel(req)
                    raise APIError(499, "client disconnected", code="cancelled")
                ev: StreamEvent = get.result()
                if ev.kind == "done":
                    out[ev.index] = ev.generation
                    left -= 1
                elif ev.kind == "error":
                    raise APIError(500, ev.text, type="server_error", code="engine_error")
        finally:
            gone.cancel()
            if left:
                self.scheduler.cancel(req)
        return out

    async def logprobs(self, seqs: list[list[int]], k: int) -> list[tuple[list, list]]:
        """Per sequence: (logprob of each token given the ones before — None for the first —,
        the top-k (token id, logprob) at each position), from one causal (commit-mode) forward."""
        model = self.llm.model

        def run():
            res = []
            with torch.inference_mode():
                for ids in seqs:
                    x = torch.tensor([ids], dtype=torch.long, device=model.device)
                    lp = model(x)[0].float().log_softmax(-1)[:-1]
                    nxt = torch.tensor(ids[1:], dtype=torch.long, device=lp.device)
                    chosen = lp.gather(-1, nxt[:, None]).squeeze(-1).tolist()
                    if k:
                        v, i = lp.topk(min(k, lp.shape[-1]), dim=-1)
                        tops = [list(zip(ii, vv)) for ii, vv in zip(i.tolist(), v.tolist())]
                    else:
                        tops = [[] for _ in chosen]
                    res.append(([None] + chosen, [None] + tops))
            return res

        try:
            return await self.scheduler.call(run)
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None

    def piece(self, t: int) -> str:
        return self.tok.decode([t])

    def usage(self, prompts: list[list[int]], gens: list) -> dict:
        p = sum(len(x) for x in prompts)
        c = sum(len(g.token_ids) for g in gens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class _CountRequests:
    """ASGI middleware: clover_requests{endpoint, status} (a plain ASGI wrapper, so streaming and
    disconnect detection pass through untouched)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_wrapped(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapped)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "other"
            self.metrics.requests.labels(endpoint, str(status[0])).inc()


def _protected(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


class _Guard:
    """ASGI middleware, before any route: the API key (on /v1/*, /tokenize, /detokenize) is checked
    before a byte of the body is read, then the body is read up to `max_body_bytes` (413 beyond,
    by Content-Length or as it arrives) and handed on to the route."""

    def __init__(self, app, srv: Server) -> None:
        self.app, self.srv = app, srv

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        if _protected(scope["path"]) and not self.srv.authorized(headers.get(b"authorization", b"").decode("latin-1")):
            err = APIError(401, "invalid API key: send `Authorization: Bearer <key>`", type="authentication_error",
                           code="invalid_api_key")
            return await err.response()(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.srv.max_body_bytes
        too_large = APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return await too_large.response()(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await too_large.response()(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        return await self.app(scope, replay, send)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away (the request body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------- errors
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


# ------------------------------------------------------------------------- routes
router = APIRouter()


def _server(request: Request) -> Server:
    return request.app.state.server


Srv = Annotated[Server, Depends(_server)]


@router.get("/health", responses={503: {"description": "the engine thread has died: restart the server"}})
async def health(srv: Srv):
    """`status: "ok"`, or 503 with `status: "unhealthy"` and `error` once the engine has died."""
    stats = srv.scheduler.stats()
    if not stats["healthy"]:
        return JSONResponse({"status": "unhealthy", "error": srv.scheduler.dead or "the engine thread is not running",
                             "model": srv.model_name, **stats}, status_code=503)
    return {"status": "ok", "model": srv.model_name, **stats}


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(srv: Srv):
    data, ctype = srv.metrics.render()
    return Response(data, media_type=ctype)


@router.get("/v1/models", responses=_errors(401))
async def models(srv: Srv):
    return {"object": "list", "data": [{
        "id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "clover",
        "max_model_len": srv.llm.context_length,
    }]}


@router.post("/tokenize", responses=_errors(400, 401, 404, 413))
async def tokenize(body: TokenizeRequest, srv: Srv):
    srv.check_model(body.model)
    if body.messages is not None:
        msgs = srv.chat_messages(body.messages)
        ids = await srv.off_loop(srv.chat_ids, msgs, body.add_generation_prompt)
    elif body.prompt is not None:
        srv.check_prompt_size([body.prompt], "prompt")
        ids = await srv.off_loop(srv.tok.encode, body.prompt)
    else:
        raise APIError(400, "prompt: give `prompt` or `messages`", param="prompt", code="missing_required_parameter")
    return {"tokens": ids, "count": len(ids), "max_model_len": srv.llm.context_length}


@router.post("/detokenize", responses=_errors(400, 401, 404, 413))
async def detokenize(body: DetokenizeRequest, srv: Srv):
    srv.check_model(body.model)
    vocab = srv.llm.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens: {bad[0]} is outside the vocabulary (size {vocab})", param="tokens")
    return {"prompt": await srv.off_loop(srv.tok.decode, body.tokens)}


async def _generate(srv: Server, request: Request, body, prepared: tuple, *, chat: bool):
    """What both generation endpoints share: submit the rows, then either the SSE stream or
    the finished rows (a `_Run`)."""
    prompts, mode, params, structured, grammar = prepared
    req = srv.submit(prompts, mode, params, body.n, provisional=_provisional(body), grammar=grammar)
    rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return _stream(srv, req, prompts, body, rid, created, chat=chat, structured=structured)
    return _Run(srv, req, prompts, mode.name, rid, created, await srv.collect(request, req))


@router.post("/v1/completions", responses={**_STREAMED, **_errors(400, 401, 404, 413, 429, 500, 503)})
async def completions(body: CompletionRequest, request: Request, srv: Srv):
    srv.check_model(body.model)
    p = body.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
        raw = [p]
    elif isinstance(p, list) and p:
        raw = list(p)
    else:
        raise APIError(400, "prompt: empty; give at least one token", param="prompt")
    if body.stream and body.logprobs is not None:
        raise APIError(400, "logprobs: not supported with stream; send a non-streaming request", param="logprobs")
    srv.check_prompt_size(raw, "prompt")
    structured = srv.structure(body, chat=False)

    def prepare():
        prompts = [srv.encode(x) for x in raw]
        mode, params = srv.params(body, prompts, default_max=COMPLETION_DEFAULT_MAX_TOKENS, prompt_param="prompt")
        return prompts, mode, params, structured, srv.compile(structured, params, body, mode)

    run = await _generate(srv, request, body, await srv.off_loop(prepare), chat=False)
    if isinstance(run, StreamingResponse):
        return run
    rows, gens = run.req.rows, run.results
    lps = seqs = None
    if body.logprobs is not None:
        seqs = []
        for r, g in zip(rows, gens):
            ids = list(r.prompt) + list(g.token_ids)
            if g.stop_token is not None and len(ids) < srv.llm.context_length:
                ids.append(g.stop_token)
            seqs.append(ids)
        lps = await srv.logprobs(seqs, body.logprobs)
    choices = []
    for i, (r, g) in enumerate(zip(rows, gens)):
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
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": _finish_reason(g.finish_reason)})
    return run.response("text_completion", choices)


@router.post("/v1/chat/completions", responses={**_STREAMED, **_errors(400, 401, 404, 413, 429, 500, 503)})
async def chat_completions(body: ChatCompletionRequest, request: Request, srv: Srv):
    srv.check_model(body.model)
    if body.stream and body.logprobs:
        raise APIError(400, "logprobs: not supported with stream; send a non-streaming request", param="logprobs")
    structured = srv.structure(body, chat=True)
    msgs = srv.chat_messages(body.messages, structured)

    def prepare():
        ids = srv.chat_ids(msgs, body.add_generation_prompt, structured.tools)
        if not ids:
            raise APIError(400, "messages: the chat template produced no tokens", param="messages",
                           code="chat_template_error")
        mode, params = srv.params(body, [ids], default_max=CHAT_DEFAULT_MAX_TOKENS, prompt_param="messages",
                                  extra_stop_ids=srv.chat_stop_ids)
        return [ids], mode, params, structured, srv.compile(structured, params, body, mode)

    run = await _generate(srv, request, body, await srv.off_loop(prepare), chat=True)
    if isinstance(run, StreamingResponse):
        return run
    rows, gens = run.req.rows, run.results
    lps = None
    if body.logprobs:
        lps = await srv.logprobs([list(r.prompt) + list(g.token_ids) for r, g in zip(rows, gens)],
                                 body.top_logprobs or 0)
    choices = []
    for i, (r, g) in enumerate(zip(rows, gens)):
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
        message, finish = assistant_message(g.text, _finish_reason(g.finish_reason), structured)
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
    return run.response("chat.completion", choices)


def create_app(llm, *, model_name: str = "clover", max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE,
               api_key: str | None = None, drain_timeout: float = 10.0, max_body_bytes: int = MAX_BODY_BYTES,
               tool_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving `llm` (a `clover.LLM`). `max_batch`: rows in flight at once;
    `max_queue`: rows that may wait beyond those (more answers 429); `api_key`: required as
    `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize when set; `max_body_bytes`:
    the largest request body (413 beyond); `tool_parser`: the tool-call format by name
    (`serve.tools.PARSERS`; default: read off the chat template)."""
    srv = Server(llm, model_name=model_name, max_batch=max_batch, max_queue=max_queue, api_key=api_key,
                 drain_timeout=drain_timeout, max_body_bytes=max_body_bytes, tool_parser=tool_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.scheduler.start()
        srv.pool.submit(lambda: srv.tok.hf)  # the chat template's tokenizer (transformers), loaded off the start
        yield
        await asyncio.to_thread(srv.scheduler.stop, srv.drain_timeout)
        srv.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="clover", lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)

    def openapi() -> dict:
        """FastAPI's schema, less the 422 it declares for validation errors: this server answers
        those with 400 and the error model, as each route declares."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            comps = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                comps.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    app.state.server = srv
    app.state.scheduler = srv.scheduler
    app.add_middleware(_Guard, srv=srv)
    app.add_middleware(_CountRequests, metrics=srv.metrics)  # outermost: counts the guard's answers too
    app.include_router(playground.router)  # the page at / and /playground, GET /v1/clover/modes
    app.include_router(router)
    return app


@dataclasses.dataclass
class _Run:
    """A finished non-streamed generation request: its rows and their Generations."""

    srv: Server
    req: ServeRequest
    prompts: list
    mode: str
    rid: str
    created: int
    results: list[Generation]

    def response(self, obj: str, choices: list) -> dict:
        return {
            "id": self.rid, "object": obj, "created": self.created, "model": self.srv.model_name,
            "choices": choices, "usage": self.srv.usage(self.prompts, self.results),
            "clover": {"mode": self.mode, "stats": [g.stats.as_dict() for g in self.results]},
        }


def _provisional(body) -> bool:
    """Whether a request asks for the clover extension's denoising events (streams only)."""
    return bool(body.stream and body.stream_options and body.stream_options.provisional)


def _grammar_param(body) -> str | None:
    """The request field that carries the grammar (for a 400's `param`)."""
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_grammar",
                 "guided_choice", "tools"):
        if getattr(body, name, None) is not None:
            return name
    return None


def _stream(srv: Server, req: ServeRequest, prompts, body, rid: str, created: int, *, chat: bool,
            structured: Structured | None = None) -> StreamingResponse:
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
        return _sse(out)

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
        return _sse(out)

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
                    finish = _finish_reason(gen.finish_reason)
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
                        yield extension(i, "done", finish_reason=_finish_reason(gen.finish_reason),
                                        stats=gen.stats.as_dict(), forced_tokens=gen.forced_tokens)
                    yield chunk(i, None if chat else "", finish=finish)
                else:  # "error": the request is over
                    left = 0
                    yield _sse({"error": {"message": ev.text, "type": "server_error", "param": None, "code": "engine_error"}})
                    return
            if include_usage:
                yield _sse({"id": rid, "object": obj, "created": created, "model": srv.model_name, "choices": [],
                            "usage": srv.usage(prompts, [g for g in gens if g is not None])})
            yield "data: [DONE]\n\n"
        finally:
            if left:
                srv.scheduler.cancel(req)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ------------------------------------------------------------------------- entry points
def serve(model_dir=None, host: str = HOST, port: int = PORT, max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE,
          api_key: str | None = None, device: str | None = None, dtype: str | None = None,
          model_name: str | None = None, log_level: str = "info", max_body_bytes: int = MAX_BODY_BYTES,
          check_finite: bool | None = None, tool_parser: str | None = None) -> None:
    """Load a model directory (`clover.load`) and serve it until interrupted."""
    from ..api import load

    llm = load(model_dir, dtype=dtype, device=device, check_finite=check_finite)
    run_app(llm, host=host, port=port, max_batch=max_batch, max_queue=max_queue, api_key=api_key,
            model_name=model_name, log_level=log_level, max_body_bytes=max_body_bytes, tool_parser=tool_parser)


def uvicorn_server(app: FastAPI, *, host: str, port: int, log_level: str = "info", graceful: float | None = 30.0,
                   banner: str | None = None):
    """A uvicorn.Server for `app` whose shutdown first drains the scheduler (in-flight rows finish
    for up to the app's drain timeout, then end with finish_reason "abort", so every open request
    gets an answer) and only then waits for the connections to close. `banner`: printed on stderr
    once the socket listens."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if banner and not self.should_exit:
                print(banner, file=sys.stderr, flush=True)

        async def shutdown(self, sockets=None):
            srv: Server = app.state.server
            await asyncio.to_thread(srv.scheduler.stop, srv.drain_timeout)
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=graceful)
    return _Server(config)


def run_app(llm, *, host: str = HOST, port: int = PORT, max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE,
            api_key: str | None = None, model_name: str | None = None, log_level: str = "info",
            max_body_bytes: int = MAX_BODY_BYTES, tool_parser: str | None = None) -> None:
    """Serve a loaded `llm` until interrupted (the model id clients send: `model_name`, default the
    directory name)."""
    name = model_name or (llm.path.name if getattr(llm, "path", None) else "clover")
    app = create_app(llm, model_name=name, max_batch=max_batch, max_queue=max_queue, api_key=api_key,
                     max_body_bytes=max_body_bytes, tool_parser=tool_parser)
    uvicorn_server(app, host=host, port=port, log_level=log_level, banner=banner(llm, name, host, port)).run()


def banner(llm, name: str, host: str, port: int) -> str:
    """What `clover serve` prints once it listens: the model, its default mode and where to go."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else (f"[{host}]" if ":" in host else host)
    base = f"http://{shown}:{port}"
    kind = "chat" if getattr(llm, "is_chat", False) else "completion"
    return (f"clover serve: {name} ({kind} model, {llm.default_mode} by default) · OpenAI API {base}/v1 · "
            f"playground {base}/ · health {base}/health")

