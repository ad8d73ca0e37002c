"""The capacity simulator: the engine's own scheduler, KV cache manager, allocator, expert residency and elastic
core (experts/elastic_core.py) on a simulated clock.

One loop iteration is one engine step (engine/llm_engine.py), with the GPU replaced by `CostModel`:
  1. requests whose arrival time the host has reached join the queue (a conversation's later turn arrives when the
     turn it follows finishes, plus its think time: `SimRequest.after`); elastic: grows reserved last step enter the
     residency and the load buffers take pages if an expert is out (`begin_step`, as the engine's runtime);
  2. `Scheduler.schedule()` picks the batch; elastic: the core plans (evictions begin, grows reserve pages);
  3. the pass is launched: its tokens count as computed, sampled rows are pending tokens, and the device clock
     advances by the cost model's step time (evictees still readable, grows copied meanwhile);
  4. a pass is drained: sampled tokens appended, requests that reached their output length finish (EOS ignored)
     and free their pages; the core's after_pass, then the allocator's complete_forward.
With async scheduling (the engine's default on a GPU) step n+1 is scheduled and launched while pass n runs and pass
n is drained after: the host sees arrivals up to the start of pass n, and pass n's finishes from step n+2 on.
A hybrid model's requests hold their state pages (ssm and conv kinds) from admission to the end, through the
engine's own state manager (engine/state_cache_manager.py), so admission, the shortfall and the adjuster count
them as in the engine.
The budget is split (around the workspace the engine measured, when given, else its bound), the modes start and
requests are admitted as in the engine (engine/setup.py `plan_memory`, experts/runtime_builders.py,
`max_kv_pages`); copy costs come from the hardware profile.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from rimuru.config import OFFLOAD_ACCESS, EngineConfig, format_bytes
from rimuru.engine.kv_cache_manager import KV, KVCacheManager
from rimuru.engine.kv_compaction import compact_kv, max_pages_moved
from rimuru.engine.recent_tpot import recent_p99
from rimuru.engine.request import Request, RequestStatus
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.scheduler import Scheduler
from rimuru.engine.setup import workspace_bytes
from rimuru.engine.state_cache_manager import StateCacheManager
from rimuru.experts.adjuster import Adjuster, AdjusterConfig
from rimuru.experts.cache import resolve_offload_limit, resolve_resident_count
from rimuru.experts.cost_adjuster import CostAdjusterConfig
from rimuru.experts.elastic_core import (
    ElasticCore,
    elastic_start_resident,
    resolve_elastic_limit,
    start_buffer_slots,
)
from rimuru.experts.popularity import ExpertPopularity, OnlinePopularity
from rimuru.experts.residency import (
    BUFFER_OWNER,
    EXPERT,
    PAGES_PER_EXPERT,
    ExpertResidency,
    PoolTooSmallError,
    load_buffer_pages,
)
from rimuru.experts.runtime import StepDemand
from rimuru.experts.runtime_builders import build_adjuster
from rimuru.memory.allocator import PageAllocator
from rimuru.memory.geometry import CONV, SSM, PageGeometry
from rimuru.model_spec import ModelSpec
from rimuru.sim.cost_model import CostModel, HardwareConfig

MODES = ("static", "fixed", "elastic")
ADJUSTERS = ("paper", "cost")
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SimulationError(RuntimeError):
    pass


@dataclass(frozen=True)
class SimRequest:
    prompt_len: int
    output_len: int
    arrival_s: float  # a request on its own, or a conversation's first turn; a later turn: ignored
    after: int | None = None  # a conversation's later turn: the index of the turn it follows, sent once that ends
    think_s: float = 0.0  # ... and this long after (the bench client's --turn-think-time-s)


@dataclass(frozen=True)
class SimConfig:
    mode: str
    budget_bytes: int
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    adjuster: AdjusterConfig = field(default_factory=AdjusterConfig)
    adjuster_kind: str = "cost"  # elastic: cost (CostAdjuster, fed the model's compute) | paper (threshold rules)
    cost: CostAdjusterConfig = field(default_factory=CostAdjusterConfig)
    resident_experts: float | None = None  # fixed: experts per layer, a count (>= 1) or a fraction (< 1)
    expert_offload_limit: int | None = None  # the most experts one layer may have offloaded (engine defaults)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    dtype: str = "bfloat16"
    offload_access: str = "direct"  # fixed, elastic: direct (the kernel reads the host store) | copy (load buffers)
    # the workspace the engine measured at start-up (its `workspace_bytes` stat); None: workspace_bytes' bound with
    # the hardware profile's scratch (an upper bound of what an engine measures)
    workspace_bytes: int | None = None
    # the engine's default on a GPU: pass n+1 is scheduled and launched before pass n's tokens are read
    async_scheduling: bool = True
    # the engine's KV compaction when grows wait for whole mid pages (engine/kv_compaction.py); its device copies
    # are not costed (a few MB at the device's bandwidth a step)
    kv_compaction: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.offload_access not in OFFLOAD_ACCESS:
            raise ValueError(f"offload_access must be one of {', '.join(OFFLOAD_ACCESS)}, got "
                             f"{self.offload_access!r}")
        if self.adjuster_kind not in ADJUSTERS:
            raise ValueError(f"adjuster_kind must be one of {', '.join(ADJUSTERS)}, got {self.adjuster_kind!r}")
        if self.dtype not in _TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_TORCH_DTYPES)}, got {self.dtype!r}")


@dataclass(frozen=True)
class MemoryPlan:
    geometry: PageGeometry
    budget: int
    non_expert_weights: int
    workspace: int
    pool: int
    num_huge_pages: int


def plan_memory(spec: ModelSpec, cfg: SimConfig) -> MemoryPlan:
    """budget = non-expert weights + workspace bound + pool (whole huge pages), as the engine splits it."""
    dtype = _TORCH_DTYPES[cfg.dtype]
    geometry = PageGeometry.for_model(spec, dtype=dtype, block_size=cfg.block_size)
    engine = EngineConfig(model="simulated", max_num_seqs=cfg.max_num_seqs, block_size=cfg.block_size,
                          max_num_batched_tokens=cfg.max_num_batched_tokens)
    work = cfg.workspace_bytes if cfg.workspace_bytes is not None else \
        workspace_bytes(spec, engine, dtype, cfg.hardware.workspace_scratch_bytes)  # nothing to measure here
    non_expert = spec.non_expert_bytes(dtype)
    num_huge = (cfg.budget_bytes - non_expert - work) // geometry.huge_size
    if num_huge <= 0:
        raise SimulationError(f"budget {format_bytes(cfg.budget_bytes)} leaves no page pool: non-expert weights "
                              f"take {format_bytes(non_expert)} and the workspace {format_bytes(work)}")
    return MemoryPlan(geometry, cfg.budget_bytes, non_expert, work, num_huge * geometry.huge_size, num_huge)


@dataclass
class SimResult:
    mode: str
    memory: dict[str, int]
    num_requests: int
    forward_steps: int = 0
    sim_time_s: float = 0.0
    peak_running: int = 0
    peak_waiting: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    evictions: int = 0
    grows: int = 0
    kv_pages_moved: int = 0  # by KV compaction
    pcie_bytes: float = 0.0
    ttft_s: list[float] = field(default_factory=list, repr=False)
    tpot_s: list[float] = field(default_factory=list, repr=False)
    timeline: dict[str, list[float]] = field(default_factory=dict, repr=False)
    final_pages: dict[str, int] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.sim_time_s if self.sim_time_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            return float(np.percentile(xs, q)) if xs else 0.0

        return {
            "mode": self.mode, "num_requests": self.num_requests, "forward_steps": self.forward_steps,
            "sim_time_s": self.sim_time_s, "output_tokens": self.output_tokens,
            "output_throughput_tok_s": self.throughput, "peak_running": self.peak_running,
            "peak_waiting": self.peak_waiting, "preemptions": self.preemptions, "evictions": self.evictions,
            "grows": self.grows, "kv_pages_moved": self.kv_pages_moved, "pcie_bytes": self.pcie_bytes,
            "ttft_p50_s": pct(self.ttft_s, 50), "ttft_p99_s": pct(self.ttft_s, 99),
            "tpot_p50_s": pct(self.tpot_s, 50), "tpot_p99_s": pct(self.tpot_s, 99),
            "memory": self.memory, "final_pages": self.final_pages,
        }


class Simulation:
    def __init__(self, spec: ModelSpec, popularity: ExpertPopularity, cfg: SimConfig,
                 adjuster: Adjuster | None = None) -> None:
        if (popularity.num_layers, popularity.num_experts) != (spec.num_moe_layers, spec.num_experts):
            raise ValueError(f"popularity is {popularity.num_layers} x {popularity.num_experts}, the model has "
                             f"{spec.num_moe_layers} MoE layers x {spec.num_experts} experts")
        self.spec, self.popularity, self.cfg = spec, popularity, cfg
        self.mem = plan_memory(spec, cfg)
        g = self.mem.geometry
        self.allocator = PageAllocator(g, self.mem.num_huge_pages)
        self.kv = KVCacheManager(self.allocator, len(spec.attention_layer_ids), cfg.block_size)
        self.state: StateCacheManager | None = None  # hybrid models: requests' ssm and conv pages
        if spec.is_hybrid:
            self.state = StateCacheManager(self.allocator, len(spec.linear_layer_ids), g.size(KV))
        self.residency = ExpertResidency(self.allocator, spec.num_moe_layers, spec.num_experts,
                                         ranking=popularity.rankings.tolist())
        self.cost = CostModel(spec, popularity.probabilities, cfg.hardware, cfg.dtype)
        self.direct = cfg.offload_access == "direct"  # no load buffers, no piecewise graphs (experts/direct_runtime)
        self.smalls_per_mid = g.smalls_per_mid(KV, EXPERT)
        self.core: ElasticCore | None = None
        self.fixed_buffer_pages: list[int] = []  # fixed mode's load buffers, held for good
        if cfg.mode == "elastic":
            self.core = self._elastic_core(adjuster)
        self._place_experts()
        if self.core is not None and adjuster is None and not self.direct:
            # the engine measures the piecewise overhead after capture where it also captured whole graphs, i.e.
            # where every expert could be resident at once (ElasticRuntime.graph_plan); elsewhere every pass is
            # piecewise and nothing is charged
            offloaded = self.residency.total_experts - self.residency.num_resident
            can_all_fit = PAGES_PER_EXPERT * offloaded <= self.allocator.mid_capacity(EXPERT)
            self.core.adjuster.set_piecewise_overhead(self.cost.piecewise_overhead_s if can_all_fit else 0.0)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   reclaimable=self.core.reclaimable_kv_pages if self.core else None,
                                   admission_reserve=self.core.admission_reserve_kv_pages if self.core else None,
                                   state=self.state)
        # what requests could ever get, as the engine's add_request checks it
        self.max_kv_pages = self.kv.capacity_pages() + (self.core.evictable_kv_pages() if self.core else 0)
        self.memory = {"budget": self.mem.budget, "non_expert_weights": self.mem.non_expert_weights,
                       "workspace": self.mem.workspace, "pool": self.mem.pool,
                       "expert_page": g.size(EXPERT), "kv_page": g.size(KV),
                       "state_bytes_per_request": self.state.request_bytes if self.state is not None else 0,
                       "initial_expert_bytes": self.allocator.num_used(EXPERT) * g.size(EXPERT),
                       "initial_resident_per_layer": min(self.residency.resident_per_layer())}

    @property
    def adjuster(self) -> Adjuster | None:
        return self.core.adjuster if self.core is not None else None

    # ------------------------------------------------------------------ start-up, as the runtime builders
    def _elastic_core(self, adjuster: Adjuster | None) -> ElasticCore:
        cfg, spec = self.cfg, self.spec
        costs = None
        if adjuster is None:
            # the copy bandwidth the engine measures at start-up is, here, the hardware profile's
            cost = replace(cfg.cost, pcie_bandwidth=cfg.hardware.pcie_bandwidth)
            adjuster, costs = build_adjuster(cfg.adjuster_kind, int(self.cost.expert_bytes), spec.num_experts_per_tok,
                                             cost, cfg.adjuster)
        limit = resolve_elastic_limit(cfg.expert_offload_limit, spec.num_moe_layers, spec.num_experts,
                                      self.allocator.mid_capacity(EXPERT), load_buffers=not self.direct)
        return ElasticCore(self.residency, adjuster, OnlinePopularity(self.popularity), limit, self.smalls_per_mid,
                           costs, load_buffers=not self.direct)

    def _place_experts(self) -> None:
        """The engine's start-up per mode (experts/runtime_builders.py): the same resolvers, rule and checks."""
        E, L, mode = self.spec.num_experts, self.spec.num_moe_layers, self.cfg.mode
        slots = 0  # of the load buffers at start
        if mode == "static":
            k = E
        elif mode == "fixed":
            k = resolve_resident_count(self.cfg.resident_experts, E)
            slots = resolve_offload_limit(self.cfg.expert_offload_limit, E, k)  # 0 with nothing offloaded
        else:
            limit = self.core.offload_limit if self.core is not None else 0
            k = elastic_start_resident(L, E, self.allocator.mid_capacity(EXPERT), limit,
                                       load_buffers=not self.direct)
            slots = start_buffer_slots(L, E - k, limit)
        if self.direct:
            slots = 0  # the kernel reads offloaded experts in host memory: no load buffers
        buffers = load_buffer_pages(slots)
        if PAGES_PER_EXPERT * L * k + buffers > self.allocator.mid_capacity(EXPERT):
            self._too_small(mode, k, buffers)
        try:
            self.residency.place(self.residency.prefix(k))
        except PoolTooSmallError:
            self._too_small(mode, k, buffers)
        if self.core is not None:
            self.core.place_start(k)
        elif buffers:  # fixed mode holds its load buffers for good (nothing reads them in the simulation)
            self.fixed_buffer_pages = self.allocator.allocate_mid(EXPERT, buffers, owner=BUFFER_OWNER) or []

    def _too_small(self, mode: str, k: int, buffers: int) -> None:
        have = self.allocator.mid_capacity(EXPERT) // PAGES_PER_EXPERT
        hint = "use fixed or elastic mode" if mode == "static" else "raise the budget or offload more experts"
        raise SimulationError(f"{mode} mode needs {k} resident experts per layer ({k * self.spec.num_moe_layers} in "
                              f"all) and {buffers} load-buffer pages; the pool ({format_bytes(self.mem.pool)}) "
                              f"holds {have} experts: {hint}")

    # ------------------------------------------------------------------ the loop
    def run(self, requests: list[SimRequest], timeline_points: int = 2000,
            after_step: Callable[[Simulation], None] | None = None) -> SimResult:
        """`after_step` is called after every step's pages have been released (tests watch the residency)."""
        result = SimResult(mode=self.cfg.mode, memory=self.memory, num_requests=len(requests))
        # arrivals not yet taken in, (time, index): the requests on their own and first turns now, a later turn when
        # the turn it follows ends (`_advance`)
        self._requests = requests
        self._followers: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            if r.after is not None:
                if not 0 <= r.after < len(requests) or r.after == i:
                    raise ValueError(f"request {i} follows request {r.after}, which is not another request")
                self._followers.setdefault(r.after, []).append(i)
        pending = [(r.arrival_s, i) for i, r in enumerate(requests) if r.after is None]
        heapq.heapify(pending)
        self._pending = pending
        first = pending[0][0] if pending else 0.0
        live: dict[int, SimRequest] = {}
        cols: dict[str, list[float]] = {k: [] for k in ("t", "running", "waiting", "kv_bytes", "expert_bytes",
                                                        "state_bytes", "free_bytes", "step_s", "pcie_bytes")}
        g, idle_steps = self.mem.geometry, 0
        # clock: when the device is free (the end of the last launched pass); seen: the latest arrival time the
        # host has taken in. Sync: the host schedules when the last pass ended. Async (the engine's default on a
        # GPU): pass n+1 is scheduled and launched while pass n runs, so it sees the arrivals up to the start of
        # pass n, and pass n's tokens (finishes, freed pages) only after it was scheduled.
        clock = seen = 0.0
        in_flight: list[tuple[Any, bool]] | None = None  # the async pass not yet drained: (scheduled, samples)
        core = self.core
        while pending or self.scheduler.has_unfinished() or in_flight is not None:
            while pending and pending[0][0] <= seen:
                at, i = heapq.heappop(pending)
                self._admit(i, requests[i], live, at)
            if not self.scheduler.has_unfinished() and in_flight is None:
                clock = seen = max(clock, pending[0][0])
                continue
            if core is not None:
                core.attach_buffers()
                core.commit_grows()
            out = self.scheduler.schedule()
            result.peak_running = max(result.peak_running, len(self.scheduler.running))
            result.peak_waiting = max(result.peak_waiting, len(self.scheduler.waiting))
            grown, moved = 0, False
            if core is not None:
                moves = core.plan(StepDemand(
                    shortfall_kv_pages=out.shortfall_pages, num_batched_tokens=out.num_tokens,
                    num_scheduled=len(out.scheduled), num_running=len(self.scheduler.running),
                    num_waiting=len(self.scheduler.waiting),
                    num_stalled=len(out.stalled), max_num_seqs=self.scheduler.max_num_seqs,
                    oldest_wait_s=self.scheduler.oldest_wait_s(seen),
                    tpot_p99_s=recent_p99(result.tpot_s), tpot_observed=len(result.tpot_s)))
                grown, moved = len(moves.grow), bool(moves.evict or moves.grow)
                if self.cfg.kv_compaction and out.scheduled and (awaited := core.mid_pages_awaited()) > 0:
                    kv_moves = compact_kv(self.kv, self.scheduler.running, EXPERT, awaited,
                                          max_pages_moved(self.mem.geometry, EXPERT))
                    result.kv_pages_moved += len(kv_moves) if kv_moves is not None else 0
            previous, in_flight = in_flight, None
            if previous is not None and not out.is_empty and self._pass_reads_routing():
                # the engine drains pass n first when this launch would stop the host at a routing read; requests
                # that finish then leave the batch
                self._drain(previous, clock, live, result)
                previous = None
                out.scheduled = [s for s in out.scheduled if not s.request.status.finished]
            if out.is_empty:
                if previous is not None:
                    self._drain(previous, clock, live, result)
                    seen = clock
                self._end_step(after_step)  # no forward pass reads the evicted pages
                idle_steps = 0 if moved or previous is not None else idle_steps + 1
                if idle_steps > 2:
                    if pending:
                        clock = seen = max(clock, pending[0][0])
                        idle_steps = 0
                        continue
                    raise SimulationError(f"stuck: {len(self.scheduler.waiting)} requests wait for pages the pool "
                                          f"cannot give (free KV pages {self.kv.capacity_pages()})")
                continue
            idle_steps = 0
            chunks = [(s.start, s.num_new_tokens) for s in out.scheduled]
            sampled = sum(s.samples for s in out.scheduled)
            cost = self.cost.step(chunks, sampled, self.residency.in_tables, grown, direct=self.direct)
            start = clock
            clock += cost.time_s
            if core is not None and core.step_cost is not None:
                # as the engine measures it: the pass's time without the piecewise overhead, the bytes it moved over
                # PCIe (copies, and direct access's reads), and the offloaded experts routed and copied (the
                # simulated loader copies exactly the routed ones; direct access copies none)
                core.step_cost.observe_forward(cost.time_s - cost.piecewise_s, cost.copy_s + cost.read_s,
                                               out.num_tokens, decode=all(n == 1 for _, n in chunks))
                loaded = 0 if self.direct else round(cost.offloaded_activated)
                core.step_cost.observe_loads(loaded, loaded)
            result.forward_steps += 1
            result.pcie_bytes += cost.pcie_bytes
            launched = self._launch(out)
            if self.cfg.async_scheduling:
                in_flight = launched
                if previous is not None:
                    self._drain(previous, start, live, result)  # pass n ended when pass n+1 started
                seen = start
            else:
                self._drain(launched, clock, live, result)
                seen = clock
            self._end_step(after_step)
            expert_bytes = self.allocator.num_used(EXPERT) * g.size(EXPERT)
            kv_bytes = self.kv.pages_in_use * g.size(KV)
            state_bytes = self.state.bytes_in_use if self.state is not None else 0
            for k, v in (("t", clock), ("running", len(self.scheduler.running)),
                         ("waiting", len(self.scheduler.waiting)),
                         ("kv_bytes", kv_bytes), ("expert_bytes", expert_bytes), ("state_bytes", state_bytes),
                         ("free_bytes", self.mem.pool - kv_bytes - expert_bytes - state_bytes), ("step_s", cost.time_s),
                         ("pcie_bytes", cost.pcie_bytes)):
                cols[k].append(v)
        if core is not None:  # grows planned by the last (empty) step land while the engine idles
            core.attach_buffers()
            core.commit_grows()
        result.sim_time_s = clock - first
        result.preemptions = self.scheduler.num_preemptions
        if core is not None:
            result.evictions, result.grows = core.counters.evictions, core.counters.grows
        result.timeline = _subsample(cols, timeline_points)
        result.final_pages = self.page_accounting()
        return result

    def _pass_reads_routing(self) -> bool:
        """Copy access with an expert offloaded: the host reads each offloaded layer's routing during the pass (the
        engine's runtime.pass_reads_routing, per layer there; any offloaded expert here)."""
        return not self.direct and self.cfg.mode != "static" and not bool(self.residency.in_tables.all())

    def _launch(self, out: Any) -> list[tuple[Any, bool]]:
        """The pass is queued: its requests' tokens count as computed, and a sampled token is pending until the pass
        is drained (async scheduling schedules on it, as the engine's launch)."""
        launched = []
        for s in out.scheduled:
            s.request.num_computed_tokens = s.start + s.num_new_tokens
            if s.samples and self.cfg.async_scheduling:
                s.request.num_pending_tokens += 1
            launched.append((s.request, s.samples))
        return launched

    def _drain(self, launched: list[tuple[Any, bool]], now: float, live: dict[int, SimRequest],
               result: SimResult) -> None:
        """A pass's sampled tokens are read at `now` (the engine's output processor): appended, first tokens timed,
        requests at their output length finished (their pages freed)."""
        for req, samples in launched:
            if not samples:
                continue
            if self.cfg.async_scheduling:
                req.num_pending_tokens -= 1
            if req.status.finished:
                continue
            self._advance(req, now, live, result)

    def _end_step(self, after_step: Callable[[Simulation], None] | None) -> None:
        if self.core is not None:
            self.core.after_pass()
        self.allocator.complete_forward()
        if after_step is not None:
            after_step(self)

    def _admit(self, idx: int, r: SimRequest, live: dict[int, SimRequest], arrival_s: float) -> None:
        need = self.kv.blocks_for(r.prompt_len + r.output_len) * self.kv.num_layers
        state = self.state.kv_pages if self.state is not None else 0  # its state pages, in KV pages
        if need + state > self.max_kv_pages:
            what = f" and its state {state}" if state else ""
            raise SimulationError(f"request {idx} needs {need} KV pages ({r.prompt_len} + {r.output_len} tokens)"
                                  f"{what}, the pool can never hold more than {self.max_kv_pages}")
        req = Request(request_id=str(idx), seq_id=idx, prompt=None, prompt_token_ids=[0] * r.prompt_len,
                      params=SamplingParams(max_tokens=r.output_len, ignore_eos=True), max_tokens=r.output_len,
                      eos_token_id=None, arrival_time=arrival_s)
        live[idx] = r
        self.scheduler.add(req)

    def _advance(self, req: Request, now: float, live: dict[int, SimRequest], result: SimResult) -> None:
        req.output_token_ids.append(0)
        result.output_tokens += 1
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            result.ttft_s.append(now - m.arrival_time)
        if req.num_output_tokens >= req.max_tokens:
            self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
            m.finished_time = now
            if req.max_tokens > 1:
                result.tpot_s.append((now - m.first_token_time) / (req.max_tokens - 1))
            del live[req.seq_id]
            for j in self._followers.get(req.seq_id, ()):  # the conversation's next turn is sent now
                heapq.heappush(self._pending, (now + self._requests[j].think_s, j))

    def page_accounting(self) -> dict[str, int]:
        """Every pool byte at the end: expert pages + KV pages + state pages + free = pool (checked by the allocator
        too)."""
        self.allocator.check_invariants()
        self.residency.check()
        if self.state is not None:
            self.state.check()
        st = self.allocator.stats()
        g = self.mem.geometry
        buffers = len(self.core.buffer_pages if self.core is not None else self.fixed_buffer_pages)
        return {"pool_bytes": self.mem.pool, "expert_pages": st.used_pages.get(EXPERT, 0),
                "expert_pages_tracked": self.residency.num_pages + buffers, "kv_pages": st.used_pages.get(KV, 0),
                "kv_pages_tracked": self.kv.pages_in_use,
                "state_pages": st.used_pages.get(SSM, 0) + st.used_pages.get(CONV, 0),
                "state_pages_tracked": self.state.pages_in_use if self.state is not None else 0,
                "free_bytes": st.total_free_bytes,
                "used_bytes": st.total_used_bytes, "pending_deferred": st.pending_deferred,
                "expert_page_bytes": g.size(EXPERT)}


def _subsample(cols: dict[str, list[float]], points: int) -> dict[str, list[float]]:
    n = len(cols["t"])
    if n <= points:
        return cols
    idx = np.linspace(0, n - 1, points).round().astype(int)
    return {k: [v[i] for i in idx] for k, v in cols.items()}
