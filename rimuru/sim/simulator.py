"""The capacity simulator: the real scheduler, KV cache manager, allocator and adjuster on a simulated clock.

One loop iteration is one engine step (DESIGN.md section 6), with the GPU replaced by `CostModel`:
  1. requests whose arrival time has passed join the queue; `Scheduler.schedule()` picks the batch;
  2. elastic: the adjuster turns the shortfall R (mid pages) and free mid pages F into a plan; grows
     reserve pages now, evictions are deferred;
  3. the clock advances by the cost model's step time (evictees still readable, grows copied meanwhile);
  4. computed tokens are counted, sampled tokens appended, requests that reached their output length
     finish (EOS ignored) and free their pages; deferred expert pages are released, grows become resident.
The budget is split as the engine splits it (rimuru/engine/setup.py): non-expert weights + workspace + pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rimuru.config import EngineConfig, format_bytes
from rimuru.engine.kv_cache_manager import KV, KVCacheManager
from rimuru.engine.request import Request, RequestStatus
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.scheduler import Scheduler
from rimuru.engine.setup import workspace_bytes
from rimuru.experts.adjuster import (
    Adjuster,
    AdjusterConfig,
    AdjusterState,
    PaperAdjuster,
    pick_grows,
    reclaimable_experts,
    shortfall_mid_pages,
    with_buffer_pages,
)
from rimuru.experts.cost_adjuster import CostAdjuster, CostAdjusterConfig
from rimuru.experts.loader import lazy_load_buffers, load_buffer_pages
from rimuru.experts.popularity import ExpertPopularity
from rimuru.experts.step_cost import StepCostTracker
from rimuru.memory.allocator import PageAllocator
from rimuru.memory.geometry import PageGeometry
from rimuru.model_spec import ModelSpec
from rimuru.sim.cost_model import CostModel, HardwareConfig
from rimuru.sim.residency import EXPERT, PAGES_PER_EXPERT, SimResidency

MODES = ("static", "fixed", "elastic")
ADJUSTERS = ("paper", "cost")
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SimulationError(RuntimeError):
    pass


@dataclass(frozen=True)
class SimRequest:
    prompt_len: int
    output_len: int
    arrival_s: float


@dataclass(frozen=True)
class SimConfig:
    mode: str
    budget_bytes: int
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    adjuster: AdjusterConfig = field(default_factory=AdjusterConfig)
    adjuster_kind: str = "paper"  # elastic: paper (threshold rules) | cost (CostAdjuster, fed the model's compute)
    cost: CostAdjusterConfig = field(default_factory=CostAdjusterConfig)
    resident_experts: int | None = None  # fixed: experts per layer (default: num_experts - expert_offload_limit)
    expert_offload_limit: int = 10  # elastic: most experts one layer may have offloaded
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.expert_offload_limit < 0 or (self.resident_experts is not None and self.resident_experts < 0):
            raise ValueError("expert_offload_limit and resident_experts must be >= 0")
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
    work = workspace_bytes(spec, engine, dtype, torch.device("cuda"))  # the device simulated is a GPU
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
            "grows": self.grows, "pcie_bytes": self.pcie_bytes,
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
        # elastic: running requests short of pages wait for evictions the adjuster allows, and admissions leave
        # the pages its grows wait for (as in the engine)
        elastic = cfg.mode == "elastic"
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   reclaimable=self._reclaimable_kv_pages if elastic else None,
                                   admission_reserve=self._admission_reserve_kv_pages if elastic else None)
        self.residency = SimResidency(self.allocator, spec.num_moe_layers, spec.num_experts)
        self.cost = CostModel(spec, popularity.probabilities, cfg.hardware, cfg.dtype)
        # the cost adjuster reads the compute time and copy slowdown of recent steps, measured from their times
        self.step_cost = StepCostTracker(copy_overlap=cfg.cost.copy_overlap,
                                         initial_overlap=cfg.cost.initial_copy_overlap)
        if adjuster is None and cfg.adjuster_kind == "cost":
            adjuster = CostAdjuster(cfg.cost, expert_bytes=int(self.cost.expert_bytes),
                                    top_k=spec.num_experts_per_tok, compute_time=self.step_cost,
                                    copy_slowdown=self.step_cost.copy_slowdown,
                                    copy_overlap=self.step_cost.copy_overlap_share)
            adjuster.piecewise_overhead_s = self.cost.piecewise_overhead_s  # as the engine measures it at start-up
        self.adjuster = adjuster or PaperAdjuster(cfg.adjuster)
        self.smalls_per_mid = g.smalls_per_mid(KV, EXPERT)
        E = spec.num_experts
        self.offload_limit = min(E, cfg.expert_offload_limit) if cfg.mode == "elastic" else 0
        # elastic mode's load buffers, held while an expert is out where the engine's are lazy (>= 8 MoE layers);
        # elsewhere the simulation models none
        self.lazy_buffers = cfg.mode == "elastic" and lazy_load_buffers(spec.num_moe_layers)
        self.buffer_mid_pages = load_buffer_pages(self.offload_limit) if self.lazy_buffers else 0
        self._load_initial_experts()
        self.memory = {"budget": self.mem.budget, "non_expert_weights": self.mem.non_expert_weights,
                       "workspace": self.mem.workspace, "pool": self.mem.pool,
                       "expert_page": g.size(EXPERT), "kv_page": g.size(KV),
                       "initial_expert_bytes": self.residency.num_pages * g.size(EXPERT),
                       "initial_resident_per_layer": int(self.residency.resident.sum(axis=1).min())}

    # ------------------------------------------------------------------ start-up

    def _load_initial_experts(self) -> None:
        E, L, mode = self.spec.num_experts, self.spec.num_moe_layers, self.cfg.mode
        ranks = self.popularity.rankings
        if mode == "static":
            k = E
        elif mode == "fixed":
            default = E - min(E, self.cfg.expert_offload_limit)
            k = self.cfg.resident_experts if self.cfg.resident_experts is not None else default
        else:
            k = E - self.offload_limit  # the floor; grown further below
        k = min(k, E)
        if not self.residency.load((layer, int(e)) for layer in range(L) for e in ranks[layer, :k]):
            have = self.allocator.mid_capacity(EXPERT) // PAGES_PER_EXPERT
            hint = "use fixed or elastic mode" if mode == "static" else "raise the budget or offload more experts"
            raise SimulationError(f"{mode} mode needs {k} resident experts per layer ({k * L} in all), the pool "
                                  f"({format_bytes(self.mem.pool)}) holds {have}: {hint}")
        if mode == "elastic":
            # start as full as the adjuster would leave it with an empty queue: grow while F stays > high, beside
            # the load buffers unless every expert fits without them
            if self.lazy_buffers and not self.residency.attach_buffers(self.buffer_mid_pages):
                raise SimulationError(f"the pool ({format_bytes(self.mem.pool)}) has no room for the load buffers")
            high = self.cfg.adjuster.high_free_mid
            while self.allocator.mid_capacity(EXPERT) - PAGES_PER_EXPERT >= high:
                grow = pick_grows(self._state(0, 0), 1)
                if not grow:
                    break
                self.residency.load(grow)
            if self.residency.buffer_pages and self.residency.all_resident():
                self.residency.release_buffers()

    def _reclaimable_kv_pages(self) -> int:
        """What stalls may wait for: evictions within the limits and the adjuster's bound (as the engine)."""
        return self._evictable_kv_pages(self.adjuster.max_offloaded())

    def _admission_reserve_kv_pages(self) -> int:
        return self.adjuster.grow_reserve() * self.smalls_per_mid

    def _state(self, shortfall: int, free: int, num_batched_tokens: int = 0, num_stalled: int = 0) -> AdjusterState:
        return AdjusterState(shortfall_mid_pages=shortfall, free_mid_pages=free,
                             resident=self.residency.resident_sets(), probabilities=self.popularity.probabilities,
                             rankings=self.popularity.rankings, offload_limit=self.offload_limit,
                             num_batched_tokens=num_batched_tokens, num_running=len(self.scheduler.running),
                             num_waiting=len(self.scheduler.waiting), num_stalled=num_stalled,
                             max_num_seqs=self.scheduler.max_num_seqs,
                             kv_mid_pages=self.kv.pages_in_use / self.smalls_per_mid,
                             buffer_mid_pages=0 if self.residency.buffer_pages else self.buffer_mid_pages)

    # ------------------------------------------------------------------ the loop

    def run(self, requests: list[SimRequest], timeline_points: int = 2000) -> SimResult:
        result = SimResult(mode=self.cfg.mode, memory=self.memory, num_requests=len(requests))
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        live: dict[int, SimRequest] = {}
        cols: dict[str, list[float]] = {k: [] for k in ("t", "running", "waiting", "kv_bytes", "expert_bytes",
                                                        "free_bytes", "step_s", "pcie_bytes")}
        g, clock, nxt, idle_steps = self.mem.geometry, 0.0, 0, 0
        while nxt < len(order) or self.scheduler.has_unfinished():
            while nxt < len(order) and requests[order[nxt]].arrival_s <= clock:
                self._admit(order[nxt], requests[order[nxt]], live)
                nxt += 1
            if not self.scheduler.has_unfinished():
                clock = requests[order[nxt]].arrival_s
                continue
            if self.lazy_buffers and not self.residency.buffer_pages and not self.residency.resident.all():
                # as the engine's commit_grows: the last step's evictions left an expert out
                if not self.residency.attach_buffers(self.buffer_mid_pages):
                    raise SimulationError("no free pages for the load buffers after evicting (with_buffer_pages)")
            out = self.scheduler.schedule()
            result.peak_running = max(result.peak_running, len(self.scheduler.running))
            result.peak_waiting = max(result.peak_waiting, len(self.scheduler.waiting))
            grown = 0
            if self.cfg.mode == "elastic":
                R = shortfall_mid_pages(out.shortfall_pages, self.smalls_per_mid)
                state = self._state(R, self.allocator.mid_capacity(EXPERT), out.num_tokens, len(out.stalled))
                plan = with_buffer_pages(self.adjuster.plan(state), state, self.adjuster)
                self.residency.evict(plan.evict)
                grown = len(self.residency.grow(plan.grow))
                moved = not plan.is_empty
            else:
                moved = False
            if out.is_empty:
                self.residency.complete_forward()  # no forward pass reads the evicted pages
                idle_steps = 0 if moved else idle_steps + 1
                if idle_steps > 2:
                    if nxt < len(order):
                        clock = max(clock, requests[order[nxt]].arrival_s)
                        idle_steps = 0
                        continue
                    raise SimulationError(f"stuck: {len(self.scheduler.waiting)} requests wait for pages the pool "
                                          f"cannot give (free KV pages {self.kv.capacity_pages()})")
                continue
            idle_steps = 0
            chunks = [(s.start, s.num_new_tokens) for s in out.scheduled]
            sampled = sum(s.samples for s in out.scheduled)
            cost = self.cost.step(chunks, sampled, self.residency.resident, grown)
            clock += cost.time_s
            # as the engine measures it: the pass's time without the piecewise overhead, and the copies issued
            self.step_cost.observe_forward(cost.time_s - cost.piecewise_s, cost.copy_s, out.num_tokens)
            result.forward_steps += 1
            result.pcie_bytes += cost.pcie_bytes
            for s in out.scheduled:
                self._advance(s.request, s.start + s.num_new_tokens, s.samples, clock, live, result)
            self.residency.complete_forward()
            if self.residency.buffer_pages and self.residency.all_resident():
                self.residency.release_buffers()
            expert_bytes = self.residency.num_pages * g.size(EXPERT)
            kv_bytes = self.kv.pages_in_use * g.size(KV)
            for k, v in (("t", clock), ("running", len(self.scheduler.running)),
                         ("waiting", len(self.scheduler.waiting)),
                         ("kv_bytes", kv_bytes), ("expert_bytes", expert_bytes),
                         ("free_bytes", self.mem.pool - kv_bytes - expert_bytes), ("step_s", cost.time_s),
                         ("pcie_bytes", cost.pcie_bytes)):
                cols[k].append(v)
        first = requests[order[0]].arrival_s if requests else 0.0
        result.sim_time_s = clock - first
        result.preemptions = self.scheduler.num_preemptions
        result.evictions, result.grows = self.residency.evictions, self.residency.grows
        result.timeline = _subsample(cols, timeline_points)
        result.final_pages = self.page_accounting()
        return result

    def _admit(self, idx: int, r: SimRequest, live: dict[int, SimRequest]) -> None:
        most = self.kv.capacity_pages() + self.kv.pages_in_use + self._evictable_kv_pages()
        need = self.kv.blocks_for(r.prompt_len + r.output_len) * self.kv.num_layers
        if need > most:
            raise SimulationError(f"request {idx} needs {need} KV pages ({r.prompt_len} + {r.output_len} tokens), "
                                  f"the pool can never hold more than {most}")
        req = Request(request_id=str(idx), seq_id=idx, prompt=None, prompt_token_ids=[0] * r.prompt_len,
                      params=SamplingParams(max_tokens=r.output_len, ignore_eos=True), max_tokens=r.output_len,
                      eos_token_id=None, arrival_time=r.arrival_s)
        live[idx] = r
        self.scheduler.add(req)

    def _evictable_kv_pages(self, bound: int | None = None) -> int:
        """KV pages that evicting every expert the limits (and `bound` offloaded in all) allow would free."""
        if self.cfg.mode != "elastic":
            return 0
        E = self.spec.num_experts
        offloaded = [E - int(n) for n in self.residency.resident.sum(axis=1)]
        pages = reclaimable_experts(offloaded, self.offload_limit, bound) * PAGES_PER_EXPERT
        if pages and not self.residency.buffer_pages:  # the first evictions pay for the load buffers
            pages = max(0, pages - self.buffer_mid_pages)
        return pages * self.smalls_per_mid

    def _advance(self, req: Request, computed: int, samples: bool, now: float,
                 live: dict[int, SimRequest], result: SimResult) -> None:
        req.num_computed_tokens = computed
        if not samples:
            return
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

    def page_accounting(self) -> dict[str, int]:
        """Every pool byte at the end: expert pages + KV pages + free = pool (checked by the allocator too)."""
        self.allocator.check_invariants()
        st = self.allocator.stats()
        g = self.mem.geometry
        return {"pool_bytes": self.mem.pool, "expert_pages": st.used_pages.get(EXPERT, 0),
                "expert_pages_tracked": self.residency.num_pages, "kv_pages": st.used_pages.get(KV, 0),
                "kv_pages_tracked": self.kv.pages_in_use, "free_bytes": st.total_free_bytes,
                "used_bytes": st.total_used_bytes, "pending_deferred": st.pending_deferred,
                "expert_page_bytes": g.size(EXPERT)}


def _subsample(cols: dict[str, list[float]], points: int) -> dict[str, list[float]]:
    n = len(cols["t"])
    if n <= points:
        return cols
    idx = np.linspace(0, n - 1, points).round().astype(int)
    return {k: [v[i] for i in idx] for k, v in cols.items()}
