"""The OpenAI-compatible HTTP API's routes: `create_app(llm, ...)`, and `serve` / `run_app` to run it.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
GET /v1/models, GET /health, GET /metrics, POST /tokenize, POST /detokenize, and the playground
(`playground.py`: the page at GET / and /playground, GET /v1/clover/modes). Each route checks and
hands over: serving a request (its translation into generation options, the `Scheduler` that
batches rows of all requests on one engine thread) is `serving.py`'s; what is answered (responses,
SSE, errors) is `protocol.py`'s.

Before a route runs, `_Guard` checks the API key and reads the body up to `max_body_bytes` (413
beyond), so neither an unauthenticated nor an oversized body is ever parsed. Every error is
OpenAI-shaped with a non-null `code` (see `protocol.ERROR_CODES`)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from . import playground
from .defaults import HOST, MAX_BATCH, MAX_BODY_BYTES, MAX_QUEUE, PORT
from .metrics import Metrics
from .protocol import EXCEPTION_HANDLERS, STREAMED, APIError, chat_response, completion_response, errors
from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .serving import Server


# ------------------------------------------------------------------------- middleware
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


@router.get("/v1/models", responses=errors(401))
async def models(srv: Srv):
    return {"object": "list", "data": [{
        "id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "clover",
        "max_model_len": srv.llm.context_length,
    }]}


@router.post("/tokenize", responses=errors(400, 401, 404, 413))
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


@router.post("/detokenize", responses=errors(400, 401, 404, 413))
async def detokenize(body: DetokenizeRequest, srv: Srv):
    srv.check_model(body.model)
    vocab = srv.llm.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens: {bad[0]} is outside the vocabulary (size {vocab})", param="tokens")
    return {"prompt": await srv.off_loop(srv.tok.decode, body.tokens)}


@router.post("/v1/completions", responses={**STREAMED, **errors(400, 401, 404, 413, 429, 500, 503)})
async def completions(body: CompletionRequest, request: Request, srv: Srv):
    srv.check_model(body.model)
    raw = srv.completion_prompts(body)
    structured = srv.structure(body, chat=False)
    prepared = await srv.off_loop(srv.prepare_completion, body, raw, structured)
    run = await srv.generate(request, body, prepared, chat=False)
    if isinstance(run, StreamingResponse):
        return run
    if body.logprobs is None:
        return completion_response(run, body)
    return completion_response(run, body, *await srv.completion_logprobs(run, body.logprobs))


@router.post("/v1/chat/completions", responses={**STREAMED, **errors(400, 401, 404, 413, 429, 500, 503)})
async def chat_completions(body: ChatCompletionRequest, request: Request, srv: Srv):
    srv.check_model(body.model)
    if body.stream and body.logprobs:
        raise APIError(400, "logprobs: not supported with stream; send a non-streaming request", param="logprobs")
    structured = srv.structure(body, chat=True)
    msgs = srv.chat_messages(body.messages, structured)
    prepared = await srv.off_loop(srv.prepare_chat, body, msgs, structured)
    run = await srv.generate(request, body, prepared, chat=True)
    if isinstance(run, StreamingResponse):
        return run
    lps = await srv.chat_logprobs(run, body.top_logprobs or 0) if body.logprobs else None
    return chat_response(run, structured, lps)


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

