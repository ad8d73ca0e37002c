"""The adjuster: after each schedule(), how many experts leave the pool (evict) or come back (grow), and which.

The paper's rules (docs/design.md, Adjusters; numbers are `AdjusterConfig` defaults, never literals here), with
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
implements the rules above; `CostAdjuster` (cost_adjuster.py) also reads the batch fields of `AdjusterState`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol

import numpy as np

from rimuru.experts.residency import PAGES_PER_EXPERT

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
    oldest_wait_s: float = 0.0  # seconds the head of the waiting queue has waited (0: no queue)
    tpot_p99_s: float | None = None  # measured TPOT p99 of recently finished requests (None: too few yet)
    tpot_observed: int = 0  # finished requests observed so far (a new batch of them updates a TPOT correction)
    # pages requests hold, in mid-page units: KV pages / smalls per mid, plus hybrid models' state pages by bytes
    kv_mid_pages: float = 0.0
    # The load buffers (experts/elastic_core.py): mid pages per slot of both buffers when their slots follow the
    # offload (0: held for good at the limit, so an offload costs no buffer pages), and the slots they hold now.
    buffer_slot_pages: int = 0
    buffer_slots: int = 0

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

    def grow_reserve(self) -> int:
        """Free mid pages the scheduler keeps from new admissions so that the adjuster's grows can take them."""
        ...

    def offloaded_at_least(self, n: int) -> None:
        """`n` experts are offloaded in all, more than the last plan moved (the first eviction also paid for the
        load buffers' pages, `with_buffer_pages`): a stall bound covers them."""
        ...

    def set_piecewise_overhead(self, seconds: float) -> None:
        """What a pass with any expert offloaded costs beyond one with every expert resident (measured)."""
        ...

    def stats(self) -> dict[str, float]:
        """The adjuster's view for /metrics (empty where it has none)."""
        ...


class PaperAdjuster:
    """The paper's threshold rules (module docstring)."""

    def __init__(self, config: AdjusterConfig | None = None) -> None:
        self.config = config or AdjusterConfig()

    def max_offloaded(self) -> int | None:
        return None  # the paper evicts whenever the scheduler is short, up to the per-layer limits

    def grow_reserve(self) -> int:
        return 0  # the paper grows only from pages nobody waits for

    def offloaded_at_least(self, n: int) -> None:
        return None  # no stall bound beyond the per-layer limits

    def set_piecewise_overhead(self, seconds: float) -> None:
        return None  # the paper's rules do not weigh time

    def stats(self) -> dict[str, float]:
        return {}

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


def _resident_mask(state: AdjusterState, L: int, E: int) -> tuple[np.ndarray, np.ndarray]:
    """[L * E] bool, flat: expert e resident in layer l at l * E + e; and per layer its number of residents."""
    counts = np.fromiter((len(r) for r in state.resident), dtype=np.int64, count=L)
    if E <= 256:  # ids fit a byte: bytes() walks each set in C, faster than fromiter
        ids = np.frombuffer(b"".join(map(bytes, state.resident)), dtype=np.uint8).astype(np.int64)
    else:
        ids = np.fromiter(chain.from_iterable(state.resident), dtype=np.int64, count=int(counts.sum()))
    mask = np.zeros(L * E, dtype=bool)
    mask[np.repeat(np.arange(L, dtype=np.int64) * E, counts) + ids] = True
    return mask, counts


def _sequences(state: AdjusterState, L: int, E: int, least_first: bool) -> tuple[np.ndarray, ...]:
    """Per layer its experts in committed ranking order (least popular first when asked), as flat (l * E + e)
    [L, E]; the flat residency mask; the residents per layer; the probabilities, flat, as float64."""
    rankings = state.rankings[:L, ::-1] if least_first else state.rankings[:L]
    seq = rankings.astype(np.int64) + np.arange(0, L * E, E, dtype=np.int64)[:, None]
    mask, residents = _resident_mask(state, L, E)
    prob = np.asarray(state.probabilities[:L], dtype=np.float64).ravel()
    return seq, mask, residents, prob


