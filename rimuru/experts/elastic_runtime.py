"""`elastic` mode's runtime on a device: the decisions of elastic_core.py, plus what only a device has: the grow
copies and their events, the expert-table writes, the load buffers' pages, routing counts read from the GPU and
the wall-clock times of the passes that the cost-aware adjuster learns from.

Ordering, per step (the engine calls these in the order of experts/runtime.py):
  * begin_step: the load buffers take pages if an expert is out; the grows whose copies have completed (their
    events, asked without waiting) enter the tables, the others stay growing and are read where they were (host
    memory, a load buffer) until a later step finds them done: no pass waits for a copy, and no kernel queued
    after this can read a half-copied expert;
  * plan (after the step's pass was queued): evicted experts stay in the tables (their pages are deferred-freed by
    the allocator until the end of the step); grow copies go into freshly reserved pages on the loader's copy
    stream, behind the pass fence (memory/pass_fence.py), since those pages may be read by a pass still in flight;
  * after_pass: evicted experts leave the tables (a fill queued on the compute stream, after the pass).

Step times. Sync: `before_pass` -> `after_pass` brackets the pass (the host waited for it), less the plan's own
host time, which runs between them. Async scheduling: after_pass
runs while the pass it follows is still in flight, so a pass's time is the interval between consecutive
after_pass calls (the loop runs at the GPU's pace) and routing counts are read one step late (non-blocking copy).
A pass that replays piecewise graphs (some expert offloaded) is timed without the piecewise overhead the engine
measured, so the compute estimate is the same whichever graphs ran; the cost adjuster charges it to offloading. A
pass above the largest captured graph (--max-cudagraph-capture-size) runs eagerly and is charged it too: its own
eager launches cost more, so its compute reads a little low (the tracker keeps such batch sizes apart).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from rimuru.experts.adjuster import AdjustPlan
from rimuru.experts.cache import ExpertCache
from rimuru.experts.elastic_core import ElasticCore
from rimuru.experts.host_store import HostExpertStore
from rimuru.experts.loader import ExpertLoader
from rimuru.experts.offload_provider import OffloadExpertProvider
from rimuru.experts.offload_runtime import OffloadRuntime
from rimuru.experts.residency import EXPERT
from rimuru.experts.routing_counter import HOST_BUFFERS, RoutingCounter
from rimuru.experts.runtime import GraphPlan, StepDemand
from rimuru.experts.static_provider import StaticExpertProvider
from rimuru.memory.host_wait import wait_for


@dataclass
class _PassCounts:
    """One pass's routing counts on their way to the host (async steps), with what reading them needs."""

    host: torch.Tensor  # [L, E] pinned, valid once `done` has completed
    done: torch.cuda.Event | None  # None on the CPU: ready
    absent: np.ndarray | None  # the experts the pass found offloaded (_absent_during_pass)
    decode: bool  # the pass carried one token per sequence
    observed: bool = False  # the next call has looked at the pass's time (set `forward`, or found none)
    forward: tuple[float, int, int, float] | None = None  # (seconds, copy bytes, tokens, host-tier seconds)


