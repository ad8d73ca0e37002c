"""The expert runtime: everything that differs between the offload modes, behind one interface.

The engine's step (engine/llm_engine.py) is the same in every mode; it asks its runtime, in this order:

    begin_step()                  load buffers attached if needed; grows that completed enter the tables
    -- scheduler.schedule() --    reclaimable_kv_pages(), admission_reserve_kv_pages() answer the scheduler
    pass_reads_routing(tokens)    will the pass stop the host at an offloaded layer's routing read?
    before_pass(tokens)           the pass is about to be queued (streaming layers start their copies)
    -- the runner queues the pass; the pass fence records it --
    plan(StepDemand)              the memory plan from this step's demand: evictions and grows (elastic); the
                                  host plans while the GPU runs, and the pass queued reads the tables as they were
    after_pass()                  evicted experts leave the tables; routing counts and step times observed
    -- the previous pass (async) or this one is drained; allocator.complete_forward() --

Implementations: `StaticRuntime` (here: every expert resident, nothing moves; also `fixed` mode with nothing
offloaded), `OffloadRuntime` (offload_runtime.py: `fixed`, experts in host memory copied per pass),
`ElasticRuntime` (elastic_runtime.py: the boundary moves every step). Builders: runtime_builders.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from rimuru.experts.adjuster import AdjustPlan
from rimuru.experts.cache import ExpertCache
from rimuru.experts.host_tier import no_tier_stats
from rimuru.experts.offload_provider import OffloadExpertProvider
from rimuru.experts.routing_counter import RoutingCounter
from rimuru.experts.static_provider import StaticExpertProvider
from rimuru.models.expert_provider import ExpertProvider


@dataclass(frozen=True)
class StepDemand:
    """What the scheduler left for the experts to answer, one step (set by the engine from its SchedulerOutput)."""

    shortfall_kv_pages: int = 0  # KV pages the stalled requests, or else the first waiting request, still lack
    num_batched_tokens: int = 0  # tokens scheduled in this step
    num_scheduled: int = 0  # sequences scheduled in this step (tokens == sequences: a decode-only pass)
    num_running: int = 0
    num_waiting: int = 0
    num_stalled: int = 0  # running requests sitting out this step until evictions free their pages
    max_num_seqs: int | None = None  # the scheduler's cap on running requests
    oldest_wait_s: float = 0.0  # how long the head of the waiting queue has waited since it arrived (0: no queue)
    tpot_p99_s: float | None = None  # TPOT p99 of recently finished requests (engine/recent_tpot.py; None: too few)
    tpot_observed: int = 0  # finished requests whose TPOT has been observed so far


@dataclass(frozen=True)
class GraphPlan:
    """What the engine's CUDA graphs must capture for this runtime (engine/cuda_graphs.py)."""

    counter: RoutingCounter | None  # routing counts recorded inside the graphs (padding rows masked)
    # an offloading provider: graphs are cut at each MoE layer's table decision (engine/piecewise_graphs.py)
    piecewise: OffloadExpertProvider | None = None
    # whole graphs over the live resident tables, replayed while every expert is resident (elastic)
    resident: StaticExpertProvider | None = None


