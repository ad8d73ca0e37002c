"""Elastic mode: the boundary between expert pages and KV pages moves every step.

The engine calls, in this order (DESIGN.md section 6):

    step N:   commit_grows()          grows decided at step N-1 whose copies completed enter the tables
              scheduler.schedule()    KV pages for running/waiting requests; shortfall for the next one
              adjust(shortfall)       the adjuster's plan: evictions begin (pages deferred, experts still
                                      readable), grows reserve pages and start their copies
              forward pass N
              after_forward()         evicted experts leave the tables; then allocator.complete_forward()
                                      returns their pages, which serve waiting requests from step N+1

Load buffers (experts/loader.py, 2 x 3 x limit mid pages) are held only while some expert is offloaded: with
every expert resident they would be KV cache (Qwen1.5-MoE at 32 GiB: 346 MB, ~1,760 tokens). That holds where
they are at most a quarter of what offloading frees at the limits (2 limit <= L limit / 4: at least 8 MoE
layers, `lazy_buffers`); with fewer layers they are held for good, since evicting would first have to pay for
them. A plan that would offload the first expert also frees the pages the buffers need (`with_buffer_pages`:
more evictions, or none); commit_grows() of the next step attaches them, before the first pass whose tables
lack an expert. after_forward() detaches them once a pass ran with every expert resident and none is moving
(their pages are deferred-freed).

Ordering is enforced here, not left to callers: a grown expert enters the table only in commit_grows(),
after the compute stream has waited on its copy event; an evicted expert's pages are deferred-freed, so
the allocator cannot hand them out before complete_forward(), which the engine calls after the forward
pass that may still read them has finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from rimuru.experts.adjuster import (
    Adjuster,
    AdjusterState,
    AdjustPlan,
    reclaimable_experts,
    shortfall_mid_pages,
    with_buffer_pages,
)
from rimuru.experts.cache import EXPERT, ExpertCache
from rimuru.experts.loader import BUFFER_OWNER, ExpertLoader, load_buffer_pages
from rimuru.experts.popularity import OnlinePopularity
from rimuru.experts.routing_counter import RoutingCounter
from rimuru.experts.step_cost import StepCostTracker


@dataclass
class PendingGrow:
    layer: int
    expert: int
    done: torch.cuda.Event | None  # None on the CPU: the copy was synchronous


@dataclass
class ElasticCounters:
    evictions: int = 0
    grows: int = 0
    reranks: int = 0
    last_plan: AdjustPlan = field(default_factory=AdjustPlan)


class ElasticController:
    def __init__(self, cache: ExpertCache, loader: ExpertLoader, adjuster: Adjuster, popularity: OnlinePopularity,
                 offload_limit: int, smalls_per_mid: int, counter: RoutingCounter | None = None,
                 step_cost: StepCostTracker | None = None, pcie_bandwidth: float = 52e9,
                 lazy_buffers: bool = False) -> None:
        self.cache = cache
        self.loader = loader
        self.adjuster = adjuster
        self.popularity = popularity
        self.offload_limit = offload_limit
        self.smalls_per_mid = smalls_per_mid
        self.counter = counter  # routing counts of each step feed the online popularity estimate
        self.pending: list[PendingGrow] = []
        self.lazy_buffers = lazy_buffers  # load buffers only while an expert is offloaded (module docstring)
        self.counters = ElasticCounters()
        # cost-aware adjusters read the measured forward time: adjust() -> after_forward() brackets the pass
        self.step_cost = step_cost
        self.pcie_bandwidth = pcie_bandwidth
        self._forward_start: tuple[float, int] | None = None  # (monotonic time, loader bytes) when tokens ran
        self._tokens = 0  # batched tokens of the pass launched this step (`launching`; compute is per batch size)
        self._tokens_in_flight = 0  # async: the same for the pass launched one step earlier
        # async scheduling (LLMEngine sets it): after_forward runs while the pass it follows is still in flight,
        # so routing counts are read one step late (non-blocking copy) and a step's time is the interval
        # between consecutive after_forward calls (the loop runs at the GPU's pace)
        self.async_steps = False
        self._counts_in_flight: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._last_after_forward: tuple[float, int] | None = None
        self._copy_bytes: int | None = None  # bytes loaded for the pass in flight (async)
        # A pass with any expert offloaded replays piecewise graphs, which cost this much more than whole ones
        # (the engine measures it at start-up; 0 without graphs). Step times are fed to the cost tracker without
        # it, so the compute estimate is the same whichever graphs ran; the cost adjuster charges it to n > 0.
        self.piecewise_overhead_s = 0.0
        self._loads_seen = (0, 0)  # loader (hits + misses, prefetched + on_demand) at the last observe_loads
        self._launch_piecewise = False  # the pass launched this step: some expert offloaded (set in adjust)
        self._piecewise_in_flight = False  # async: the same for the pass launched one step earlier

    def reclaimable_kv_pages(self) -> int:
        """KV pages that evicting the experts the limits and the adjuster still allow would free (after the
        moves in flight). The scheduler lets a running request short of pages wait for these instead of
        preempting it; a cost-aware adjuster bounds them by what its model allows (`max_offloaded`)."""
        E = self.cache.num_experts
        offloaded = [E - len(r) for r in self.cache.planned_resident()]
        experts = reclaimable_experts(offloaded, self.offload_limit, self.adjuster.max_offloaded())
        buffers = self.buffer_mid_pages() if experts and not self.loader.attached else 0  # the first eviction pays
        return max(0, experts * 3 - buffers) * self.smalls_per_mid

    def buffer_mid_pages(self) -> int:
        """Mid pages the two load buffers take while any expert is offloaded."""
        return load_buffer_pages(self.loader.limit)

    def cost_stats(self) -> dict[str, float]:
        """The cost adjuster's view, for /metrics and the sweeps' timelines: the compute estimate of its last plan,
        the copies' measured overlap and slowdown, the split it aims for and its stall bound, and the mid pages it
        keeps from admissions. Empty with the paper's adjuster."""
        if self.step_cost is None:
            return {}
        out = {"cost_copy_overlap": self.step_cost.copy_overlap_share(),
               "cost_copy_slowdown": self.step_cost.copy_slowdown(),
               "cost_copy_excess": self.step_cost.copy_excess(),
               "cost_grow_reserve_mid_pages": float(self.adjuster.grow_reserve())}
        last = getattr(self.adjuster, "last", None)
        if last is not None:
            out["cost_target_offloaded"] = float(last.target)
            if last.compute_s is not None:
                out["cost_compute_ms"] = 1e3 * last.compute_s
            if last.max_allowed is not None:
                out["cost_max_offloaded"] = float(last.max_allowed)
        return out

    def admission_reserve_kv_pages(self) -> int:
        """KV pages the scheduler keeps free from new admissions: the pages the adjuster's grows are waiting for."""
        return self.adjuster.grow_reserve() * self.smalls_per_mid

    def commit_grows(self) -> None:
        """Grows whose copies were issued in an earlier step enter the tables. The compute stream first waits
        for each copy event, so no kernel queued after this can read a half-copied expert. Then, if the last
        step's evictions left an expert out of the tables, the load buffers take their pages (before this step's
        scheduler can give them to KV)."""
        if not self.loader.attached and not self.cache.all_resident():
            pages = self.cache.allocator.allocate_mid(EXPERT, self.buffer_mid_pages(), owner=BUFFER_OWNER)
            if pages is None:  # with_buffer_pages evicted enough for them: a broken invariant, not a full pool
                raise RuntimeError(f"no {self.buffer_mid_pages()} free mid pages for the load buffers after evicting")
            self.loader.attach(pages)
        for g in self.pending:
            if g.done is not None:
                torch.cuda.current_stream().wait_event(g.done)
            self.cache.commit_grow(g.layer, g.expert)
        self.pending = []

    def observe(self, routed: np.ndarray) -> None:
        """Routing counts [L, E] of the last step: the online popularity estimate, re-ranking stale layers."""
        self.popularity.update(routed)
        self.counters.reranks += len(self.popularity.maybe_rerank())

    def adjust(self, shortfall_kv_pages: int, num_batched_tokens: int = 0, num_running: int = 0,
               num_waiting: int = 0, num_stalled: int = 0, max_num_seqs: int | None = None) -> AdjustPlan:
        allocator = self.cache.allocator
        state = AdjusterState(
            shortfall_mid_pages=shortfall_mid_pages(max(0, shortfall_kv_pages), self.smalls_per_mid),
            free_mid_pages=allocator.mid_capacity(EXPERT),
            resident=self.cache.planned_resident(),
            probabilities=self.popularity.probabilities(),  # the array; no validated object per step
            rankings=self.popularity.rankings,
            offload_limit=self.offload_limit,
            num_batched_tokens=num_batched_tokens, num_running=num_running, num_waiting=num_waiting,
            num_stalled=num_stalled, max_num_seqs=max_num_seqs,
            kv_mid_pages=allocator.num_used("kv") / self.smalls_per_mid,
            # the pages the first offloaded expert costs (while the buffers hold none; held buffers cost nothing more)
            buffer_mid_pages=self.buffer_mid_pages() if self.lazy_buffers and not self.loader.attached else 0,
        )
        plan = with_buffer_pages(self.adjuster.plan(state), state, self.adjuster)
        for layer, expert in plan.evict:
            self.cache.begin_eviction(layer, expert)
        grown = []
        for layer, expert in plan.grow:
            pages = self.cache.reserve_grow(layer, expert)
            if pages is None:  # the pool changed under the plan: grow what fits
                break
            self.pending.append(PendingGrow(layer, expert, self.loader.copy_to_pages(layer, expert, pages)))
            grown.append((layer, expert))
        self.counters.evictions += len(plan.evict)
        self.counters.grows += len(grown)
        self.counters.last_plan = AdjustPlan(evict=list(plan.evict), grow=grown)
        # the predicate the graph replay uses (tables change only between passes; evictions begun here still read).
        # A pass above the largest captured graph (--max-cudagraph-capture-size, or 8192 tokens) runs eagerly and
        # is still charged the piecewise overhead here: its own eager launch cost is larger, so its compute reads
        # ~1 ms low (the tracker keeps such buckets apart).
        self._launch_piecewise = not self.cache.all_resident()
        self._forward_start = ((time.monotonic(), self.loader.counters.bytes_loaded) if num_batched_tokens > 0
                               else None)
        return self.counters.last_plan

    def launching(self, num_tokens: int) -> None:
        """The engine launches this step's pass with `num_tokens` batched tokens. Called after adjust(): with async
        scheduling the engine may first drop requests that finished meanwhile, so the pass can be smaller than
        planned, or not launched at all (0: no pass is timed this step)."""
        self._tokens = num_tokens
        if num_tokens == 0:
            self._forward_start = None

    def after_forward(self) -> None:
        """The forward pass has finished: evicted experts leave the tables (the engine then completes the
        allocator's forward, which frees their pages), and its routing counts update the popularity."""
        self.cache.finish_evictions()
        self._release_buffers()
        self._observe_loads()
        if self.async_steps:
            self._after_forward_async()
            return
        if self.step_cost is not None and self._forward_start is not None:
            t0, bytes0 = self._forward_start
            copy_s = (self.loader.counters.bytes_loaded - bytes0) / self.pcie_bandwidth
            overhead = self.piecewise_overhead_s if self._launch_piecewise else 0.0
            self.step_cost.observe_forward(max(0.0, time.monotonic() - t0 - overhead), copy_s, self._tokens)
        self._forward_start = None
        if self.counter is not None:
            self.observe(self.counter.snapshot_and_reset().numpy())

    def _release_buffers(self) -> None:
        """After a pass that ran with every expert resident, with none moving: the load buffers' pages are freed
        (deferred to the end of the step). No pass reads them: the one in flight is that all-resident pass, the
        one before it has been read (sync: it is that pass)."""
        if (self.lazy_buffers and self.loader.attached and not self._launch_piecewise
                and self.cache.all_resident() and not self.pending):
            self.cache.allocator.defer_free(EXPERT, self.loader.detach())

    def _observe_loads(self) -> None:
        """The loader's routed and copied experts since the last call feed the cost tracker's copy excess."""
        if self.step_cost is None:
            return
        c = self.loader.counters
        now = (c.hits + c.misses, c.prefetched + c.on_demand)
        routed, copied = now[0] - self._loads_seen[0], now[1] - self._loads_seen[1]
        self._loads_seen = now
        self.step_cost.observe_loads(routed, copied)

    def _after_forward_async(self) -> None:
        # Between the previous call and this one the host waited for the pass launched before (pass n): that
        # interval is pass n's time. The bytes loaded in the interval were issued for the pass launched now
        # (n+1), so pass n's copies are the previous interval's bytes (`_copy_bytes`).
        now, loaded = time.monotonic(), self.loader.counters.bytes_loaded
        ran = self._forward_start is not None
        if ran and self._last_after_forward is not None:
            t0, bytes0 = self._last_after_forward
            if self.step_cost is not None and self._copy_bytes is not None:
                overhead = self.piecewise_overhead_s if self._piecewise_in_flight else 0.0
                self.step_cost.observe_forward(max(0.0, now - t0 - overhead), self._copy_bytes / self.pcie_bandwidth,
                                               self._tokens_in_flight)
            self._copy_bytes = loaded - bytes0
        self._piecewise_in_flight = self._launch_piecewise and ran
        self._tokens_in_flight = self._tokens if ran else 0
        self._last_after_forward = (now, loaded) if ran else None
        if not ran:
            self._copy_bytes = None
        self._forward_start = None
        if self.counter is not None:
            previous, self._counts_in_flight = self._counts_in_flight, self.counter.snapshot_and_reset_async()
            if previous is not None:
                host, done = previous
                if done is not None:
                    done.synchronize()  # the pass before the one in flight: finished
                self.observe(host.numpy())
