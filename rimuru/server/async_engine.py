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

import numpy as np

from rimuru.engine.outputs import RequestOutput
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.step_metrics import StepMetricsRing
from rimuru.engine.tp_workers import WorkerFailed

log = logging.getLogger(__name__)
GIL_SWITCH_INTERVAL_S = 0.0005  # see AsyncEngine.start
STATS_INTERVAL_S = 0.1  # the engine thread refreshes its stats snapshot at most this often while busy
R = TypeVar("R")


class EngineLike(Protocol):
    """Everything the server uses of an engine (`LLMEngine` is one). Only the engine thread calls it;
    `tokenizer`, `max_model_len` and `vocab_size` are fixed at construction, so they are read once."""

    tokenizer: Any  # a Hugging Face tokenizer, or None for a model served on token ids only
    max_model_len: int
    step_metrics: StepMetricsRing | None  # the engine's per-step ring (vLLM's tokens per step); None: none kept

    @property
    def vocab_size(self) -> int: ...  # prompt token ids lie in [0, vocab_size)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> dict: ...
    def enable_step_profiler(self, num_steps: int, trace_steps: int = 1) -> object: ...
    def step_profile_report(self) -> dict[str, Any] | None: ...
    def observed_routing(self) -> np.ndarray | None: ...  # [L_moe, E] routed assignments so far (elastic mode)


class EngineDeadError(RuntimeError):
    pass


@dataclass
class RequestTiming:
    """One engine request as the server sees it, on the engine's clock (`time.monotonic`, as `RequestMetrics`), so
    the engine's scheduling time compares with the server's own times."""

    arrival: float
    first_token: float | None = None  # when its first output with a token reached the router
    last_token: float | None = None
    scheduled: float | None = None  # first scheduled, from the engine's RequestMetrics (None: not reported)
    num_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache gave it (RequestOutput.num_cached_tokens)
    token_gaps: list[float] = field(default_factory=list)  # between outputs that brought new tokens (vLLM's ITL)


@dataclass
class ChoiceGroup:
    """The n choices of one prompt: vLLM observes n, and the most tokens a choice generated, once all have ended."""

    n: int
    unfinished: int
    most_tokens: int = 0


@dataclass
class FinishedRequest:
    """What the metrics need once a request ends: finished, aborted (client gone) or failed with its step."""

    timing: RequestTiming
    finished_at: float
    prompt_tokens: int
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    max_tokens: int = 0  # its max_tokens, resolved as the engine resolves it
    choices: ChoiceGroup | None = None  # its prompt's choices, updated before the metrics see it


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


@dataclass
class _Route:
    """Where one engine request's outputs go, and what the metrics note about it on the way."""

    loop: asyncio.AbstractEventLoop
    stream: RequestStream
    index: int  # its choice index in the stream
    timing: RequestTiming
    prompt_len: int
    max_tokens: int
    choices: ChoiceGroup


class AsyncEngine:
    """`on_finished` runs on the engine thread once per ended request, also an aborted or failed one (the
    metrics' histograms). The snapshot (`stats()`) adds the server's token counters, counted as tokens arrive."""

    def __init__(self, engine: EngineLike, on_finished: Callable[[FinishedRequest], None] | None = None):
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self._on_finished = on_finished
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        self._routes: dict[str, _Route] = {}  # by engine request id; touched only on the engine thread
        # vLLM's counters, as its engine counts them: a prompt (and the part the prefix cache gave) once its first
        # token is out, generated tokens as they arrive; aborted requests' tokens included
        self._token_counts = {"server_prompt_tokens": 0, "server_prompt_tokens_cached": 0,
                              "server_generation_tokens": 0}
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
    async def add(self, requests: list[tuple[str, list[int], SamplingParams]], n: int = 1) -> RequestStream:
        """Add all requests or none (ValueError from the engine propagates, nothing stays queued). `n`: choices per
        prompt; the requests come prompt by prompt, each prompt's n choices in a row."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(self.abort, [rid for rid, _, _ in requests])
        groups = [ChoiceGroup(n, min(n, len(requests) - start)) for start in range(0, len(requests), n)]

        def add_all() -> None:
            added: list[str] = []
            try:
                for index, (rid, prompt_ids, params) in enumerate(requests):
                    max_tokens = params.max_tokens or self.max_model_len - len(prompt_ids)
                    self._routes[rid] = _Route(loop, stream, index, RequestTiming(arrival=time.monotonic()),
                                               len(prompt_ids), max_tokens, groups[index // n])
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
            now = time.monotonic()
            for rid in request_ids:
                route = self._routes.pop(rid, None)
                if route is not None:
                    self._engine.abort_request(rid)
                    self._ended(route, "abort", now)  # the engine's own abort output finds no route

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
                        if isinstance(exc, WorkerFailed):  # no later step can run: /health answers 503
                            self._dead = exc
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
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StreamItem]]] = {}
        counts = self._token_counts
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:  # aborted meanwhile
                continue
            timing = route.timing
            n_tokens = sum(len(c.token_ids) for c in out.outputs)
            if n_tokens > timing.num_tokens:
                if timing.first_token is None:
                    timing.first_token = now
                    timing.cached_tokens = out.num_cached_tokens or 0
                    counts["server_prompt_tokens"] += route.prompt_len
                    counts["server_prompt_tokens_cached"] += timing.cached_tokens
                elif timing.last_token is not None:
                    timing.token_gaps.append(now - timing.last_token)
                timing.last_token = now
                counts["server_generation_tokens"] += n_tokens - timing.num_tokens
                timing.num_tokens = n_tokens
            if timing.scheduled is None and out.metrics is not None:
                timing.scheduled = out.metrics.first_scheduled_time
            if out.finished:
                del self._routes[out.request_id]
                self._ended(route, out.outputs[0].finish_reason if out.outputs else None, now)
            batches.setdefault(route.loop, []).append((route.stream, (route.index, out)))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the handlers' loop is closed: nobody is listening any more
                pass

    def _ended(self, route: _Route, reason: str | None, now: float) -> None:
        choices = route.choices
        choices.unfinished -= 1
        choices.most_tokens = max(choices.most_tokens, route.timing.num_tokens)
        if self._on_finished is not None:
            self._on_finished(FinishedRequest(route.timing, now, route.prompt_len, reason, route.max_tokens, choices))

    def _fail_all(self, exc: BaseException) -> None:
        now = time.monotonic()
        for rid, route in list(self._routes.items()):
            try:
                self._engine.abort_request(rid)
            except Exception:  # pragma: no cover
                log.exception("abort after failure")
            _post(route.loop, route.stream, exc)
            self._ended(route, "error", now)
        self._routes.clear()

    def _refresh_stats(self) -> None:
        self._stats_time = time.perf_counter()
        try:
            stats = dict(self._engine.stats())
        except Exception:  # pragma: no cover
            log.exception("engine.stats failed")
            return
        stats["server_tracked_requests"] = len(self._routes)
        stats.update(self._token_counts)
        with self._stats_lock:
            self._stats = stats
