"""Elastic mode's decisions, without tensors: the one copy of the rules that the engine and the simulator run.

Per step, in this order (the engine's device half, elastic_runtime.py, adds copies, events and table writes;
the simulator, sim/simulator.py, adds a simulated clock):

    attach_buffers()        the last step's evictions left an expert out: the load buffers take their pages
    commit_grows()          grows whose copies have completed enter the residency (the device half asks its
                            copy events; the rest stay growing, read where they were)
    -- the scheduler schedules --
    plan(demand)            the adjuster's plan: evictions begin (pages deferred, still readable), grows
                            reserve pages (their copies start now)
    -- the forward pass runs --
    after_pass()            evicted experts leave the residency; idle load buffers give their pages back
    -- allocator.complete_forward() frees what the pass could still read --

Load buffers hold a layer's offloaded experts while it computes: two buffers (layers alternate) of `slots` expert
slots, 2 x 3 mid pages a slot. With at least 8 MoE layers (`lazy_load_buffers`) their slots follow the offload:
as many as the most offloaded experts of one layer, none while every expert is resident (their pages are KV cache
then). A plan whose evictions need more slots also frees their pages (`with_buffer_room`: more evictions, or
none); the next step's `attach_buffers` adds the slots before the first pass whose tables lack those experts;
`after_pass` gives every slot back once a pass ran with every expert resident and none is moving. With fewer
layers a slot costs more than offloading frees, so the buffers are held for good at `limit` slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rimuru.experts.adjuster import (
    Adjuster,
    AdjusterState,
    AdjustPlan,
    buffer_pages_for,
    eviction_order,
    most_offloaded_after,
    reclaimable_experts,
    shortfall_mid_pages,
    with_buffer_room,
)
from rimuru.experts.popularity import OnlinePopularity
from rimuru.experts.residency import (
    BUFFER_OWNER,
    EXPERT,
    PAGES_PER_EXPERT,
    Expert,
    ExpertPages,
    ExpertResidency,
    lazy_load_buffers,
    load_buffer_pages,
)
from rimuru.experts.runtime import StepDemand
from rimuru.experts.step_cost import StepCostTracker
from rimuru.memory.geometry import CONV, SSM


def default_elastic_limit(num_layers: int, num_experts: int, free_mid_pages: int, load_buffers: bool = True) -> int:
    """The paper's E / 6 (about ten offloadable experts of 60 near its throughput peak), raised where the pool
    cannot start with it to the fewest that let it start as `elastic_start_resident` wants (every expert, or the
    rest beside FORCED_START_KV_SHARE of KV); E where none does (the caller then refuses the pool)."""
    room = free_mid_pages - int(FORCED_START_KV_SHARE * free_mid_pages)
    for limit in range(max(1, num_experts // 6), num_experts + 1):
        if (start_pages(num_layers, num_experts, num_experts, limit, load_buffers) <= free_mid_pages
                or start_pages(num_layers, num_experts, num_experts - limit, limit, load_buffers) <= room):
            return limit
    return num_experts


def resolve_elastic_limit(expert_offload_limit: int | None, num_layers: int, num_experts: int,
                          free_mid_pages: int, load_buffers: bool = True) -> int:
    """The most experts one layer may have offloaded in elastic mode (default: `default_elastic_limit` for a pool
    of `free_mid_pages` free expert pages, before anything is placed)."""
    limit = (default_elastic_limit(num_layers, num_experts, free_mid_pages, load_buffers)
             if expert_offload_limit is None
             else expert_offload_limit)
    if not 1 <= limit <= num_experts:
        raise ValueError(f"expert_offload_limit must be in [1, {num_experts}] in elastic mode, got {limit}")
    return limit


def start_pages(num_layers: int, num_experts: int, resident: int, limit: int, load_buffers: bool = True) -> int:
    """Expert pages the start-up takes: `resident` experts per layer and the load-buffer slots the others need
    (none without load buffers: the kernel reads offloaded experts in host memory)."""
    slots = start_buffer_slots(num_layers, num_experts - resident, limit) if load_buffers else 0
    return PAGES_PER_EXPERT * num_layers * resident + load_buffer_pages(slots)


# Start-up where the experts do not all fit: the share of the free pool left to KV cache.
FORCED_START_KV_SHARE = 0.10


def start_buffer_slots(num_layers: int, offloaded_per_layer: int, limit: int) -> int:
    """Load-buffer slots at start-up with `offloaded_per_layer` experts of every layer out (ElasticCore.slots_for)."""
    return offloaded_per_layer if lazy_load_buffers(num_layers) else limit


def elastic_start_resident(num_layers: int, num_experts: int, free_mid_pages: int, limit: int,
                           load_buffers: bool = True) -> int:
    """Experts per layer resident at start-up. Every expert when they all fit: the adjuster makes KV room as
    requests come, and only where its model says the room pays. Where they do not (offloading is the price of
    running at all), as many as fit beside the load-buffer slots the others need while leaving
    FORCED_START_KV_SHARE of the pool to KV cache, so the first requests need no evictions; at least E - limit
    (the caller refuses a pool that cannot hold even that)."""
    L, E = num_layers, num_experts
    if start_pages(L, E, E, limit, load_buffers) <= free_mid_pages:
        return E
    room = free_mid_pages - int(FORCED_START_KV_SHARE * free_mid_pages)
    for resident in range(E - 1, E - limit - 1, -1):
        if start_pages(L, E, resident, limit, load_buffers) <= room:
            return resident
    return E - limit


@dataclass
class ElasticCounters:
    evictions: int = 0
    grows: int = 0
    reranks: int = 0


@dataclass(frozen=True)
class MovePlan:
    """One step's moves, for the device half: experts whose eviction began, grows with their reserved pages."""

    evict: list[Expert] = field(default_factory=list)
    grow: list[tuple[Expert, ExpertPages]] = field(default_factory=list)

    @property
    def adjust_plan(self) -> AdjustPlan:
        return AdjustPlan(evict=list(self.evict), grow=[e for e, _ in self.grow])


