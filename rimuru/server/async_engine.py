"""The engine driven by ONE background thread; asyncio handlers talk to it through queues.

The engine is not thread-safe, so every call into it (add, abort, step, stats) happens on the
engine thread. Handlers submit commands (closures) and await their result; outputs are routed to
a per-HTTP-request asyncio queue, one `loop.call_soon_threadsafe` per step.

    handler --submit(add)--> command queue --> engine thread: add_request / abort / step()
    handler <--(index, RequestOutput)-- per-request asyncio.Queue <-- routed by request id

Invariant: a request id lives in `_routes` from a successful add until its finished output or
its abort; `close()` on a stream aborts whatever it still owns, so a vanished client leaks nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from rimuru.engine.outputs import RequestOutput
from rimuru.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
GIL_SWITCH_INTERVAL_S = 0.0005  # see AsyncEngine.start
STATS_INTERVAL_S = 0.1  # the engine thread refreshes its stats snapshot at most this often while busy
R = TypeVar("R")


class EngineLike(Protocol):
    """Everything the server uses of an engine (`LLMEngine` is one). Only the engine thread calls it;
    `tokenizer`, `max_model_len` and `vocab_size` are fixed at construction, so they are read once."""

    tokenizer: Any  # a Hugging Face tokenizer, or None for a model served on token ids only
    max_model_len: int

    @property
    def vocab_size(self) -> int: ...  # prompt token ids lie in [0, vocab_size)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> dict: ...
    def enable_step_profiler(self, num_steps: int, trace_steps: int = 1) -> object: ...
    def step_profile_report(self) -> dict[str, Any] | None: ...


class EngineDeadError(RuntimeError):
    pass


@dataclass
class RequestTiming:
    arrival: float
    first_token: float | None = None
    num_tokens: int = 0


@dataclass
class FinishedRequest:
    """What the metrics need once a request ends."""

    timing: RequestTiming
    finished_at: float
    prompt_tokens: int
    finish_reason: str | None


StreamItem = tuple[int, RequestOutput] | BaseException  # (choice index, output), or the failure that ended it


@dataclass
class RequestStream:
    """All engine requests of one HTTP request (n choices x prompts), read as one stream."""

    abort: Callable[[list[str]], None]  # aborts engine requests; safe from any thread
    request_ids: list[str]
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.unfinished = set(self.request_ids)

    async def next(self, timeout: float | None = None) -> tuple[int, RequestOutput]:
        return self._take(await asyncio.wait_for(self.queue.get(), timeout))

    def _take(self, item: StreamItem) -> tuple[int, RequestOutput]:
        if isinstance(item, BaseException):
            raise item
        index, out = item
        if out.finished:
            self.unfinished.discard(out.request_id)
        return index, out

    async def next_batch(self) -> list[tuple[int, RequestOutput]]:
        """Waits for one output, then takes every output already queued behind it, and returns the latest per
        choice (outputs are cumulative, so a later one covers an earlier one). When the event loop falls behind
        the engine, a stream then costs one chunk per loop turn instead of one per engine step."""
        latest = dict([self._take(await self.queue.get())])
        while True:
            try:
                item = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                break
            index, out = self._take(item)
            latest.pop(index, None)  # keep arrival order: the choice moves to the end
            latest[index] = out
        return list(latest.items())

    def done(self) -> bool:
        return not self.unfinished

    def close(self) -> None:
        """Abort what is still running (client gone, error, or cancelled)."""
        if self.unfinished:
            self.abort(list(self.unfinished))
            self.unfinished.clear()


def _post(loop: asyncio.AbstractEventLoop, stream: RequestStream, item: StreamItem) -> None:
    try:
        loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:  # the handler's loop is closed: nobody is listening any more
        pass


def _deliver(batch: list[tuple[RequestStream, StreamItem]]) -> None:
    """On the event loop: one step's outputs into their streams' queues."""
    for stream, item in batch:
        stream.queue.put_nowait(item)


class AsyncEngine:
    """`on_finished` runs on the engine thread once per finished request (the metrics' latency histograms)."""

    def __init__(self, engine: EngineLike, on_finished: Callable[[FinishedRequest], None] | None = None):
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self._on_finished = on_finished
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        # request id -> (loop, stream, choice index, timing, prompt length); touched only on the engine thread
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream, int, RequestTiming, int]] = {}
        self._stats: dict = {}
        self._stats_lock = threading.Lock()
        self._stats_time = 0.0
        self._stop = threading.Event()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rimuru-engine", daemon=True)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        # Two threads share the GIL: the engine thread (the step's critical path) and the event loop (HTTP,
        # streaming). When the engine thread comes back from a GPU wait while the loop runs Python, it waits
        # for the loop to drop the GIL: by default up to 5 ms, as long as a whole decode step.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._refresh_stats()
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put((lambda: None, concurrent.futures.Future()))
        self._thread.join(timeout=30)

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def stats(self) -> dict:
        with self._stats_lock:
            return dict(self._stats)

    # ---- called from asyncio handlers --------------------------------------------------------
    async def add(self, requests: list[tuple[str, list[int], SamplingParams]]) -> RequestStream:
        """Add all requests or none (ValueError from the engine propagates, nothing stays queued)."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(self.abort, [rid for rid, _, _ in requests])

        def add_all() -> None:
            added: list[str] = []
            try:
                for index, (rid, prompt_ids, params) in enumerate(requests):
                    timing = RequestTiming(arrival=time.perf_counter())
                    self._routes[rid] = (loop, stream, index, timing, len(prompt_ids))
                    self._engine.add_request(rid, prompt_ids, params)
                    added.append(rid)
            except BaseException:
                for rid in added:
                    self._engine.abort_request(rid)
                for rid, _, _ in requests:
                    self._routes.pop(rid, None)
                raise

        await self._call(add_all)
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Fire and forget: safe from any thread, also from a cancelled handler."""

        def abort_all() -> None:
            for rid in request_ids:
                if self._routes.pop(rid, None) is not None:
                    self._engine.abort_request(rid)

        self._commands.put((abort_all, concurrent.futures.Future()))

    async def run_in_engine_thread(self, fn: Callable[[EngineLike], R]) -> R:
        """Runs `fn(engine)` on the engine thread between two steps and returns its result. The engine is not
        thread-safe, so this is the only way a handler reaches it."""
        engine = self._engine
        return await self._call(lambda: fn(engine))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        if not self.healthy:
            raise EngineDeadError(f"engine loop is not running: {self._dead!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        return await asyncio.wrap_future(fut)

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                idle = not self._engine.has_unfinished_requests()
                self._drain_commands(block=idle)
                if self._engine.has_unfinished_requests():
                    try:
                        outputs = self._engine.step()
                    except Exception as exc:  # a failed step fails its requests, not the server
                        log.exception("engine step failed")
                        self._fail_all(exc)
                        continue
                    self._route(outputs)
                # engine.stats() walks the allocator: a few times a second is enough for /metrics (and the
                # sweep's 0.5 s scrape), not after every ~10 ms step
                if idle or time.perf_counter() - self._stats_time >= STATS_INTERVAL_S:
                    self._refresh_stats()
        except BaseException as exc:  # pragma: no cover - the loop itself broke
            log.exception("engine loop died")
            self._dead = exc
            self._fail_all(EngineDeadError(str(exc)))

    def _drain_commands(self, block: bool) -> None:
        try:
            fn, fut = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:
                    fut.set_exception(exc)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    def _route(self, outputs: list[RequestOutput]) -> None:
        """One `call_soon_threadsafe` per event loop and step, not per request: every such call writes the
        loop's wake-up pipe, and each syscall hands the GIL to the loop thread, which the engine thread then
        waits to get back: one call per request would cost ~50 GIL hand-overs per step with ~50 streams."""
        now = time.perf_counter()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StreamItem]]] = {}
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:  # aborted meanwhile
                continue
            loop, stream, index, timing, prompt_len = route
            n_tokens = sum(len(c.token_ids) for c in out.outputs)
            if n_tokens > 0 and timing.first_token is None:
                timing.first_token = now
            timing.num_tokens = n_tokens
            if out.finished:
                del self._routes[out.request_id]
                if self._on_finished is not None:
                    reason = out.outputs[0].finish_reason if out.outputs else None
                    self._on_finished(FinishedRequest(timing, now, prompt_len, reason))
            batches.setdefault(loop, []).append((stream, (index, out)))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the handlers' loop is closed: nobody is listening any more
                pass

    def _fail_all(self, exc: BaseException) -> None:
        for rid, (loop, stream, _, _, _) in list(self._routes.items()):
            try:
                self._engine.abort_request(rid)
            except Exception:  # pragma: no cover
                log.exception("abort after failure")
            _post(loop, stream, exc)
        self._routes.clear()

    def _refresh_stats(self) -> None:
        self._stats_time = time.perf_counter()
        try:
            stats = dict(self._engine.stats())
        except Exception:  # pragma: no cover
            log.exception("engine.stats failed")
            return
        stats["server_tracked_requests"] = len(self._routes)
        with self._stats_lock:
            self._stats = stats
