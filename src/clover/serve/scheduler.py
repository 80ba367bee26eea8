"""The engine loop: one background thread owns every decoding engine and the model.

Requests arrive from the asyncio side as `ServeRequest`s (one or more rows). Rows wait in a FIFO
queue; before each forward the loop admits waiting rows (up to `max_batch` rows in flight across all
engines) into the engine of their request's `EngineSpec` — rows can only share a forward when
they decode the same way (mode, width, expert budget and rank: equal plans, `Mode.plan`). Engines with rows take
turns, one `step()` (one forward) each, so different specs alternate fairly. Events are routed back
to each request's asyncio queue with `loop.call_soon_threadsafe`.

What a request's queue receives are `clover.api.StreamEvent`s (one `RowStream` per row, the rule
`LLM.stream` uses too), `index` naming the row: "block" after a row committed tokens, "provisional"
after a denoise step (only from an engine built for provisional rows), "done" when the row is over,
"error" when it could not be admitted, its forward failed or the engine thread died (the request is
over).

Failures stay as small as they can: a row whose admission raises (e.g. building its sampler) fails
its own request; a forward that raises fails the requests with rows in that engine; the other rows
go on. Anything else that escapes the loop ends the engine thread: every open request gets an
error, `dead` says why, and `submit` / `call` raise `EngineDead` from then on (the server answers
503 and `/health` turns unhealthy, so a supervisor can restart it).

Admission is first come, first served: rows enter the batch in arrival order. A request refused
with 429 because it has more rows than the free room leaves a reservation of its size for a short
while (`RESERVE_S`): requests with fewer rows that would eat into that room are refused too, so a
large request that retries is not starved by a stream of small ones.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from typing import Callable

from .defaults import MAX_BATCH, MAX_QUEUE

from ..api import RowStream, StreamEvent
from ..decoding.base import DecodeEvent, RowState
from ..decoding.modes import EngineSpec

log = logging.getLogger("clover.serve")


class QueueFull(Exception):
    """The server holds as many rows as it accepts; answer 429."""


class NotAccepting(Exception):
    """The server is shutting down."""


class EngineDead(Exception):
    """The engine thread has died; nothing more can be generated."""


RESERVE_S = 3.0  # how long a refused request's room is held for its retry (Retry-After + slack)


class ServeRequest:
    _ids = itertools.count()

    def __init__(self, rows: list[RowState], spec: EngineSpec, loop: asyncio.AbstractEventLoop,
                 provisional: bool = False) -> None:
        """`spec`: the plan of the rows' engine (`LLM.plan`; a provisional request's plan asks for an
        engine of its own that reports every denoise step, the others' engines skip that work);
        `provisional`: the request streams the clover extension's events."""
        self.id = next(self._ids)
        self.rows = rows
        self.provisional = provisional
        self.spec = spec
        self.streams: list[RowStream] = []  # set by `Scheduler.submit`
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.failed = False
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.open_rows = len(rows)
        for i, r in enumerate(rows):
            r.request_id = (self, i)

    def put(self, item: StreamEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone
            pass


class Scheduler:
    def __init__(self, llm, *, max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE, metrics=None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        if max_queue < 0:
            raise ValueError(f"max_queue: must be >= 0, got {max_queue}")
        self.llm = llm
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics
        self.cv = threading.Condition()
        self.waiting: collections.deque[RowState] = collections.deque()
        self.calls: collections.deque = collections.deque()
        self.engines: dict[tuple, object] = {}
        self.running = 0  # rows in the engines
        self.accepting = True
        self._stop = False
        self._turn = 0
        self.thread: threading.Thread | None = None
        self.dead: str | None = None  # why the engine thread died
        self.reserve: tuple[int, float] | None = None  # (rows, until): room held for a refused request
        # stats (read by /health and tests)
        self.forwards = 0
        self.max_batch_seen = 0
        self.rows_done = 0

    # ------------------------------------------------------------------ async side
    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="clover-engine", daemon=True)
            self.thread.start()

    def capacity(self) -> int:
        return self.max_batch + self.max_queue

    def healthy(self) -> bool:
        return self.dead is None and (self.thread is None or self.thread.is_alive() or self._stop)

    def submit(self, req: ServeRequest) -> None:
        """Queue a request's rows, or raise QueueFull / NotAccepting / EngineDead."""
        with self.cv:
            if self.dead is not None:
                raise EngineDead(f"the engine has stopped ({self.dead})")
            if not self.accepting:
                raise NotAccepting("the server is shutting down")
            n = len(req.rows)
            room = self.max_queue + max(0, self.max_batch - self.running) - len(self.waiting)
            if self.reserve is not None and (time.monotonic() > self.reserve[1] or self.reserve[0] > self.capacity()):
                self.reserve = None
            held = self.reserve[0] if self.reserve is not None and n < self.reserve[0] else 0
            if n > room or (held and room - n < held):
                if n > room and n <= self.capacity() and (self.reserve is None or n >= self.reserve[0]):
                    self.reserve = (n, time.monotonic() + RESERVE_S)
                raise QueueFull(f"the server is at capacity ({self.running} rows running, {len(self.waiting)} waiting)")
            if self.reserve is not None and n >= self.reserve[0]:
                self.reserve = None  # (perhaps) the refused request, back: its room is its own
            req.streams = [RowStream(self.llm, r, i) for i, r in enumerate(req.rows)]
            self.waiting.extend(req.rows)
            self._gauges()
            self.cv.notify()

    def cancel(self, req: ServeRequest) -> None:
        """The client went away: its rows leave the queue / their engine before the next forward."""
        if req.open_rows <= 0 or req.cancelled:
            return
        req.cancelled = True
        with self.cv:
            self.cv.notify()

    async def call(self, fn: Callable):
        """Run `fn()` on the engine thread between forwards (the model is used by one thread only)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.cv:
            if self.dead is not None:
                raise EngineDead(f"the engine has stopped ({self.dead})")
            self.calls.append((fn, fut))
            self.cv.notify()
        return await asyncio.wrap_future(fut)

    def stats(self) -> dict:
        with self.cv:
            return {
                "healthy": self.healthy(),
                "running": self.running,
                "waiting": len(self.waiting),
                "max_batch": self.max_batch,
                "max_queue": self.max_queue,
                "forwards": self.forwards,
                "max_batch_seen": self.max_batch_seen,
                "engines": [str(k) for k in self.engines],
            }

    def stop(self, drain_timeout: float = 10.0) -> None:
        """Stop accepting; let in-flight and queued rows finish for up to `drain_timeout` seconds,
        then cancel what is left (its requests finish with reason "abort") and end the thread."""
        with self.cv:
            self.accepting = False
            self.cv.notify()
        deadline = time.monotonic() + drain_timeout
        while time.monotonic() < deadline and self.thread is not None and self.thread.is_alive():
            with self.cv:
                if not self.waiting and not self.running:
                    break
            time.sleep(0.02)
        with self.cv:
            self._stop = True
            self.cv.notify()
        if self.thread is not None:
            self.thread.join(timeout=30 if self.thread.is_alive() else 0)
            self.thread = None

    # ----------------------------------------------------------------- engine thread
    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self.waiting))
            self.metrics.running.set(self.running)

    def _make_engine(self, spec: EngineSpec):
        """The engine for rows of `spec`."""
        return self.llm.engine(spec)

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - the thread is dying: answer everyone first
            log.exception("the engine thread died")
            with self.cv:
                self.dead = f"{type(e).__name__}: {e}"
            if self.metrics is not None:
                self.metrics.engine_alive.set(0)
            self._fail_all(f"the engine stopped: {self.dead}")
            return
        self._abort_all()

    def _serve(self) -> None:
        while True:
            with self.cv:
                while not (self._stop or self.waiting or self.calls or self.running
                           or any(e.rows for e in self.engines.values())):
                    self.cv.wait(timeout=0.5)
                if self._stop:
                    break
                calls = list(self.calls)
                self.calls.clear()
            for fn, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
                        fut.set_exception(e)
            self._drop_cancelled()
            self._admit()
            self._step_one()

    def _drop_cancelled(self) -> None:
        with self.cv:
            if any(r.request_id[0].cancelled for r in self.waiting):
                self.waiting = collections.deque(r for r in self.waiting if not r.request_id[0].cancelled)
        for key, eng in list(self.engines.items()):
            gone = [r for r in eng.rows if r.request_id[0].cancelled]
            if not gone:
                continue
            for r in gone:
                eng.cancel(r, "cancelled")
                r.request_id[0].open_rows -= 1
            self._rows_left(len(gone))

    def _rows_left(self, n: int) -> None:
        with self.cv:
            self.running -= n
            self._gauges()

    def _admit(self) -> None:
        while True:
            with self.cv:
                if not self.waiting or self.running >= self.max_batch:
                    return
                row = self.waiting.popleft()
                self.running += 1
                self._gauges()
            req = row.request_id[0]
            eng = self.engines.get(req.spec)
            if eng is None:
                try:
                    eng = self.engines[req.spec] = self._make_engine(req.spec)
                except Exception as e:  # noqa: BLE001
                    log.exception("cannot build a decoding engine")
                    self._rows_left(1)
                    self._fail(req, f"cannot build the decoding engine: {type(e).__name__}: {e}")
                    continue
            try:
                events = eng.add(row)
            except Exception as e:  # noqa: BLE001 - this row's request fails; the others go on
                log.exception("cannot admit a row")
                if row in eng.rows:
                    eng.cancel(row, "abort")
                self._rows_left(1)
                self._fail(req, f"cannot start the row: {type(e).__name__}: {e}")
                continue
            self._route(events)

    def _step_one(self) -> None:
        busy = [k for k, e in self.engines.items() if e.rows]
        for k in [k for k, e in self.engines.items() if not e.rows]:
            del self.engines[k]
        if not busy:
            return
        key = busy[self._turn % len(busy)]
        self._turn += 1
        eng = self.engines[key]
        n = len(eng.rows)
        try:
            events = eng.step()
        except Exception as e:  # noqa: BLE001 - the engine's rows fail; the server goes on
            log.exception("engine step failed")
            rows = list(eng.rows)
            del self.engines[key]
            self._rows_left(len(rows))
            for req in {r.request_id[0]: None for r in rows}:
                self._fail(req, f"decoding failed: {type(e).__name__}: {e}")
            return
        self.forwards += 1
        self.max_batch_seen = max(self.max_batch_seen, n)
        if self.metrics is not None:
            self.metrics.forwards.inc()
            self.metrics.batch_size.observe(n)
            choices = getattr(eng, "choices", None)
            if choices and choices[-1].forward == eng.forwards - 1:  # block_size="auto" just (re)chose: say why
                for w, tps in choices[-1].expected.items():
                    self.metrics.auto_expected.labels(str(w)).set(tps)
                self.metrics.auto_width.set(choices[-1].width)
        self._route(events)

    def _route(self, events: list[DecodeEvent]) -> None:
        for ev in events:
            row = ev.row_state
            if row is None or row.request_id is None:
                continue
            req, idx = row.request_id
            if ev.kind == "finish":
                self._finished(req, idx, row)
                continue
            if req.cancelled:
                continue
            try:
                if ev.kind == "commit" and req.first_token is None:
                    req.first_token = time.perf_counter()
                    if self.metrics is not None:
                        self.metrics.ttft.observe(req.first_token - req.arrival)
                req.put(req.streams[idx].event(ev))
            except Exception as e:  # noqa: BLE001 - e.g. decoding the text: this request fails
                log.exception("cannot report a commit")
                self._fail(req, f"cannot report the row: {type(e).__name__}: {e}")

    def _finished(self, req: ServeRequest, idx: int, row: RowState) -> None:
        # every admitted row held a slot, including one that finished inside add() (max_tokens=0)
        self._rows_left(1)
        self.rows_done += 1
        req.open_rows -= 1
        if req.failed:
            return
        try:
            done = req.streams[idx].done()
        except Exception as e:  # noqa: BLE001
            log.exception("cannot build a row's result")
            self._fail(req, f"cannot report the row: {type(e).__name__}: {e}")
            return
        if self.metrics is not None:
            self.metrics.completion_tokens.inc(len(row.tokens))
            if row.forwards:
                self.metrics.tokens_per_forward.observe(len(row.tokens) / row.forwards)
                if row.block_steps:  # a threshold-decoded (diffusion) row
                    self.metrics.forced_share.observe(row.forced_steps / row.forwards)
                for w in row.block_widths:
                    self.metrics.block_width.labels(str(w)).inc()
            if req.open_rows == 0:
                self.metrics.latency.observe(time.perf_counter() - req.arrival)
        req.put(done)

    def _fail(self, req: ServeRequest, message: str) -> None:
        """`req` is over with an error; its other rows leave the queue / their engines before the
        next forward (as if its client had gone away)."""
        if req.failed:
            return
        req.failed = req.cancelled = True
        req.put(StreamEvent("error", text=message))

    def _fail_all(self, message: str) -> None:
        """The thread is dying: every open request gets an error (nothing here may raise)."""
        with self.cv:
            self.accepting = False
            rows = list(self.waiting)
            self.waiting.clear()
            for eng in self.engines.values():
                rows.extend(getattr(eng, "rows", []))
            self.engines.clear()
            self.running = 0
            calls = list(self.calls)
            self.calls.clear()
        for req in {r.request_id[0]: None for r in rows if r.request_id is not None}:
            with contextlib.suppress(Exception):
                self._fail(req, message)
        for _, fut in calls:
            with contextlib.suppress(Exception):
                fut.set_exception(EngineDead(message))
        with contextlib.suppress(Exception):
            self._gauges()

    def _abort_all(self) -> None:
        with self.cv:
            left = list(self.waiting)
            self.waiting.clear()
        for eng in self.engines.values():
            left.extend(eng.rows)
        self.engines.clear()
        for row in left:
            row.cancel("abort")
            req, idx = row.request_id
            req.open_rows -= 1
            if req.failed:
                continue
            try:
                req.put(req.streams[idx].done())
            except Exception as e:  # noqa: BLE001
                self._fail(req, f"cannot report the row: {type(e).__name__}: {e}")
        with self.cv:
            self.running = 0
            self._gauges()
