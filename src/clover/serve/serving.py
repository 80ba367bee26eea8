"""Serving a request: from its body to what the engine runs and back. `Server` holds one app's
state (the model, its scheduler, metrics) and does the checks, the translation of a request into
prompts, a mode and checked generation options (`params`), the hand-off to the `Scheduler`
(`submit`, `collect`, `generate`) and the scores behind `logprobs` (`LLM.logprobs` on the engine
thread). The endpoints are `app.py`'s; what is answered, in OpenAI's shapes, is `protocol.py`'s.

Tokenization, chat templates and parameter checks run on one worker thread (`Server.off_loop`),
never on the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import secrets
import time
import uuid

from fastapi import Request

from ..api import Generation, StreamEvent
from ..decoding import EngineSpec, Mode
from ..decoding.sampling import LIMITS, SamplingParams
from ..grammar import GrammarError
from ..tokenizer import ChatTemplateError
from .defaults import MAX_BODY_BYTES
from .metrics import Metrics
from .protocol import APIError, stream_response, value_error
from .scheduler import EngineDead, NotAccepting, QueueFull, Scheduler, ServeRequest
from .schemas import CHAT_ROLES, REQUEST_NAMES
from .structured import RequestError, Structured, chat_messages_with_tools, request_structure, unimplemented_fields
from .tools import get_parser, parser_for

COMPLETION_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint
CHAT_DEFAULT_MAX_TOKENS = 512  # clipped to what the context leaves
SEED_MOD = 2**64  # choice i of n samples with (seed + i) mod 2^64


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
            raise APIError(400, str(e), param=grammar_param(body), code="invalid_value") from None

    def compile(self, structured: Structured, params: SamplingParams, body, mode: Mode | None = None):
        """The request's grammar compiled (within the compile time limit), or None; a 400 saying why."""
        try:
            return self.llm.compile_grammar(structured.grammar, params, mode=mode)
        except GrammarError as e:
            raise APIError(400, str(e), param=grammar_param(body), code="invalid_value") from None

    def encode(self, prompt, param: str = "prompt") -> list[int]:
        try:
            return self.llm.encode_prompt(prompt)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"{param}: {str(e).split(': ', 1)[-1]}", param=param, code="invalid_value") from None

    # ------------------------------------------------------------ generation
    def params(self, body, prompts: list[list[int]], *, default_max: int, prompt_param: str,
               extra_stop_ids: list[int] = ()) -> tuple[EngineSpec, SamplingParams]:
        """The request's plan (its mode: None, the model's default, as everywhere; `LLM.plan`) and its
        checked options."""
        max_tokens = getattr(body, "max_completion_tokens", None)
        max_tokens = body.max_tokens if body.max_tokens is not None else max_tokens
        # every generation option of `LIMITS`, under its request name (the schema states each one)
        kw = {name: getattr(body, REQUEST_NAMES.get(name, name)) for name in LIMITS}
        kw["max_new_tokens"] = max_tokens if max_tokens is not None else default_max
        kw["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        kw["stop_token_ids"] = list(body.stop_token_ids) + [t for t in extra_stop_ids if t not in body.stop_token_ids]
        kw["logit_bias"] = body.logit_bias
        try:
            mode = self.llm.mode(body.mode)
            params = self.llm.params(mode, kw)
            plan = self.llm.plan(mode, params, provisional(body))
            if max_tokens is None:  # the default length, clipped to what the context leaves
                params.max_new_tokens = min(default_max, self.llm.room(max(len(p) for p in prompts), params, plan))
            for p in prompts:
                self.llm.check_length(len(p), params, plan)
        except ValueError as e:
            sent = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
            fits = max(len(p) for p in prompts) < self.llm.context_length  # then the length asked is too long
            raise value_error(e, prompt_param=prompt_param,
                               length_param=sent if max_tokens is not None and fits else None) from None
        except TypeError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        return plan, params

    def submit(self, prompts: list[list[int]], plan: EngineSpec, params: SamplingParams, n: int,
               provisional: bool = False, grammar=None) -> ServeRequest:
        rows = []
        for p in prompts:
            for i in range(n):
                pi = dataclasses.replace(params, seed=(params.seed + i) % SEED_MOD) if params.seed is not None and i else params
                rows.append(self.llm.row(p, pi, grammar))
        req = ServeRequest(rows, plan, asyncio.get_running_loop(), provisional=provisional)
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
        gone = asyncio.ensure_future(disconnected(request))
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
        """`LLM.logprobs` of each sequence, run on the engine thread between forwards."""
        try:
            return await self.scheduler.call(functools.partial(self.llm.logprobs, seqs, k))
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None

    async def completion_logprobs(self, run: Run, k: int) -> tuple[list, list]:
        """The scored sequences of a finished completion request (per row: the prompt, the
        completion, and the stop token that ended it where the context has room) and their scores."""
        seqs = []
        for r, g in zip(run.req.rows, run.results):
            ids = list(r.prompt) + list(g.token_ids)
            if g.stop_token is not None and len(ids) < self.llm.context_length:
                ids.append(g.stop_token)
            seqs.append(ids)
        return seqs, await self.logprobs(seqs, k)

    async def chat_logprobs(self, run: Run, k: int) -> list[tuple[list, list]]:
        return await self.logprobs([list(r.prompt) + list(g.token_ids) for r, g in zip(run.req.rows, run.results)], k)

    def piece(self, t: int) -> str:
        return self.tok.decode([t])

    # ------------------------------------------------------------ requests
    def completion_prompts(self, body) -> list:
        """A completion request's prompts as sent (one string or token list, or a list of them),
        each checked to be able to fit the context."""
        p = body.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
            raw = [p]
        elif isinstance(p, list) and p:
            raw = list(p)
        else:
            raise APIError(400, "prompt: empty; give at least one token", param="prompt")
        if body.stream and body.logprobs is not None:
            raise APIError(400, "logprobs: not supported with stream; send a non-streaming request", param="logprobs")
        self.check_prompt_size(raw, "prompt")
        return raw

    def prepare_completion(self, body, raw: list, structured: Structured) -> tuple:
        """On the worker: the prompts encoded, the mode, the options and the compiled grammar."""
        prompts = [self.encode(x) for x in raw]
        plan, params = self.params(body, prompts, default_max=COMPLETION_DEFAULT_MAX_TOKENS, prompt_param="prompt")
        return prompts, plan, params, structured, self.compile(structured, params, body, plan.mode)

    def prepare_chat(self, body, msgs: list[dict], structured: Structured) -> tuple:
        """On the worker: the chat template applied, the mode, the options and the compiled grammar."""
        ids = self.chat_ids(msgs, body.add_generation_prompt, structured.tools)
        if not ids:
            raise APIError(400, "messages: the chat template produced no tokens", param="messages",
                           code="chat_template_error")
        plan, params = self.params(body, [ids], default_max=CHAT_DEFAULT_MAX_TOKENS, prompt_param="messages",
                                   extra_stop_ids=self.chat_stop_ids)
        return [ids], plan, params, structured, self.compile(structured, params, body, plan.mode)

    async def generate(self, request: Request, body, prepared: tuple, *, chat: bool):
        """What both generation endpoints share: submit the rows, then either the SSE stream or
        the finished rows (a `Run`)."""
        prompts, plan, params, structured, grammar = prepared
        req = self.submit(prompts, plan, params, body.n, provisional=provisional(body), grammar=grammar)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return stream_response(self, req, prompts, body, rid, created, chat=chat, structured=structured)
        return Run(self, req, prompts, plan.mode.name, rid, created, await self.collect(request, req))


@dataclasses.dataclass
class Run:
    """A finished non-streamed generation request: its rows and their Generations."""

    srv: Server
    req: ServeRequest
    prompts: list
    mode: str
    rid: str
    created: int
    results: list[Generation]


def provisional(body) -> bool:
    """Whether a request asks for the clover extension's denoising events (streams only)."""
    return bool(body.stream and body.stream_options and body.stream_options.provisional)


def grammar_param(body) -> str | None:
    """The request field that carries the grammar (for a 400's `param`)."""
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_grammar",
                 "guided_choice", "tools"):
        if getattr(body, name, None) is not None:
            return name
    return None


async def disconnected(request: Request) -> None:
    """Returns once the client has gone away (the request body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