def _merge(keep: np.ndarray, seq: np.ndarray, first: np.ndarray, second: np.ndarray, n: int) -> np.ndarray:
    """The flat ids (l * E + e) of the first n items of a k-way heap merge of the layers' sequences (each layer
    nominating its next item).

    `keep` [L, E] marks each layer's items, `seq` [L, E] holds their flat ids (l * E + e) in sequence order
    (row-major positions of `keep` are the sequence order). An item's heap key is (first, second, layer, expert):
    `first` (float) indexed by flat id, `second` (int) [L, E] aligned to `seq`, with 0 <= second + E < 3E.
    The heap pops its smallest head, so a layer's items leave in blocks, each led by a prefix maximum of the
    layer's keys (a record) and holding the smaller items behind it; blocks leave in the order of their records.
    Keys are unique ((layer, expert)), so ranks of the full tuples order them exactly, and the merge is a stable
    sort by each item's prefix-maximum rank within its layer."""
    L, E = seq.shape
    at = np.flatnonzero(keep)  # row-major: grouped by layer, each in sequence order
    m = len(at)
    if n <= 0 or m == 0:
        return np.zeros(0, dtype=np.int64)
    flat = seq.ravel()[at]
    layer = at // E
    # (second, layer, expert) in one exact integer (a float64 mantissa holds it); complex numbers sort
    # lexicographically by (real, imaginary): one sort by the whole key
    tail = (second.ravel()[at] + E) * (L * E) + flat
    rank = np.empty(m, dtype=np.int64)
    rank[np.argsort(first[flat] + 1j * tail.astype(np.float64))] = np.arange(m, dtype=np.int64)
    # prefix max per layer in one pass: shift layer l's ranks above every earlier layer's
    shift = layer * m
    record = np.maximum.accumulate(rank + shift) - shift
    return flat[np.argsort(record, kind="stable")[:n]]


def as_experts(flat: np.ndarray, num_experts: int) -> list[Expert]:
    """Flat ids (l * E + e) -> [(layer, expert)] as Python ints."""
    layer, expert = np.divmod(np.asarray(flat, dtype=np.int64), num_experts)
    return list(zip(layer.tolist(), expert.tolist(), strict=True))


def pick_evictions(state: AdjusterState, n: int) -> list[Expert]:
    """Up to n (layer, expert): globally least popular lowest-ranked residents of layers under their limit.
    (`eviction_order`: the same as flat ids.)"""
    return as_experts(eviction_order(state, n), state.rankings.shape[1])


def most_offloaded_after(base: np.ndarray, flat: np.ndarray, num_experts: int) -> np.ndarray:
    """[len(flat) + 1]: the most offloaded experts of any layer once the first k experts of `flat` (flat ids
    l * E + e, each offloaded once) are offloaded on top of `base` [L] (offloaded per layer now), k = 0..len(flat).
    The load buffers need that many slots (experts/loader.py)."""
    base = np.asarray(base, dtype=np.int64)
    out = np.full(len(flat) + 1, base.max(initial=0), dtype=np.int64)
    if len(flat) == 0:
        return out
    layer = np.asarray(flat, dtype=np.int64) // num_experts
    by_layer = np.argsort(layer, kind="stable")  # each layer's items in their order
    sorted_layer = layer[by_layer]
    starts = np.flatnonzero(np.r_[True, sorted_layer[1:] != sorted_layer[:-1]])
    sizes = np.diff(np.r_[starts, len(sorted_layer)])
    rank = np.empty(len(flat), dtype=np.int64)
    rank[by_layer] = np.arange(len(flat)) - np.repeat(starts, sizes)  # position within its layer's items
    out[1:] = np.maximum(out[0], np.maximum.accumulate(base[layer] + rank + 1))
    return out


def buffer_pages_for(slots: np.ndarray | int, state: AdjusterState) -> np.ndarray:
    """Mid pages the load buffers hold for an offload needing `slots` slots: they grow to it and keep their slots
    until every expert is home (0 slots: released). Held for good (`buffer_slot_pages` 0): nothing."""
    slots = np.asarray(slots, dtype=np.int64)
    return state.buffer_slot_pages * np.where(slots > 0, np.maximum(slots, state.buffer_slots), 0)


