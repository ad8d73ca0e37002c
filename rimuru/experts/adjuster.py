"""The adjuster: after each schedule(), how many experts leave the pool (evict) or come back (grow), and which.

The paper's rules (DESIGN.md section 4; numbers are `AdjusterConfig` defaults, never literals here), with
R = mid pages the scheduler still lacks for the next waiting request and F = free mid pages:

    R > 0                    -> evict ceil((R + evict_margin) / pages_per_expert)   (R = 8 -> 3)
    R = 0 and F < low (2)    -> evict low_free_evict (1)
    F > high (9)             -> grow min(max_grow_per_step (5), floor((F - high) / pages_per_expert))

Between low and high nothing happens: evicting one expert at F = 1 leaves F = 4, growing at F = 12
leaves F = 9, so F oscillating inside the band never flips between evicting and growing (hysteresis).

Which experts: each layer nominates its lowest-ranked resident expert (evict) or its highest-ranked
non-resident one (grow); the adjuster takes the globally least (most) popular nominee, and the layer
nominates its next one, so one layer may give several experts in one step. Layers with
`offload_limit` experts already offloaded (counting this step's evictions) do not take part in evicting.
With each layer's resident set a prefix of its ranking, the plan keeps it a prefix. Ties between
equally popular nominees (uniform routing) go to the layer with the most residents (evict) or the
fewest (grow), then the lowest layer index, so offloading spreads evenly over layers.

`Adjuster` is the interface the engine and simulator call (`plan(state) -> AdjustPlan`); `PaperAdjuster`
implements the rules above; `CostAdjuster` (cost_adjuster.py, issue 8) also reads the batch fields of `AdjusterState`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

Expert = tuple[int, int]  # (moe layer, expert id)


def shortfall_mid_pages(missing_small_pages: int, smalls_per_mid: int) -> int:
    """Mid pages that hold `missing_small_pages` small pages: ceil(missing / smalls_per_mid)."""
    if missing_small_pages < 0 or smalls_per_mid < 1:
        raise ValueError(f"need missing >= 0 and smalls_per_mid >= 1, got {missing_small_pages}, {smalls_per_mid}")
    return -(-missing_small_pages // smalls_per_mid)


@dataclass(frozen=True)
class AdjusterConfig:
    pages_per_expert: int = 3  # W1, W3, W2: one mid page each
    evict_margin: int = 1  # short by R pages -> free R + margin pages (one page of slack for the next step)
    low_free_mid: int = 2  # not short but fewer free mid pages than this -> evict low_free_evict
    low_free_evict: int = 1
    high_free_mid: int = 9  # more free mid pages than this -> grow
    max_grow_per_step: int = 5  # so grows never saturate the copy stream

    def __post_init__(self) -> None:
        if self.pages_per_expert < 1 or self.max_grow_per_step < 0 or self.low_free_evict < 0:
            raise ValueError("pages_per_expert must be >= 1; max_grow_per_step, low_free_evict >= 0")
        if self.evict_margin < 0 or self.low_free_mid < 0:
            raise ValueError("evict_margin and low_free_mid must be >= 0")
        if self.high_free_mid < self.low_free_mid + self.pages_per_expert:
            # else one grow could drop F below low and the next step would evict it again (flapping)
            raise ValueError(f"high_free_mid ({self.high_free_mid}) must be >= low_free_mid + pages_per_expert "
                             f"({self.low_free_mid + self.pages_per_expert})")

    def num_evict(self, shortfall: int, free: int) -> int:
        if shortfall > 0:
            return -(-(shortfall + self.evict_margin) // self.pages_per_expert)
        return self.low_free_evict if free < self.low_free_mid else 0

    def num_grow(self, shortfall: int, free: int) -> int:
        if shortfall > 0 or free <= self.high_free_mid:
            return 0
        return min(self.max_grow_per_step, (free - self.high_free_mid) // self.pages_per_expert)


@dataclass(frozen=True)
class AdjustPlan:
    evict: list[Expert] = field(default_factory=list)
    grow: list[Expert] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.evict and not self.grow


@dataclass(frozen=True)
class AdjusterState:
    """What an adjuster sees after schedule(). Page counts are mid pages of the expert kind."""

    shortfall_mid_pages: int  # R
    free_mid_pages: int  # F
    resident: Sequence[frozenset[int] | set[int]]  # per MoE layer, resident expert ids
    probabilities: np.ndarray  # [L, E] routing probabilities (the current estimate)
    rankings: np.ndarray  # [L, E] expert ids, most popular first (the committed order)
    offload_limit: int | Sequence[int]  # per layer (or one for all): most experts it may have offloaded
    # The step just scheduled (for cost-aware adjusters): tokens in it and sequences decoding.
    num_batched_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_stalled: int = 0  # running requests sitting out this step until evictions free their pages
    max_num_seqs: int | None = None  # the scheduler's cap on running requests (None: none)
    kv_mid_pages: float = 0.0  # KV pages in use, in mid-page units (KV pages / smalls per mid)

    def limit(self, layer: int) -> int:
        lim = self.offload_limit
        return lim if isinstance(lim, int) else lim[layer]


def reclaimable_experts(offloaded: Sequence[int], offload_limit: int | Sequence[int], bound: int | None) -> int:
    """Experts that may still be evicted: per layer up to its limit (`offloaded[l]` are out now), and in all at
    most `bound` offloaded (an adjuster's `max_offloaded()`; None: no such bound). The scheduler lets a running
    request short of pages wait for their pages instead of preempting it (engine and simulator alike)."""
    limits = [offload_limit] * len(offloaded) if isinstance(offload_limit, int) else offload_limit
    n = sum(max(0, lim - k) for lim, k in zip(limits, offloaded, strict=True))
    return n if bound is None else min(n, max(0, bound - sum(offloaded)))


class Adjuster(Protocol):
    def plan(self, state: AdjusterState) -> AdjustPlan: ...

    def max_offloaded(self) -> int | None:
        """Most experts (all layers) the adjuster would have offloaded now: running requests short of pages
        wait for evictions only up to it, and are preempted beyond. None: only the per-layer limits bound it."""
        ...


class PaperAdjuster:
    """The paper's threshold rules (module docstring)."""

    def __init__(self, config: AdjusterConfig | None = None) -> None:
        self.config = config or AdjusterConfig()

    def max_offloaded(self) -> int | None:
        return None  # the paper evicts whenever the scheduler is short, up to the per-layer limits

    def plan(self, state: AdjusterState) -> AdjustPlan:
        return decide(state, self.config)


def decide(state: AdjusterState, config: AdjusterConfig) -> AdjustPlan:
    R, F = state.shortfall_mid_pages, state.free_mid_pages
    n_evict, n_grow = config.num_evict(R, F), config.num_grow(R, F)
    if n_evict:
        return AdjustPlan(evict=pick_evictions(state, n_evict))
    if n_grow:
        return AdjustPlan(grow=pick_grows(state, n_grow))
    return AdjustPlan()


def pick_evictions(state: AdjusterState, n: int) -> list[Expert]:
    """Up to n (layer, expert): globally least popular lowest-ranked residents of layers under their limit."""
    E = state.rankings.shape[1]
    resident = [set(r) for r in state.resident]
    # per layer: its residents from the least popular up (a prefix's tail first)
    order = [[int(e) for e in state.rankings[layer][::-1] if e in resident[layer]] for layer in range(len(resident))]
    heap: list[tuple[float, int, int, int]] = []

    def nominate(layer: int) -> None:
        if order[layer] and E - len(resident[layer]) < state.limit(layer):
            e = order[layer][0]
            heapq.heappush(heap, (float(state.probabilities[layer, e]), -len(resident[layer]), layer, e))

    for layer in range(len(resident)):
        nominate(layer)
    out: list[Expert] = []
    while heap and len(out) < n:
        _, _, layer, e = heapq.heappop(heap)
        out.append((layer, e))
        order[layer].pop(0)
        resident[layer].discard(e)
        nominate(layer)
    return out


def pick_grows(state: AdjusterState, n: int) -> list[Expert]:
    """Up to n (layer, expert): the globally most popular highest-ranked non-resident experts."""
    resident = [set(r) for r in state.resident]
    order = [[int(e) for e in state.rankings[layer] if e not in resident[layer]] for layer in range(len(resident))]
    heap: list[tuple[float, int, int, int]] = []

    def nominate(layer: int) -> None:
        if order[layer]:
            e = order[layer][0]
            heapq.heappush(heap, (-float(state.probabilities[layer, e]), len(resident[layer]), layer, e))

    for layer in range(len(resident)):
        nominate(layer)
    out: list[Expert] = []
    while heap and len(out) < n:
        _, _, layer, e = heapq.heappop(heap)
        out.append((layer, e))
        order[layer].pop(0)
        resident[layer].add(e)
        nominate(layer)
    return out