@dataclass(frozen=True)
class PassEnd:
    """What after_pass changed: experts that left the residency, load-buffer pages given back (deferred)."""

    evicted: list[Expert] = field(default_factory=list)
    released_buffer_pages: list[int] = field(default_factory=list)


class ElasticCore:
    def __init__(self, residency: ExpertResidency, adjuster: Adjuster, popularity: OnlinePopularity,
                 offload_limit: int, smalls_per_mid: int, step_cost: StepCostTracker | None = None,
                 load_buffers: bool = True) -> None:
        """`offload_limit`: from resolve_elastic_limit. Without `load_buffers` the kernel reads offloaded experts in
        host memory (offload_access="direct"): no slots are ever taken, and an offload costs no buffer pages."""
        self.residency = residency
        self.allocator = residency.allocator
        self.adjuster = adjuster
        self.popularity = popularity  # the online estimate the adjuster ranks by
        self.offload_limit = offload_limit
        self.smalls_per_mid = smalls_per_mid
        self.step_cost = step_cost  # compute and copy costs of recent passes (cost-aware adjusters read it)
        self.load_buffers = load_buffers
        self.lazy_buffers = lazy_load_buffers(residency.num_layers)  # slots follow the offload (module docstring)
        self.buffer_pages: list[int] = []  # the load buffers' pages: 6 per slot, the owner of their lifetime
        self.counters = ElasticCounters()
        self.launched_offloaded = False  # the pass planned last: some expert out of the tables
        g = self.allocator.geometry
        self._state_kinds = [k for k in (SSM, CONV) if k in g.mid_kinds or k in g.small_kinds]  # hybrid models
        # the last answer of _reclaimable_pages, keyed by everything it reads that changes between steps
        self._reclaimable: tuple[tuple[int, int, int, int | None], int] | None = None

    @property
    def buffer_slots(self) -> int:
        return len(self.buffer_pages) // load_buffer_pages(1)

    def slots_for(self, offloaded_per_layer: list[int]) -> int:
        """Slots the load buffers need for this offload: the most offloaded experts of a layer (lazy buffers; 0 when
        none is out), or the limit, held for good."""
        if not self.load_buffers:
            return 0
        if not self.lazy_buffers:
            return self.offload_limit
        return max(offloaded_per_layer, default=0)

    # ------------------------------------------------------------------ start-up
    def place_start(self, resident_per_layer: int) -> list[int]:
        """Start-up: `resident_per_layer` experts of each layer's ranking are placed (by the caller's device half);
        returns the load buffers' pages for the slots the start needs (none with lazy buffers and every expert
        resident)."""
        offloaded = self.residency.num_experts - resident_per_layer
        if not self.load_buffers:
            return []
        return self._take_slots(start_buffer_slots(self.residency.num_layers, offloaded, self.offload_limit))

    def evictable_kv_pages(self) -> int:
        """KV pages that evicting every expert the limits allow would free, less what the load buffers then take
        (the most KV requests could ever get beyond the free pages)."""
        return self._reclaimable_pages(None)

    # ------------------------------------------------------------------ the scheduler's questions
    def reclaimable_kv_pages(self) -> int:
        """KV pages that evicting the experts the limits and the adjuster still allow would free (after the moves
        in flight), less the load-buffer slots those evictions need. The scheduler lets a running request short of
        pages wait for these instead of preempting it; a cost-aware adjuster bounds them by what its model allows
        (`max_offloaded`)."""
        return self._reclaimable_pages(self.adjuster.max_offloaded())

    def _reclaimable_pages(self, bound: int | None) -> int:
        key = (self.residency.version, self.buffer_slots, self.popularity.num_reranks, bound)
        if self._reclaimable is not None and self._reclaimable[0] == key:
            return self._reclaimable[1]
        offloaded = self.residency.planned_offloaded()
        experts = reclaimable_experts(offloaded, self.offload_limit, bound)
        pages = experts * PAGES_PER_EXPERT
        if experts and self.lazy_buffers and self.load_buffers:  # the evictions may need more slots
            state = self.state(StepDemand())
            order = eviction_order(state, experts)
            slots = most_offloaded_after(np.asarray(offloaded), order, self.residency.num_experts)[-1]
            pages -= int(buffer_pages_for(slots, state)) - int(buffer_pages_for(self.buffer_slots, state))
        kv = max(0, pages) * self.smalls_per_mid
        self._reclaimable = (key, kv)
        return kv

    def admission_reserve_kv_pages(self) -> int:
        """KV pages the scheduler keeps free from new admissions: the pages the adjuster's grows are waiting for."""
        return self.adjuster.grow_reserve() * self.smalls_per_mid

    def mid_pages_awaited(self) -> int:
        """Whole mid pages the adjuster's grows wait for beyond those the pool can give now (its reserve, which
        includes the free pages grows leave, less the free and reclaimable whole mid pages)."""
        return max(0, self.adjuster.grow_reserve() - self.allocator.mid_capacity(EXPERT))

    # ------------------------------------------------------------------ one step
    def commit_grows(self, experts: list[Expert] | None = None) -> list[tuple[Expert, ExpertPages]]:
        """The growing experts whose copies have completed (the device half made sure) enter the residency:
        `experts`, or every growing one (None)."""
        return self.residency.commit_grows(experts)

    def attach_buffers(self) -> list[int] | None:
        """If the last step's evictions left some layer with more offloaded experts than the buffers have slots,
        the buffers take the pages of the missing slots now (before this step's scheduler can give them to KV).
        Returns the pages taken, or None."""
        pages = self._take_slots(self.slots_for(self.residency.planned_offloaded()))
        return pages or None

    def plan(self, demand: StepDemand) -> MovePlan:
        """The adjuster's plan for the step just scheduled, applied to the residency: evictions begin, grows
        reserve their pages (a grow the pool can no longer hold is dropped, with every one after it)."""
        state = self.state(demand)
        plan = with_buffer_room(self.adjuster.plan(state), state, self.adjuster)
        if plan.evict and self.residency.growing:
            # an expert whose grow copy is still in flight cannot leave yet (its pages are being written); the next
            # plan evicts again if it must. With load buffers the evictions also paid for their slots: all or none
            keep = [ex for ex in plan.evict if not self.residency.is_growing(*ex)]
            if len(keep) < len(plan.evict):
                plan = AdjustPlan(evict=[] if state.buffer_slot_pages > 0 else keep, grow=plan.grow)
        for layer, expert in plan.evict:
            self.residency.begin_eviction(layer, expert)
        grown: list[tuple[Expert, ExpertPages]] = []
        for layer, expert in plan.grow:
            pages = self.residency.reserve_grow(layer, expert)
            if pages is None:  # the pool changed under the plan: grow what fits
                break
            grown.append(((layer, expert), pages))
        moves = MovePlan(evict=list(plan.evict), grow=grown)
        c = self.counters
        c.evictions += len(moves.evict)
        c.grows += len(grown)
        # tables change only between passes: evictions begun here are still read by the pass planned now
        self.launched_offloaded = not self.residency.all_resident()
        return moves

    def state(self, demand: StepDemand) -> AdjusterState:
        allocator = self.allocator
        return AdjusterState(
            shortfall_mid_pages=shortfall_mid_pages(max(0, demand.shortfall_kv_pages), self.smalls_per_mid),
            free_mid_pages=allocator.mid_capacity(EXPERT),
            resident=self.residency.planned_resident(),
            probabilities=self.popularity.probabilities(),
            rankings=self.popularity.rankings,
            offload_limit=self.offload_limit,
            num_batched_tokens=demand.num_batched_tokens, num_running=demand.num_running,
            num_waiting=demand.num_waiting, num_stalled=demand.num_stalled, max_num_seqs=demand.max_num_seqs,
            oldest_wait_s=demand.oldest_wait_s, tpot_p99_s=demand.tpot_p99_s, tpot_observed=demand.tpot_observed,
            # held by requests: the prefix cache's unreferenced pages are free room (in free_mid_pages when whole)
            kv_mid_pages=(allocator.num_used("kv") - allocator.num_reclaimable("kv")) / self.smalls_per_mid
            + self._state_mid_pages(),
            # held for good, or none at all: no cost
            buffer_slot_pages=load_buffer_pages(1) if self.lazy_buffers and self.load_buffers else 0,
            buffer_slots=self.buffer_slots,
        )

    def _state_mid_pages(self) -> float:
        """Hybrid models' per-request state pages (ssm and conv kinds) in use, in expert mid pages: part of each
        running request's footprint, as its KV is (0 for other models)."""
        if not self._state_kinds:
            return 0.0
        a, g = self.allocator, self.allocator.geometry
        return sum(a.num_used(k) * g.size(k) for k in self._state_kinds) / g.size(EXPERT)

    def after_pass(self) -> PassEnd:
        """The pass planned last has been launched (and, for a page that becomes free, finished by the time
        allocator.complete_forward() runs): evicted experts leave the residency; after a pass that ran with every
        expert resident, with none moving, the load buffers' pages are deferred-freed. No pass reads them once they
        are released: the pass launched last is that all-resident one, and the one before it is drained (its tokens
        read) before allocator.complete_forward() releases deferred pages."""
        evicted = self.residency.finish_evictions()
        released: list[int] = []
        if (self.lazy_buffers and self.buffer_pages and not self.launched_offloaded
                and self.residency.all_resident() and not self.residency.growing):
            released, self.buffer_pages = self.buffer_pages, []
            self.allocator.defer_free(EXPERT, released)
        return PassEnd(evicted=evicted, released_buffer_pages=released)

    def observe_routing(self, routed: np.ndarray) -> None:
        """Routing counts [L, E] of recent passes: the online popularity estimate, re-ranking stale layers."""
        self.counters.reranks += len(self.popularity.observe(routed))

    def stats(self) -> dict[str, float]:
        """The adjuster's view and the measured copy costs, for /metrics and the sweeps' timelines."""
        out: dict[str, float] = {}
        if self.step_cost is not None:
            out |= {"cost_copy_overlap": self.step_cost.copy_overlap_share(),
                    "cost_copy_slowdown": self.step_cost.copy_slowdown(),
                    "cost_copy_excess": self.step_cost.copy_excess(), "cost_read_excess": self.step_cost.read_excess()}
        return out | self.adjuster.stats()

    def _take_slots(self, slots: int) -> list[int]:
        """The pages of the slots the buffers lack to hold `slots` (none when they hold enough)."""
        count = load_buffer_pages(max(0, slots - self.buffer_slots))
        if count == 0:
            return []
        pages = self.allocator.allocate_mid(EXPERT, count, owner=BUFFER_OWNER)
        if pages is None:  # with_buffer_room evicted enough for them (or start-up checked): a broken invariant
            raise RuntimeError(f"no {count} free mid pages for {slots} load-buffer slots")
        self.buffer_pages += pages
        return pages