class ExpertRuntime(Protocol):
    mode: str  # the offload mode in force: static | fixed | elastic
    cache: ExpertCache  # resident experts and the device expert tables
    provider: ExpertProvider  # what every MoE layer of the model calls

    def graph_plan(self) -> GraphPlan: ...

    def set_piecewise_overhead(self, seconds: float) -> None:
        """What a pass with an expert offloaded costs beyond one with all resident (piecewise against whole
        graphs), as the engine measured it after capturing them."""
        ...

    def write_expert(self, layer: int, expert: int, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> None:
        """The weight loader's sink: one routed expert's matrices, from the checkpoint."""
        ...

    def swap_routing_counter(self, counter: RoutingCounter | None) -> RoutingCounter | None:
        """The provider counts its routing decisions into `counter` from now on (None: none) and returns the counter
        it counted into before (`rimuru profile` attaches its own for an eager run). CUDA graphs keep the counter
        they were captured with, and in elastic mode the online popularity stops learning while it is swapped."""
        ...

    def fill_random_experts(self, seed: int) -> None:
        """Dummy weights for every routed expert (load_format="dummy"); the same draws in every mode."""
        ...

    def begin_step(self) -> None: ...

    def reclaimable_kv_pages(self) -> int:
        """KV pages evictions the runtime allows could still free: a running request short of pages waits for
        them instead of being preempted."""
        ...

    def admission_reserve_kv_pages(self) -> int:
        """KV pages the scheduler keeps free from new admissions (pages the runtime's grows wait for)."""
        ...

    def evictable_kv_pages(self) -> int:
        """KV pages beyond the free ones that requests could ever get (every allowed eviction made)."""
        ...

    def mid_pages_awaited(self) -> int:
        """Whole expert mid pages the last plan's grows wait for beyond those the pool can give (the engine's KV
        compaction makes them, engine/kv_compaction.py)."""
        ...

    def plan(self, demand: StepDemand) -> AdjustPlan: ...

    def pass_reads_routing(self, num_tokens: int) -> bool: ...

    def before_pass(self, num_tokens: int) -> None:
        """The pass of `num_tokens` real tokens planned this step is about to be queued (0: none is)."""
        ...

    def after_pass(self) -> None: ...

    @property
    def bytes_loaded(self) -> int:
        """Expert bytes copied host -> device so far."""
        ...

    @property
    def expert_wait_s(self) -> float | None:
        """Host seconds spent so far inside offloading table decisions (routing reads, on-demand copies); None
        where no decision reaches the host."""
        ...

    @property
    def host_reads(self) -> int:
        """Offloaded experts passes have read in host memory so far (direct access in elastic mode, which counts
        them from its routing counts; 0 where nothing counts them)."""
        ...

    def memory_split(self) -> dict[str, int]:
        """Bytes of resident experts, load buffers and host copies, for the start-up budget log."""
        ...

    def observed_routing(self) -> np.ndarray | None:
        """[L_moe, E] the (token, expert) assignments the passes so far routed, undecayed (elastic mode, which
        counts them for its popularity estimate); None where nothing counts them."""
        ...

    def stats(self) -> dict[str, float]: ...


class FixedResidency:
    """What a runtime whose resident experts never change answers: nothing moves between passes, no eviction could
    free a page, no grow waits for one (static and fixed mode; elastic mode overrides every one of these)."""

    def set_piecewise_overhead(self, seconds: float) -> None:
        return None  # only elastic mode weighs passes with experts offloaded against passes without

    def begin_step(self) -> None:
        return None

    def reclaimable_kv_pages(self) -> int:
        return 0

    def admission_reserve_kv_pages(self) -> int:
        return 0

    def evictable_kv_pages(self) -> int:
        return 0

    def mid_pages_awaited(self) -> int:
        return 0

    def observed_routing(self) -> np.ndarray | None:
        return None

    def plan(self, demand: StepDemand) -> AdjustPlan:
        return AdjustPlan()

    def after_pass(self) -> None:
        return None


class StaticRuntime(FixedResidency):
    """Every routed expert resident at fixed pages: nothing moves, no expert decision reaches the host."""

    def __init__(self, cache: ExpertCache, mode: str = "static") -> None:
        self.mode = mode
        self.cache = cache
        self.provider = StaticExpertProvider(cache.expert_view, cache.tables)

    def graph_plan(self) -> GraphPlan:
        return GraphPlan(counter=None)

    def write_expert(self, layer: int, expert: int, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> None:
        self.cache.write(layer, expert, w1, w3, w2)

    def fill_random_experts(self, seed: int) -> None:
        self.cache.fill_random(seed)

    def swap_routing_counter(self, counter: RoutingCounter | None) -> RoutingCounter | None:
        previous, self.provider.counter = self.provider.counter, counter
        return previous

    def pass_reads_routing(self, num_tokens: int) -> bool:
        return False

    def before_pass(self, num_tokens: int) -> None:
        return None

    @property
    def bytes_loaded(self) -> int:
        return 0

    @property
    def expert_wait_s(self) -> float | None:
        return None

    @property
    def host_reads(self) -> int:
        return 0

    def memory_split(self) -> dict[str, int]:
        return {"experts_resident": 3 * self.cache.num_resident * self.cache.expert_page_bytes,
                "load_buffers": 0, "host_experts": 0}

    def stats(self) -> dict[str, float]:
        return {"expert_bytes_loaded": 0, "prefetch_hits": 0, "prefetch_misses": 0, "expert_evictions": 0,
                "expert_grows": 0, "expert_reranks": 0, **no_tier_stats()}