class ElasticRuntime(OffloadRuntime):
    def __init__(self, core: ElasticCore, cache: ExpertCache, store: HostExpertStore, loader: ExpertLoader,
                 provider: OffloadExpertProvider | StaticExpertProvider, counter: RoutingCounter,
                 pcie_bandwidth: float, async_steps: bool) -> None:
        super().__init__(cache, store, loader, provider, mode="elastic")
        self.core = core
        self.counter = counter  # routing counts of each pass feed the online popularity estimate
        self.pcie_bandwidth = pcie_bandwidth  # bytes/s, measured at start-up: nominal copy time of a pass's bytes
        self.async_steps = async_steps
        self.piecewise_overhead_s = 0.0
        # grow copies not yet committed, with their experts (none on the CPU, where a copy is done on return)
        self._grow_events: list[tuple[tuple[int, int], torch.cuda.Event]] = []
        self._plan_s = 0.0  # host seconds of this step's plan (sync timing: it runs between launch and after_pass)
        # (monotonic time, loader bytes, host-tier seconds) when tokens ran
        self._forward_start: tuple[float, int, float] | None = None
        self._tokens = 0  # batched tokens of the pass launched this step
        self._tokens_in_flight = 0  # async: the same for the pass launched one step earlier
        self._decode = False  # the pass launched this step carries one token per sequence
        # async: the routing-count snapshots not read yet, oldest first (at most HOST_BUFFERS - 1 between calls)
        self._unread: deque[_PassCounts] = deque()
        self._last_after_pass: tuple[float, int, float] | None = None
        self._copy_bytes: int | None = None  # bytes loaded for the pass in flight (async)
        self._host_s: float = 0.0  # host-tier seconds spent queueing the pass in flight (async)
        self._piecewise_in_flight = False  # async: the pass launched one step earlier had an expert offloaded
        # loader (hits + misses, prefetched + on_demand) and host tier (experts, seconds) at the last observation
        self._loads_seen: tuple[int, int, int, float] = (0, 0, 0, 0.0)

    def graph_plan(self) -> GraphPlan:
        # passes with every expert resident replay whole graphs over the live tables, unless the pool can never
        # hold every expert at once (free pages at start, before any KV, cannot take the offloaded ones back)
        offloaded = self.cache.num_offloaded
        can_all_fit = 3 * offloaded <= self.cache.allocator.mid_capacity(EXPERT)
        resident = StaticExpertProvider(self.cache.expert_view, self.cache.tables, self.counter) if can_all_fit \
            else None
        return GraphPlan(counter=self.counter, piecewise=self.provider, resident=resident)

    def set_piecewise_overhead(self, seconds: float) -> None:
        self.piecewise_overhead_s = seconds
        self.core.adjuster.set_piecewise_overhead(seconds)

    # ------------------------------------------------------------------ the scheduler's questions
    def reclaimable_kv_pages(self) -> int:
        return self.core.reclaimable_kv_pages()

    def admission_reserve_kv_pages(self) -> int:
        return self.core.admission_reserve_kv_pages()

    def evictable_kv_pages(self) -> int:
        return self.core.evictable_kv_pages()

    def mid_pages_awaited(self) -> int:
        return self.core.mid_pages_awaited()

    # ------------------------------------------------------------------ one step
    def begin_step(self) -> None:
        pages = self.core.attach_buffers()
        if pages is not None:
            self.loader.add_slots(pages)
        # grows whose copies have completed enter the tables; the others stay growing, still read where they were,
        # so no pass ever waits for a copy (a copy waits for the passes launched before its plan: the pass fence)
        done: list[tuple[int, int]] = []
        pending = []
        for expert, event in self._grow_events:
            if event.query():
                done.append(expert)
            else:
                pending.append((expert, event))
        self._grow_events = pending
        self.cache.write_rows(self.core.commit_grows(done) if pending else self.core.commit_grows())

    def plan(self, demand: StepDemand) -> AdjustPlan:
        t0 = time.monotonic()
        moves = self.core.plan(demand)
        self._decode = 0 < demand.num_batched_tokens == demand.num_scheduled
        for (layer, expert), pages in moves.grow:
            done = self.loader.copy_to_pages(layer, expert, pages)
            if done is not None:
                self._grow_events.append(((layer, expert), done))
        self._plan_s = time.monotonic() - t0
        return moves.adjust_plan

    def before_pass(self, num_tokens: int) -> None:
        """The pass is about to be queued. Requests that finished meanwhile (async scheduling) may have left the
        batch: the pass can be smaller than scheduled, or not launched at all (0: no pass is timed this step)."""
        self._time_pass(num_tokens)
        super().before_pass(num_tokens)

    def _time_pass(self, num_tokens: int) -> None:
        """The pass of `num_tokens` tokens is about to be queued: its timing starts (none for 0: no pass)."""
        self._tokens = num_tokens
        self._plan_s = 0.0
        self._forward_start = ((time.monotonic(), self.loader.counters.bytes_loaded, self.host_compute_s)
                               if num_tokens > 0 else None)

    def after_pass(self) -> None:
        absent = self._absent_during_pass()  # before the evicted leave the tables: the pass read them resident
        end = self.core.after_pass()
        self.cache.clear_rows(end.evicted)
        if end.released_buffer_pages:
            self.loader.detach()  # the core owns the pages and has deferred-freed them
        self._observe_loads()
        if self.async_steps:
            self._after_pass_async(absent)
            return
        counts = self.counter.snapshot_and_reset().numpy()
        read = self._read_from_host(counts, absent, self._decode and self._forward_start is not None)
        step_cost = self.core.step_cost
        if step_cost is not None and self._forward_start is not None:
            t0, bytes0, host0 = self._forward_start
            copy_s = (self.loader.counters.bytes_loaded - bytes0 + read) / self.pcie_bandwidth
            overhead = (self.piecewise_overhead_s if self.core.launched_offloaded else 0.0) + self._plan_s
            step_cost.observe_forward(max(0.0, time.monotonic() - t0 - overhead), copy_s, self._tokens,
                                      host_s=self.host_compute_s - host0, decode=self._decode)
        self._forward_start = None
        self.core.observe_routing(counts)

    def _absent_during_pass(self) -> np.ndarray | None:
        """Which experts the pass just launched found offloaded, where the kernel reads them from host memory
        (DirectElasticRuntime: their flat ids l * E + e, None when none is); None here: every offloaded expert the
        pass read was copied, and counted so."""
        return None

    def _read_from_host(self, counts: np.ndarray, absent: np.ndarray | None, decode: bool) -> int:
        """Bytes a pass with routing `counts` [L, E] read from host memory without a copy (DirectElasticRuntime;
        `absent` as _absent_during_pass gave it for that pass; `decode`: one token per sequence)."""
        return 0

    def _after_pass_async(self, absent: np.ndarray | None) -> None:
        # Between the previous call and this one the loop ran at the GPU's pace: that interval is the time of the
        # pass launched at the previous call (pass n). The bytes loaded in the interval were issued for the pass
        # launched now (n+1), so pass n's copies are the previous interval's bytes (`_copy_bytes`).
        # Routing counts are snapshot after each pass (non-blocking) and read once their copy is done, never
        # waited for while the GPU runs: pass n's counts (and with them pass n's observation, which needs its
        # reads from host memory) are read at the next call, when pass n has long finished.
        now, loaded, host_now = time.monotonic(), self.loader.counters.bytes_loaded, self.host_compute_s
        ran = self._forward_start is not None
        step_cost = self.core.step_cost
        previous = self._unread[-1] if self._unread else None  # pass n's counts, waiting for its observation
        if previous is not None:
            previous.observed = True
        if ran and self._last_after_pass is not None:
            t0, bytes0, host0 = self._last_after_pass
            if step_cost is not None and self._copy_bytes is not None and previous is not None:
                overhead = self.piecewise_overhead_s if self._piecewise_in_flight else 0.0
                previous.forward = (max(0.0, now - t0 - overhead), self._copy_bytes, self._tokens_in_flight,
                                    self._host_s)
            self._copy_bytes = loaded - bytes0
            self._host_s = host_now - host0
        self._piecewise_in_flight = self.core.launched_offloaded and ran
        self._tokens_in_flight = self._tokens if ran else 0
        self._last_after_pass = (now, loaded, host_now) if ran else None
        if not ran:
            self._copy_bytes = None
        self._forward_start = None
        self._read_counts(block=False)
        # the snapshot below takes the buffer of the counts HOST_BUFFERS calls ago: those must have been read
        while len(self._unread) >= HOST_BUFFERS:
            self._read_counts(block=True, first_only=True)
        host, done = self.counter.snapshot_and_reset_async()
        self._unread.append(_PassCounts(host, done, absent, decode=self._decode and ran))

    def _read_counts(self, block: bool, first_only: bool = False) -> None:
        """Reads the oldest snapshots whose copies are done (`block`: waits for the first), in pass order: each
        pass's reads from host memory and its observation for the cost tracker, then the popularity estimate."""
        while self._unread:
            first = self._unread[0]
            if not first.observed and not block:
                return
            if first.done is not None and not first.done.query():
                if not block:
                    return
                wait_for(first.done)
            self._unread.popleft()
            counts = first.host.numpy()
            read = self._read_from_host(counts, first.absent, first.decode)
            step_cost = self.core.step_cost
            if first.forward is not None and step_cost is not None:
                seconds, copy_bytes, tokens, host_s = first.forward
                step_cost.observe_forward(seconds, (copy_bytes + read) / self.pcie_bandwidth, tokens, host_s=host_s,
                                          decode=first.decode)
            self.core.observe_routing(counts)
            if first_only:
                return

    def _observe_loads(self) -> None:
        """The loader's routed and copied experts since the last call feed the cost tracker's copy excess."""
        if self.core.step_cost is None:
            return
        c = self.loader.counters
        now = (c.hits + c.misses, c.prefetched + c.on_demand, self.host_experts_computed, self.host_compute_s)
        seen = self._loads_seen
        self._loads_seen = now
        self.core.step_cost.observe_loads(now[0] - seen[0], now[1] - seen[1], host=now[2] - seen[2],
                                          host_s=now[3] - seen[3])

    def observed_routing(self) -> np.ndarray | None:
        return self.core.popularity.routed.copy()

    def memory_split(self) -> dict[str, int]:
        split = super().memory_split()
        split["load_buffers"] = len(self.core.buffer_pages) * self.cache.expert_page_bytes
        return split

    def stats(self) -> dict[str, float]:
        c = self.core.counters
        return {**super().stats(), "expert_evictions": c.evictions, "expert_grows": c.grows,
                "expert_reranks": c.reranks, "expert_copy_bandwidth": self.pcie_bandwidth, **self.core.stats()}
