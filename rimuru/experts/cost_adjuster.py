"""The cost-aware adjuster: offload only the experts whose PCIe copies pay for the KV room they free.

Every offloaded expert that a step's batch routes to crosses PCIe in that step (docs/design.md, Adjusters). For a
candidate number n of offloaded experts (all layers; the n least popular the limits allow, in the order
`pick_grows` / `pick_evictions` would move them) the adjuster models one decode step:

    g(n)        = P (n - n_now) - (B(n) - B(n_now))       mid pages the move frees (P = pages per expert; B(n) =
                                                         the load buffers' pages: with lazy buffers 6 per slot, as
                                                         many slots as the most offloaded experts of one layer
                                                         among the n, never fewer than held, 0 when n = 0)
    conc(n)     = min(demand, (kv + F + g) / footprint)   concurrent requests in the long run; footprint =
                                                         kv / running; demand = running, + waiting while
                                                         requests wait for pages (R > 0). Under TTFT pressure
                                                         (below) the next steps' count instead: the first
                                                         waiting request needs R more pages than are free (FIFO),
                                                         running + [g >= R] (1 + (g - R) / footprint)
    compute(n)  = c (fixed + (1 - fixed) conc(n) / running)  c = compute measured on copy-free passes (step_cost.py)
    act(n)      = sum over the n offloaded e of 1 - (1 - p_e)^(top_k conc(n))   expected activated
    copy(n)     = act(n) expert_bytes / pcie_bandwidth x slowdown x excess
                                                         slowdown >= 1: copies slower than the link, measured;
                                                         excess >= 1: experts copied per routed one (wasted
                                                         prefetches), and under direct access offloaded experts
                                                         read per read the popularity estimate expected (its
                                                         lag behind the traffic), measured (step_cost.py)
    step(n)     = compute(n) + max(0, copy(n) - overlap compute(n)) + [n > 0] piecewise_overhead
    tput(n)     = conc(n) / step(n)                      decode tokens per second

slowdown, overlap and excess are learned from the engine's passes with copies (step_cost.py); the overlap is at
most `copy_overlap` and starts at `initial_copy_overlap` = 0, so copies not yet measured count as exposed (see
CostAdjusterConfig). Without an SLO and with copy access the adjuster therefore offloads voluntarily only experts the
batch is not expected to route to, and otherwise only when the experts do not all fit (forced offloading, below);
with direct access (the default: the kernel reads offloaded experts in host memory, modelled as copies that never
hide, at the speed they were measured to take) tokens per second decide among every reachable split; with
`--slo-tpot-p99-ms` it trades exposed copies for KV room within it; without `--slo-ttft-p99-ms` it makes room for any
queue short of pages within a small loss of long-run throughput (admission, below), and with it for a queue whose head
has waited a quarter of the target (TTFT pressure, below). piecewise_overhead (measured by the engine
at start-up) is what a pass with any expert offloaded costs beyond one with all resident (piecewise CUDA graphs
instead of whole ones); the elastic runtime takes it out of piecewise passes' times before they reach the
compute estimate, and the model charges it to every n > 0.

Rules, every step:
  * Allowed n: reachable (from n_min = n_now - free/P, since grows take free pages only, up to every expert the
    limits allow) and, with a TPOT SLO, within it (step(n) + mixed <= tpot_slo_s / correction, where mixed is what
    steps with prefill chunks add to the mean step, measured: a request's TPOT averages every step it is in); without
    one, with copy access, hiding its copies (copy(n) - overlap compute(n) <= exposed_copy_share compute(n)), with
    direct access any (`hide_copies_without_slo`). The best allowed n maximises tput.
    The correction (>= 1) is learned from finished requests: every `tpot_feedback_requests` of them it is
    multiplied by their measured TPOT p99 over the SLO, so a model that underestimates offloaded steps (on the
    H200 it held the modelled step within 50 ms while requests saw 62-82 ms) tightens its own bound.
  * Forced offloading (no SLO, and n_now - (F + KV pages) / P > 0: the experts do not all fit even without KV,
    e.g. Qwen3-30B-A3B at 48 GiB) allows every n: copies show whatever the split, so tokens per second decide.
    A pool merely full of KV is not forced: when no reachable split hides its copies there (they were measured
    costlier after the evictions), no n above n_now is allowed.
  * TTFT pressure (`ttft_slo_s`): while the head of the queue lacks pages (R > 0) and has waited
    `ttft_pressure_share` of the target, the adjuster evicts towards the fewest offloaded that admit the whole
    queue in the next steps (the first n of highest head-counted concurrency, the model's `head` form), within the
    TPOT target when one is set (the next steps' batch and the long run's), and giving up at most
    `ttft_pressure_max_loss` of the modelled long-run tokens per second of the best split or, where that is more,
    of the batch with every expert home (the steady model's n = 0: experts out stay out under pressure, so the best
    reachable split is the last plan's target, and a loss allowed against it would compound plan after plan);
    experts stay out while the pressure lasts and come home by the rules below once it ends. Past the engine's
    capacity no split meets the TTFT target, and evicting for the queue then only slows every step: on the H200
    (Qwen1.5-MoE shapes, 32 GiB, uniform, 40 req/s), unbounded in throughput, the rule read 1 TB of experts from
    host memory for 0.54x static's output.
  * Admission (no `ttft_slo_s`): the same rule from the first plan short of pages, giving up at most
    `admission_max_loss` (1 %) of the long-run tokens per second, and within the allowed splits. Where KV room is
    scarce and cold experts are cheap (Qwen3-30B-A3B shapes at 59 GiB, zipf 1.0) that admits the queue at once;
    where an expert's pages hold a sliver of a request and every step reads it (Qwen1.5-MoE shapes at 32 GiB: 3
    mid pages against ~11 a request), hardly any expert goes. Experts out come home by `_home_target` as usual.
    In the simulator 1 % keeps the 59 GiB cells' TTFT p99 (0.13-0.44 s at zipf 8 and 16 req/s and uniform 10, as 3 %
    does; 11.5 and 14.9 s at zipf 16 and uniform 10 without admission) and loses 0.6 % of static's output at
    Qwen1.5 zipf:1.5 40 req/s where 3 % loses 2.0 % (benchmarks/sim_adjuster_setting.py); on the H200 3 % took 3
    experts out for the queue at Qwen1.5 30 and 60 req/s (docs/benchmarks.md section 16).
  * Direction: while requests wait for pages (R > 0) the adjuster evicts towards the best n, even when n_now is
    within `min_gain` of it (holding still there leaves requests waiting seconds for a split a few per cent
    better); when nobody is short it aims for the smallest n within `min_gain` of the best, so experts come home
    once that costs no throughput. Experts also come home, even while requests wait, when fewer offloaded serve
    more tokens per second in the long run with the pages they take counted as requests not admitted
    (`_home_target`, by more than `home_min_gain`; splits from five below n_now down to every expert home): that undoes
    evictions whose copies turned out to hide less, or whose experts the batch turned out to route to more, than
    assumed. A split below that serves `home_override_gain` more than the one the rules above chose wins over them
    too, even where they would evict more. The free pages
    those grows need are kept from new admissions (`grow_reserve`), for at most `reserve_patience_steps` plans
    without a grow.
  * Pace: a grow waits `reverse_cooldown_steps` steps after an eviction (no flapping; evictions never wait), a
    step moves at most `max_evict_per_step` / `max_grow_per_step` experts, and grows leave `grow_reserve_mid`
    pages free.
  * Hard shortfall: when the scheduler is short (R > 0) and nothing could be scheduled (no tokens), no running
    request will free pages, so the adjuster evicts ceil((R + evict_margin) / P) experts whatever the cost,
    bounded only by the limits. A short scheduler with running requests is not stuck: they finish and free pages.
    Until the first compute time is measured, the adjuster only honours hard shortfalls and grows nothing back.
  * Stalls are bounded by the model (`max_offloaded`): the engine's scheduler lets a running request that lacks
    pages sit out a step, waiting for evictions, only while evicting stays within the largest allowed n of the
    last plan; beyond it the request is preempted, as in static mode. Unbounded, stalls would drive experts out
    until every step copies them.
  * Held plans: a model plan that moved nothing answers the next `replan_interval_steps - 1` plans whose decision
    shape is the same (experts out, requests short of pages, waiting, TTFT pressure, room for one grow, the TPOT
    correction), up to the end of a cooldown or of the grow reserve's patience; the hard shortfall is never held.
    A model plan that holds again in the same shape holds twice as long, up to `max_replan_interval_steps`.
    On the H200 the model took 3.1 ms of host time in every decode step at Qwen1.5-MoE shapes with one expert out,
    and elastic served 0.906x static's output at 60 req/s with as many steps; held, 1.0 ms and 0.952x
    (docs/benchmarks.md section 17).
  * Candidates: every n when there are at most `dense_candidates` of them, else every n within
    `dense_candidates // 4` of the current count plus a geometric grid over the rest, because the model costs
    O(candidates x offloadable experts) of host time per step (benchmarks/bench_adjuster_host.py; results in
    benchmarks/results/2026-11-29-adjuster-host-cpu.json).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from rimuru.experts.adjuster import (
    AdjusterState,
    AdjustPlan,
    as_experts,
    buffer_pages_for,
    eviction_order,
    grow_order,
    most_offloaded_after,
    pick_evictions,
)


@dataclass(frozen=True)
class CostAdjusterConfig:
    # bytes/s, expert loads through the loader on the H200 (47-53 GB/s by batch size, plain pinned copies 55:
    # benchmarks/results/2026-11-29-expert-transfer-h200.json)
    pcie_bandwidth: float = 52e9
    # the most compute a copy may hide behind (the H200 in isolation, one expert per layer: 0.70-0.88 over
    # 1-256 tokens, same file)
    copy_overlap: float = 0.8
    # What the step-cost tracker assumes before any copy is measured in the engine. 0: unmeasured copies are
    # exposed, because in served passes on-demand misses and the per-layer routing reads serialise with compute
    # and copies hide next to nothing (on the H200 the learned overlap drops to ~0 within seconds, slowdown 2-3);
    # a start at the cap makes the first evictions look free, and the KV that then takes their pages keeps the
    # experts out until requests finish. Where copies do hide, the tracker learns it upward from such passes.
    initial_copy_overlap: float = 0.0
    compute_fixed_share: float = 0.8  # share of step compute that does not grow with the batch (weight reads)
    tpot_slo_s: float | None = None  # when set: allowed n keep the modelled step time within it
    # The model's decode step misses costs (mixed prefill steps, routing reads, copies it counts as hidden), so
    # with a TPOT SLO the bound it holds the modelled step to is the SLO / a correction learned from what finished
    # requests saw: after every `tpot_feedback_requests` new ones, correction *= measured TPOT p99 / SLO, kept in
    # [1, max_tpot_correction] (never looser than the SLO; back towards it while requests do better).
    tpot_feedback_requests: int = 16
    max_tpot_correction: float = 10.0
    # when set: while the head of the queue, short of pages, has waited `ttft_pressure_share` of it, evict for the
    # waiting requests beyond the throughput-best split (within tpot_slo_s when that is set, and giving up at most
    # `ttft_pressure_max_loss` of the modelled tokens per second)
    ttft_slo_s: float | None = None
    ttft_pressure_share: float = 0.25
    ttft_pressure_max_loss: float = 0.1  # the share of modelled tokens/s the TTFT pressure may give up (see above)
    # without a TTFT target: admitting requests that wait for pages (the same rule as the TTFT pressure, from the
    # first step short of pages) may give up this share of the modelled long-run tokens/s
    admission_max_loss: float = 0.01
    exposed_copy_share: float = 0.0  # without an SLO: copy time may exceed the hideable time by this x compute
    # Without an SLO, whether a split is allowed only where its copies hide (copy access: copies are learned slower
    # and less hidden than modelled, so an eviction that shows its copies is taken back only after it has cost) or
    # every reachable split is, tokens per second deciding (direct access: the kernel reads offloaded experts at the
    # link's speed on the step's path, nothing to hide and no copy to mis-estimate: benchmarks/bench_direct_host_moe.py
    # measured 0.17-0.18 ms per routed expert, the model's bytes / bandwidth). The SLO bounds replace this rule.
    hide_copies_without_slo: bool = True
    min_gain: float = 0.05  # a candidate within this share of the best throughput is as good as the best
    # Experts out come home (_home_target) where that serves more than this share more tokens/s in the long run.
    # Twice the admission allowance: an expert let go for the queue at a modelled loss of up to 1 % comes back once
    # it costs twice that. On the H200 (Qwen1.5-MoE shapes, 32 GiB, 60 req/s) the one expert admitted with was
    # expected to be read 0.28 times a decode step and was read at every step 3 s later (the dummy router's shares
    # move as steps turn from prefill to decode): ~3 % of the step, which a 5 % bar kept out until the queue drained.
    home_min_gain: float = 0.02
    # Experts out come home even where the other rules would evict more (the reachable splits' best, the admission
    # of a queue), when a split below serves this share more tokens/s in the long run than the split they chose:
    # the evictions' copies or reads turned out to cost more than the model assumed when it made them.
    home_override_gain: float = 0.1
    reverse_cooldown_steps: int = 50  # steps after an eviction before a grow
    max_evict_per_step: int = 8
    max_grow_per_step: int = 5
    grow_reserve_mid: int = 9  # free mid pages left after grows (running requests grow into them)
    pages_per_expert: int = 3
    evict_margin: int = 1  # hard shortfall of R pages -> free R + margin pages
    dense_candidates: int = 64  # up to this many candidate counts: all evaluated; beyond: near n_now + a grid
    reserve_patience_steps: int = 50  # most plans in a row that keep pages from admissions without a grow
    # A model plan that moved nothing holds for this many steps while what it decided on keeps its shape (experts
    # out, requests short of pages or waiting, TTFT pressure, a grow's room, the TPOT correction): the model is the
    # costliest host work of an elastic step (~3 ms at Qwen1.5-MoE shapes on the H200 host, every step while one
    # expert was out: 0.91x static's output at 60 req/s), and its inputs move over seconds, not steps. Each model
    # plan that holds again in the same shape holds twice as long, up to max_replan_interval_steps (~0.3 s of
    # ~10 ms steps); a change of shape or a move starts again from replan_interval_steps.
    replan_interval_steps: int = 8
    max_replan_interval_steps: int = 32

    def __post_init__(self) -> None:
        if self.pcie_bandwidth <= 0:
            raise ValueError(f"pcie_bandwidth must be positive, got {self.pcie_bandwidth}")
        for name in ("copy_overlap", "compute_fixed_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 <= self.initial_copy_overlap <= self.copy_overlap:
            raise ValueError(f"initial_copy_overlap must be in [0, copy_overlap = {self.copy_overlap}], "
                             f"got {self.initial_copy_overlap}")
        for name in ("tpot_slo_s", "ttft_slo_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.tpot_feedback_requests < 1 or self.max_tpot_correction < 1:
            raise ValueError(f"need tpot_feedback_requests >= 1 and max_tpot_correction >= 1, got "
                             f"{self.tpot_feedback_requests}, {self.max_tpot_correction}")
        for name in ("ttft_pressure_share", "ttft_pressure_max_loss", "admission_max_loss"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if (self.exposed_copy_share < 0 or self.min_gain < 0 or self.home_min_gain < 0 or self.home_override_gain < 0
                or self.reverse_cooldown_steps < 0):
            raise ValueError("exposed_copy_share, min_gain, home_min_gain, home_override_gain and "
                             "reverse_cooldown_steps must be >= 0")
        if self.max_evict_per_step < 1 or self.max_grow_per_step < 0 or self.grow_reserve_mid < 0:
            raise ValueError("max_evict_per_step must be >= 1; max_grow_per_step, grow_reserve_mid >= 0")
        if self.pages_per_expert < 1 or self.evict_margin < 0:
            raise ValueError("pages_per_expert must be >= 1 and evict_margin >= 0")
        if self.reserve_patience_steps < 1:
            raise ValueError(f"reserve_patience_steps must be >= 1, got {self.reserve_patience_steps}")
        if not 1 <= self.replan_interval_steps <= self.max_replan_interval_steps:
            raise ValueError(f"need 1 <= replan_interval_steps <= max_replan_interval_steps, got "
                             f"{self.replan_interval_steps}, {self.max_replan_interval_steps}")
        if self.dense_candidates < 8:
            raise ValueError(f"dense_candidates must be >= 8, got {self.dense_candidates}")


@dataclass(frozen=True)
class CostEstimate:
    """The model's view of the last step (for tests, logs and the simulator's report)."""

    offloaded: int  # n now (after moves in flight)
    target: int  # the n the adjuster moves towards
    best: int  # the allowed n of highest modelled throughput
    compute_s: float | None
    candidates: list[int] = field(default_factory=list, repr=False)  # the n evaluated (all 0..max when few)
    throughput: list[float] = field(default_factory=list, repr=False)  # per candidate, tokens/s (0: not allowed)
    step_s: list[float] = field(default_factory=list, repr=False)  # per candidate, modelled step time
    max_allowed: int | None = None  # the largest allowed candidate (None: no compute time measured yet)
    hard: bool = False
    # offloaded experts a decode step of the running batch is expected to read (the model's act(n_now)): set
    # beside the engine's measured reads, it shows whether the popularity estimate says what the batch routes
    expected_reads: float | None = None


def expected_activated(p: np.ndarray, tokens: float, top_k: int) -> np.ndarray:
    """Per expert: probability that a batch of `tokens` tokens, each picking `top_k` experts, routes to it:
    1 - (1 - p)^(tokens * top_k) (picks treated as independent draws with the expert's routing share p)."""
    p = np.clip(np.asarray(p, dtype=np.float64), 0.0, 1.0 - 1e-12)
    return -np.expm1(tokens * top_k * np.log1p(-p))


class CostAdjuster:
    def __init__(self, config: CostAdjusterConfig, expert_bytes: int, top_k: int,
                 compute_time: Callable[[int], float | None],
                 copy_slowdown: Callable[[], float] | None = None,
                 copy_overlap: Callable[[], float] | None = None,
                 copy_excess: Callable[[], float] | None = None,
                 mixed_step_surcharge: Callable[[], float] | None = None) -> None:
        if expert_bytes <= 0 or top_k < 1:
            raise ValueError(f"need expert_bytes > 0 and top_k >= 1, got {expert_bytes}, {top_k}")
        self.config = config
        self.expert_bytes = expert_bytes
        self.top_k = top_k
        # the measured compute time of a pass of that many batched tokens (StepCostTracker), None before any
        self.compute_time = compute_time
        # how much longer the engine's expert copies take than bytes / pcie_bandwidth (StepCostTracker, >= 1)
        self.copy_slowdown = copy_slowdown or (lambda: 1.0)
        # the share of compute copies hide behind, as measured (StepCostTracker; at most config.copy_overlap)
        self.copy_overlap = copy_overlap or (lambda: config.copy_overlap)
        # experts the engine copies per routed offloaded expert (StepCostTracker, >= 1: wasted prefetches)
        self.copy_excess = copy_excess or (lambda: 1.0)
        # what steps with prefill chunks add to a decoding request's mean step (StepCostTracker): a TPOT target
        # bounds the modelled decode step plus this, since a request's TPOT averages every step it is in
        self.mixed_step_surcharge = mixed_step_surcharge or (lambda: 0.0)
        # What a pass with any expert offloaded costs beyond one with all resident, whatever it copies: the engine
        # replays piecewise graphs then (host work and launches at every MoE layer) and whole graphs otherwise.
        # Measured by the engine at start-up (StepGraphs.measure_piecewise_overhead); 0 without graphs.
        self.piecewise_overhead_s = 0.0
        self.step = 0
        self._last_move_step = -(10**9)
        self._last_direction = 0  # +1 evicted, -1 grew
        # the stall bound of the last plan made while requests waited for pages: a calm step (R = 0) keeps it, so
        # the first shortage after a calm spell may stall for evictions instead of preempting
        self._short_bound: int | None = None
        self._reserve_mid = 0  # mid pages kept from admissions for the last plan's grows (grow_reserve)
        self._reserve_since: int | None = None  # the plan since which grows have waited for pages
        self.last: CostEstimate | None = None
        self.tpot_correction = 1.0  # measured TPOT p99 over the SLO, accumulated (see tpot_feedback_requests)
        self._tpot_seen = 0  # finished requests observed when the correction was last updated
        # the last model plan that moved nothing: (what it decided on, the step until which it holds, its grow
        # reserve)
        self._held: tuple[tuple, int, int] | None = None
        self.plans_held = 0  # plans answered by a held one (replan_interval_steps)
        # the shape the last model plans held in, one after another, and how long the last of them held
        self._hold_shape: tuple | None = None
        self._hold_interval = config.replan_interval_steps

    @property
    def tpot_bound_s(self) -> float | None:
        """What the modelled decode step may take: the TPOT SLO over the learned correction (None: no SLO)."""
        slo = self.config.tpot_slo_s
        return None if slo is None else slo / self.tpot_correction

    def _learn_tpot(self, state: AdjusterState) -> None:
        cfg = self.config
        if cfg.tpot_slo_s is None or state.tpot_p99_s is None:
            return
        if state.tpot_observed - self._tpot_seen < cfg.tpot_feedback_requests:
            return
        self._tpot_seen = state.tpot_observed
        ratio = state.tpot_p99_s / cfg.tpot_slo_s
        self.tpot_correction = min(cfg.max_tpot_correction, max(1.0, self.tpot_correction * ratio))

    def max_offloaded(self) -> int | None:
        """The largest number of offloaded experts the last plan's model allowed: the engine's scheduler stalls
        running requests for evictions only up to it (and preempts beyond). 0 before any plan; before the first
        compute time is measured, the count then offloaded (no voluntary evictions)."""
        return 0 if self.last is None or self.last.max_allowed is None else self.last.max_allowed

    def offloaded_at_least(self, n: int) -> None:
        """The elastic core offloads `n` experts in all, more than the last plan moved (the first eviction
        also pays for the load buffers' pages): the stall bound covers them."""
        if self.last is not None:
            self.last = replace(self.last, max_allowed=max(n, self.last.max_allowed or 0))
        if self._short_bound is not None:
            self._short_bound = max(self._short_bound, n)

    def set_piecewise_overhead(self, seconds: float) -> None:
        self.piecewise_overhead_s = seconds

    def stats(self) -> dict[str, float]:
        """The compute estimate of the last plan, the split it aims for and its stall bound, and the mid pages it
        keeps from admissions."""
        out = {"cost_grow_reserve_mid_pages": float(self.grow_reserve()), "cost_plans_held": float(self.plans_held)}
        last = self.last
        if last is not None:
            out["cost_target_offloaded"] = float(last.target)
            if last.compute_s is not None:
                out["cost_compute_ms"] = 1e3 * last.compute_s
            if last.max_allowed is not None:
                out["cost_max_offloaded"] = float(last.max_allowed)
            if last.expected_reads is not None:
                out["cost_expected_reads"] = last.expected_reads
        if self.config.tpot_slo_s is not None:
            out["cost_tpot_correction"] = self.tpot_correction
        return out

    def plan(self, state: AdjusterState) -> AdjustPlan:
        cfg = self.config
        self.step += 1
        self._reserve_mid = 0
        self._learn_tpot(state)
        P = cfg.pages_per_expert
        E = state.rankings.shape[1]
        n_now = sum(E - len(r) for r in state.resident)
        R, F = state.shortfall_mid_pages, state.free_mid_pages
        # stuck (nothing ran), or running requests stalled for pages: only evicting lets them go on. Stalls
        # happen only within max_offloaded (the scheduler preempts beyond), so these evictions stay in budget.
        if R > 0 and (state.num_batched_tokens == 0 or state.num_stalled > 0):
            k = -(-(R + cfg.evict_margin) // P)
            bound = self._short_bound
            if state.num_batched_tokens > 0 and bound is not None:  # a stall: the margin stays within the bound
                k = min(k, max(-(-R // P), bound - n_now))
            evict = pick_evictions(state, k)
            n = n_now + len(evict)
            self.last = CostEstimate(offloaded=n_now, target=n, best=n, compute_s=self.compute_time(state.num_running),
                                     max_allowed=max(bound if bound is not None else n, n), hard=True)
            return self._moved(AdjustPlan(evict=evict))
        if R == 0 and n_now == 0:
            # nothing offloaded and nobody short of pages: no grow is possible and no eviction can pay (with R = 0
            # the model's n = 0 has the full concurrency and no copies); skip the model, keep its last bound
            bound = self._short_bound if self._short_bound is not None else 0
            self.last = CostEstimate(offloaded=0, target=0, best=0, compute_s=self.compute_time(state.num_running),
                                     max_allowed=bound)
            return AdjustPlan()
        shape = self._decision_shape(state, n_now)
        if self._held is not None and self._held[0] == shape and self.step < self._held[1]:
            self.plans_held += 1
            self._reserve_mid = self._held[2]  # the held plan's grow reserve (and its stall bound) stand
            return AdjustPlan()
        self._held = None
        compute = self.compute_time(state.num_running)  # a decode step of the running batch
        if compute is None or compute <= 0:
            self.last = CostEstimate(offloaded=n_now, target=n_now, best=n_now, compute_s=compute, max_allowed=n_now)
            return AdjustPlan()
        # flat ids (l * E + e): every non-resident expert, most popular first; every evictable one, least first
        grows = grow_order(state, n_now)
        evicts = eviction_order(state, sum(state.limit(layer) for layer in range(len(state.resident))))
        order = np.concatenate([grows[::-1], evicts])  # offloaded(n) = order[:n]
        # grows can only take free pages (running requests keep theirs): fewer offloaded than n_min is not reachable
        n_min = max(0, n_now - max(0, F - cfg.grow_reserve_mid) // P)
        cands = self._candidates(len(order), n_now, n_min)
        tput, step_s, allowed = self._model(state, order, n_now, compute, cands)
        if not allowed.any() and cfg.tpot_slo_s is None:
            if n_now - (F + int(state.kv_mid_pages)) // P > 0:
                # forced offloading (the experts do not all fit even without any KV): every split exposes copies,
                # so hiding them is no criterion; the split that serves the most tokens per second is
                allowed = np.ones_like(allowed)
            else:
                # every reachable split exposes copies only because KV fills the pool (e.g. the copies were
                # measured slower than the model assumed when they were evicted): evict no more; bring experts
                # home where that serves more tokens per second
                allowed = cands <= n_now
        if not allowed.any():  # an SLO nothing meets: the fastest step
            i_best = int(np.argmin(step_s))
            good = np.zeros_like(allowed)
            good[i_best] = True
        else:
            i_best = int(np.argmax(np.where(allowed, tput, -1.0)))
            good = allowed & (tput >= (1.0 - cfg.min_gain) * tput[i_best])
        best = int(cands[i_best])
        if R > 0:  # requests wait for pages: evict towards the best split (never grow while short)
            target = max(n_now, best)
        elif state.num_waiting > 0:  # a queue (e.g. a request just preempted): its pages are not for experts
            target = max(n_now, int(cands[np.flatnonzero(good).min()]))
        else:  # not short: the fewest offloaded experts that cost no throughput
            target = int(cands[np.flatnonzero(good).min()])
        if cfg.ttft_slo_s is None:  # admission: any queue short of pages, within admission_max_loss
            pressure, max_loss = R > 0, cfg.admission_max_loss
        else:
            pressure = R > 0 and state.oldest_wait_s >= cfg.ttft_pressure_share * cfg.ttft_slo_s
            max_loss = cfg.ttft_pressure_max_loss
        if pressure:
            # the queue's TTFT is at risk: the fewest offloaded that admit every waiting request the model can (the
            # first candidate of highest concurrency in the next steps: the evictions that cover the head's
            # shortfall admit it), within the TPOT target and the long-run throughput it may give up. The loss counts
            # in the long run (an expert out stays out for many steps) against the best split or the batch with every
            # expert home, whichever serves more (see the module's docstring: against the best reachable split alone
            # it compounds); the next steps' model runs over the candidates within it only (host time: it is the
            # costliest part of a plan)
            home, _, _ = self._model(state, order, n_now, compute, np.zeros(1, dtype=np.int64), steady=True)
            near = np.flatnonzero(tput >= (1.0 - max_loss) * max(float(home[0]), float(tput[i_best])))
            if cfg.ttft_slo_s is None and self.tpot_bound_s is None:  # admission keeps the steady choice's rule
                near = near[allowed[near]]
            if near.size:
                tput_h, step_h, _ = self._model(state, order, n_now, compute, cands[near], head=True)
                within = np.ones(near.size, dtype=bool)
                if (bound := self.tpot_bound_s) is not None:  # the next steps' batch and the long run's within it
                    within = np.maximum(step_h, step_s[near]) + self.mixed_step_surcharge() <= bound
                if within.any():
                    pick = int(np.argmax(np.where(within, tput_h * step_h, -1.0)))
                    target = max(target, int(cands[near[pick]]))
        # stalls may wait for evictions up to the best split (the smallest of equals: a tie offloads no more), or
        # the TTFT target's; with nobody short the best is computed without a queue, so the last bound made under
        # pressure holds
        max_allowed = max(n_now, best, target)
        if R > 0:
            self._short_bound = max_allowed
        elif self._short_bound is not None:
            max_allowed = max(max_allowed, self._short_bound)
        if not (pressure and cfg.ttft_slo_s is not None):
            # experts home where that pays in the long run, even while requests wait and even where the reachable
            # splits say evict more (see _home_target); under TTFT pressure the experts out stay out
            home = self._home_target(state, order, n_now, compute, target)
            if home < n_now:
                target = min(target, home)
        out = np.asarray(state.probabilities, dtype=np.float64).reshape(-1)[order[:n_now]]
        reads = float(expected_activated(out, max(1, state.num_running), self.top_k).sum())
        self.last = CostEstimate(offloaded=n_now, target=target, best=best, compute_s=compute,
                                 candidates=cands.tolist(), throughput=np.where(allowed, tput, 0.0).tolist(),
                                 step_s=step_s.tolist(), max_allowed=max_allowed, expected_reads=reads)
        direction = int(np.sign(target - n_now))
        if direction >= 0:
            self._reserve_since = None  # no grow wanted: a later wish for one starts its patience afresh
        if direction == 0:
            return self._hold(shape)
        # a grow right after an eviction waits for the cooldown (no flapping); an eviction while requests wait
        # never does (after a grow, a queue that forms would otherwise wait the whole cooldown: seconds)
        if direction < 0 < self._last_direction and self.step - self._last_move_step < cfg.reverse_cooldown_steps:
            return self._hold(shape, self._last_move_step + cfg.reverse_cooldown_steps)
        if direction > 0:
            return self._moved(AdjustPlan(evict=as_experts(evicts[:min(target - n_now, cfg.max_evict_per_step)], E)))
        room = max(0, (F - cfg.grow_reserve_mid) // P)
        want = min(n_now - target, cfg.max_grow_per_step)
        n = min(want, room)
        # keep new admissions out of the pages these grows need (the scheduler reads it), but for at most
        # `reserve_patience_steps` plans without a grow (e.g. the only running request holds the pages); then
        # admit for as long again before reserving anew
        if n > 0:
            self._reserve_since = None
        elif self._reserve_since is None or self.step - self._reserve_since >= 2 * cfg.reserve_patience_steps:
            self._reserve_since = self.step
        waited = 0 if self._reserve_since is None else self.step - self._reserve_since
        if room < want and waited < cfg.reserve_patience_steps:
            self._reserve_mid = P * want + cfg.grow_reserve_mid
        return self._moved(AdjustPlan(grow=as_experts(grows[:n], E))) if n > 0 else self._hold(shape)

    def _decision_shape(self, state: AdjusterState, n_now: int) -> tuple:
        """What a model plan that moves nothing decided on, coarsely: while it stays the same the plan is held
        (replan_interval_steps). Experts out, requests short of pages or waiting, a TTFT pressure, room for one grow
        beside the reserve, the TPOT correction. (Stalls and steps with nothing scheduled take the hard-shortfall
        rule before any held plan is looked at.)"""
        cfg = self.config
        R = state.shortfall_mid_pages
        pressure = (cfg.ttft_slo_s is not None and R > 0
                    and state.oldest_wait_s >= cfg.ttft_pressure_share * cfg.ttft_slo_s)
        room = state.free_mid_pages - cfg.grow_reserve_mid >= cfg.pages_per_expert
        return (n_now, R > 0, state.num_waiting > 0, pressure, room, self.tpot_correction)

    def _hold(self, shape: tuple, until: int | None = None) -> AdjustPlan:
        """A model plan moved nothing: the next plans of the same shape answer the same without running the model,
        `replan_interval_steps - 1` of them after a change, twice as many each time the model holds again in that
        shape (up to `max_replan_interval_steps`), and never past step `until` (the end of a cooldown that held a
        grow back); a grow reserve's patience ends a hold where it changes the reserve."""
        cfg = self.config
        if shape == self._hold_shape:
            self._hold_interval = min(cfg.max_replan_interval_steps, 2 * self._hold_interval)
        else:
            self._hold_shape, self._hold_interval = shape, cfg.replan_interval_steps
        end = self.step + self._hold_interval
        until = end if until is None else min(until, end)
        if (since := self._reserve_since) is not None:
            waited = self.step - since
            until = min(until, since + (cfg.reserve_patience_steps if waited < cfg.reserve_patience_steps
                                        else 2 * cfg.reserve_patience_steps))
        self._held = (shape, until, self._reserve_mid)
        return AdjustPlan()

    def grow_reserve(self) -> int:
        """Free mid pages the scheduler keeps from new admissions so that the last plan's grows can happen (the
        adjuster brings experts home while requests wait, where its model says that pays); 0 otherwise."""
        return self._reserve_mid

    def _home_target(self, state: AdjusterState, order: np.ndarray, n_now: int, compute: float,
                     target: int | None = None) -> int:
        """The offloaded count below n_now that serves the most tokens per second in the long run
        (`_model(steady=True)`), where that is more than `home_min_gain` above n_now, or, when `target` (the split the
        other rules chose) evicts more, more than `home_override_gain` above n_now and target; else n_now.
        Concurrency is what KV, free pages and the pages moved hold, (kv + F + P (n - n_now)) / footprint, up to every
        running and waiting request, so a grow costs the requests its pages would have held. Measured copies that hide
        less than when the experts were evicted make this pay, and experts out that the batch turned out to route to
        more than the estimate said when they left; nominal, unchanged ones never (fewer copies then save no time).

        The counts looked at are the `max_grow_per_step` below n_now and a geometric grid down to 0: the splits a
        grow reaches next and those far below, which pages freed by finishing requests reach later. Looking only
        near n_now misses a split far below that the model says is much better when each expert's share of it is
        small: on the H100 (Qwen1.5-MoE shapes, 32 GiB, multi-turn chats) 140-190 experts out doubled the step for
        17 % more requests, while five experts home would have gained under the bar."""
        cfg = self.config
        if n_now == 0 or cfg.max_grow_per_step == 0:
            return n_now
        near = np.arange(max(0, n_now - cfg.max_grow_per_step), n_now + 1)
        far = n_now + 1 - np.unique(np.round(np.geomspace(1, n_now + 1, min(n_now + 1, 16))).astype(np.int64))
        ks = np.union1d(near, far)
        if target is not None and target > n_now:
            ks = np.append(ks, target)
        tput, _, _ = self._model(state, order, n_now, compute, ks, steady=True)
        below = ks < n_now
        i = int(np.argmax(np.where(below, tput, -np.inf)))
        if target is None or target <= n_now:
            bar = (1.0 + cfg.home_min_gain) * float(tput[ks == n_now][0])
        else:
            bar = (1.0 + cfg.home_override_gain) * float(tput[ks >= n_now].max())
        return int(ks[i]) if tput[i] > bar else n_now

    def _candidates(self, n_max: int, n_now: int, n_min: int = 0) -> np.ndarray:
        """The offloaded counts the model evaluates, all in [n_min, n_max]: every one when few, else a window
        around n_now (where the rate-limited moves go next) and a geometric grid (n_min + 0, 1, 2, 3, 5, 7, ...)."""
        dense = self.config.dense_candidates
        if n_max - n_min + 1 <= dense:
            return np.arange(n_min, n_max + 1)
        half = dense // 4
        near = np.arange(max(n_min, n_now - half), min(n_max, n_now + half) + 1)
        steps = np.round(np.geomspace(1, n_max - n_min + 1, dense - len(near))).astype(np.int64) - 1
        return np.union1d(np.union1d(near, n_min + np.unique(steps)), [n_min, n_max])

    def _moved(self, plan: AdjustPlan) -> AdjustPlan:
        if not plan.is_empty:
            self._last_move_step = self.step
            self._last_direction = 1 if plan.evict else -1
            self._hold_shape = None  # the next hold starts from replan_interval_steps
        return plan

    def _model(self, state: AdjusterState, order: np.ndarray, n_now: int, compute: float,
               cands: np.ndarray, steady: bool = False, head: bool = False
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per candidate n in `cands`: modelled throughput, step time, and whether the split is allowed (with an
        SLO its step meets it; without, its copies hide, or every split is where `hide_copies_without_slo` is off).

        Concurrency is what the pool holds in the long run, (kv + F + freed) / footprint, up to every running
        request and, while requests wait for pages, every waiting one: an expert out for good holds P / footprint
        requests, however many its first pages admit. `head` (TTFT pressure only): while requests wait for pages,
        the pages that cover the head of the queue's shortfall R admit it whole and each footprint beyond them one
        more, what the next steps see. As a throughput model that overstates an eviction by footprint / R: the
        admitted request grows to a footprint like the others, and the expert stays out (on the H200, Qwen1.5-MoE
        shapes at 32 GiB, it evicted 63 experts for 0.29 requests each, 0.75x static's output).
        `steady`: no queue head and no floor of one request, for comparisons of long-run splits."""
        cfg = self.config
        P = cfg.pages_per_expert
        running = max(1, state.num_running)
        kv = float(state.kv_mid_pages)
        footprint = kv / running if state.num_running > 0 and kv > 0 else float(max(1, state.shortfall_mid_pages))
        queue = steady or state.shortfall_mid_pages > 0
        demand = state.num_running + (state.num_waiting if queue else 0)
        if state.max_num_seqs is not None:  # the scheduler never runs more, whatever room evictions make
            demand = min(demand, max(state.max_num_seqs, state.num_running))
        n = cands
        R = state.shortfall_mid_pages if head and not steady else 0
        # lazy load buffers grow with the most offloaded experts of a layer and give their pages back with the last
        # expert home: what a split frees is its experts' pages less the slots it adds
        E = state.rankings.shape[1]
        slots = most_offloaded_after(np.zeros(len(state.resident), dtype=np.int64), order, E)  # [len(order) + 1]
        buffers = buffer_pages_for(slots[np.minimum(n, len(order))], state)
        freed = P * (n - n_now) - (buffers - buffer_pages_for(slots[min(n_now, len(order))], state))
        if R > 0:  # the head of the queue needs R more pages; the requests behind it a footprint each
            admitted = np.where(freed >= R, 1.0 + (freed - R) / footprint, 0.0)
            conc = np.minimum(float(demand), state.num_running + admitted)
        else:
            conc = np.minimum(float(demand), (kv + state.free_mid_pages + freed) / footprint)
        conc = np.clip(conc, 0.0, None)
        conc = np.maximum(conc, 1.0) if demand > 0 and not steady else conc
        # the measured compute excludes the piecewise overhead (the elastic runtime takes it out of piecewise
        # passes' times); charge it to every split that offloads any expert
        overhead = self.piecewise_overhead_s
        comp = compute * (cfg.compute_fixed_share + (1.0 - cfg.compute_fixed_share) * conc / running)
        probs = np.asarray(state.probabilities, dtype=np.float64).reshape(-1)[order]
        act = np.cumsum(expected_activated(probs[None, :], conc[:, None], self.top_k), axis=1)  # [cands, order]
        act = np.where(n > 0, act[np.arange(len(n)), np.maximum(n - 1, 0)], 0.0) if len(order) else np.zeros(len(n))
        copy = act * self.expert_bytes / cfg.pcie_bandwidth * self.copy_slowdown() * self.copy_excess()
        exposed = np.maximum(0.0, copy - self.copy_overlap() * comp)
        step_s = np.maximum(comp + exposed + np.where(n > 0, overhead, 0.0), 1e-9)  # > 0 whatever the config
        bound = self.tpot_bound_s
        if bound is not None:
            ok = step_s + self.mixed_step_surcharge() <= bound
        elif cfg.hide_copies_without_slo:
            ok = exposed <= cfg.exposed_copy_share * comp + 1e-12
        else:
            ok = np.ones(len(n), dtype=bool)
        return conc / step_s, step_s, ok