def with_buffer_room(plan: AdjustPlan, state: AdjusterState, adjuster: Adjuster) -> AdjustPlan:
    """Where the load buffers' slots follow the offload (experts/elastic_core.py), a plan whose evictions give
    some layer more offloaded experts than the buffers have slots must also free the pages of the new slots. It
    evicts, the least popular first (`pick_evictions`), until free pages + the evicted experts' cover them,
    dropping any grows, or, where the limits do not allow that many, nothing. The adjuster's stall bound is
    raised to what is then out (`offloaded_at_least`: its own plan moved fewer). The engine and the simulator
    both apply it (through ElasticCore)."""
    if not plan.evict or state.buffer_slot_pages <= 0:
        return plan
    E = state.rankings.shape[1]
    base = np.fromiter((E - len(r) for r in state.resident), dtype=np.int64, count=len(state.resident))
    held = int(buffer_pages_for(state.buffer_slots, state))

    def room(flat: np.ndarray) -> np.ndarray:  # [len(flat) + 1]: pages short after offloading each prefix of flat
        extra = buffer_pages_for(most_offloaded_after(base, flat, E), state) - held
        return extra - state.free_mid_pages - PAGES_PER_EXPERT * np.arange(len(flat) + 1)

    planned = np.asarray([layer * E + e for layer, e in plan.evict], dtype=np.int64)
    if room(planned)[-1] <= 0:
        return plan
    # both adjusters evict a prefix of the eviction order: extend it to the shortest prefix that pays
    order = eviction_order(state, sum(state.limit(layer) for layer in range(len(state.resident))))
    ok = np.flatnonzero(room(order)[len(plan.evict):] <= 0)
    if len(ok) == 0:
        return AdjustPlan()  # the limits allow no split that pays for its buffers
    n = len(plan.evict) + int(ok[0])
    adjuster.offloaded_at_least(int(base.sum()) + n)
    return AdjustPlan(evict=as_experts(order[:n], E))


def pick_grows(state: AdjusterState, n: int) -> list[Expert]:
    """Up to n (layer, expert): the globally most popular highest-ranked non-resident experts.
    (`grow_order`: the same as flat ids.)"""
    return as_experts(grow_order(state, n), state.rankings.shape[1])


def eviction_order(state: AdjusterState, n: int) -> np.ndarray:
    """Up to n flat ids (l * E + e): globally least popular lowest-ranked residents of layers under their limit.

    The order of a heap merge: each layer nominates its residents from the least popular up in the committed
    ranking, keyed (probability, -residents now, layer, expert), and stops once its offloaded count reaches its
    limit; the least key goes next (`_merge` computes that order at once)."""
    L = len(state.resident)
    E = state.rankings.shape[1]
    if n <= 0 or L == 0:
        return np.zeros(0, dtype=np.int64)
    seq, mask, residents, prob = _sequences(state, L, E, least_first=True)
    keep = mask[seq]
    j = np.cumsum(keep, axis=1) - 1  # position in the layer's sequence (where keep)
    limits = np.asarray(state.offload_limit, dtype=np.int64)
    limits = np.full(L, limits) if limits.ndim == 0 else limits[:L]
    room = np.minimum(residents, limits - (E - residents))  # evictions before the layer reaches its limit
    keep &= j < room[:, None]
    return _merge(keep, seq, prob, j - residents[:, None], n)


def grow_order(state: AdjusterState, n: int) -> np.ndarray:
    """Up to n flat ids (l * E + e): the globally most popular highest-ranked non-resident experts.

    The order of a heap merge: each layer nominates its non-residents in committed ranking order, keyed
    (-probability, residents now, layer, expert); the least key goes next (`_merge`)."""
    L = len(state.resident)
    E = state.rankings.shape[1]
    if n <= 0 or L == 0:
        return np.zeros(0, dtype=np.int64)
    seq, mask, residents, prob = _sequences(state, L, E, least_first=False)
    keep = ~mask[seq]
    j = np.cumsum(keep, axis=1) - 1
    return _merge(keep, seq, -prob, j + residents[:, None], n)
