"""Which routed experts hold pool pages, and the moves in flight: the bookkeeping, without tensors.

Both the engine (through `ExpertCache`, which writes the device tables beside it) and the capacity simulator
keep their residency here, so the two cannot drift. Every resident expert owns three mid pages of kind
`EXPERT` (W1, W3, W2), allocated with owner `EXPERT_OWNER`.

One move, in step order:

    step N:   plan ──► reserve_grow: 3 pages taken now; the copy runs; NOT in the tables
                   └─► begin_eviction: pages deferred-freed; the expert STAYS in the tables
              forward pass N (reads an evicted expert if routed; never a growing one)
              finish_evictions: the evicted leave the tables; allocator.complete_forward() frees their pages
    step N+1: commit_grows (after the copies completed): the grown enter the tables

Invariants (`check`):
  * `in_tables[l, e]` <=> (l, e) holds committed pages: a pass may read it;
  * an evicting expert is in the tables until `finish_evictions`; a growing one holds pages, not in the tables;
  * `planned_resident()` = in the tables - evicting + growing: what an adjuster plans against.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from rimuru.memory.allocator import PageAllocator

EXPERT = "expert"  # the mid page kind of expert matrices
EXPERT_OWNER = -1  # allocator owner id of every resident expert's pages (requests use ids >= 0)
BUFFER_OWNER = -2  # allocator owner id of the load buffers' pages (experts/loader.py)
PAGES_PER_EXPERT = 3  # W1 (gate), W3 (up), W2 (down): one mid page each

Expert = tuple[int, int]  # (MoE layer, expert id)
ExpertPages = tuple[int, int, int]  # mid page ids of W1, W3, W2


class PoolTooSmallError(RuntimeError):
    pass


def load_buffer_pages(slots: int) -> int:
    """Mid pages of the two load buffers of `slots` expert slots each (experts/loader.py)."""
    return 2 * PAGES_PER_EXPERT * slots


def lazy_load_buffers(num_moe_layers: int) -> bool:
    """Whether elastic mode's load buffers follow the offload (as many slots as the most offloaded experts of one
    layer, none while every expert is resident) rather than being held for good at the limit. Worth it where a
    slot, 2 experts' pages, is at most a quarter of what one offloaded expert per layer frees: >= 8 MoE layers."""
    return 4 * 2 <= num_moe_layers


def check_ranking(ranking: Sequence[Sequence[int]] | None, num_layers: int, num_experts: int) -> list[list[int]]:
    """Per layer: every expert id exactly once, most popular first (uniform order 0..E-1 when None)."""
    if ranking is None:
        return [list(range(num_experts)) for _ in range(num_layers)]
    rows = [[int(e) for e in row] for row in ranking]
    if len(rows) != num_layers:
        raise ValueError(f"the expert ranking has {len(rows)} layers; the model has {num_layers} MoE layers")
    for layer, row in enumerate(rows):
        if sorted(row) != list(range(num_experts)):
            raise ValueError(f"the expert ranking of MoE layer {layer} must order each of the {num_experts} experts "
                             f"exactly once, got {row}")
    return rows


class ExpertResidency:
    def __init__(self, allocator: PageAllocator, num_layers: int, num_experts: int,
                 ranking: Sequence[Sequence[int]] | None = None) -> None:
        self.allocator = allocator
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.ranking = check_ranking(ranking, num_layers, num_experts)  # the start-up order, most popular first
        self.in_tables = np.zeros((num_layers, num_experts), dtype=bool)  # [L, E] readable by a pass
        self._pages: dict[Expert, ExpertPages] = {}  # committed experts (exactly the in_tables ones)
        self._evicting: list[Expert] = []  # still in the tables until the forward pass ends
        self._growing: dict[Expert, ExpertPages] = {}  # pages reserved, copy in flight
        self.version = 0  # changes with every move (callers cache what they derive from the residency)
        self._planned: tuple[int, list[set[int]]] | None = None  # planned_resident at `version`

    # ------------------------------------------------------------------ reading
    @property
    def total_experts(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def num_resident(self) -> int:
        return len(self._pages)

    @property
    def num_pages(self) -> int:
        """Expert pages held: committed experts (evicting ones until they leave) and growing ones."""
        return PAGES_PER_EXPERT * (len(self._pages) + len(self._growing))

    @property
    def growing(self) -> list[Expert]:
        return list(self._growing)

    def is_growing(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._growing

    def all_resident(self) -> bool:
        """Every expert is in the tables: a pass reads no host memory. O(1): asked several times per step."""
        return len(self._pages) == self.total_experts

    def is_resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._pages

    def pages_of(self, layer: int, expert: int) -> ExpertPages | None:
        return self._pages.get((layer, expert))

    def resident_items(self) -> Iterable[tuple[Expert, ExpertPages]]:
        return self._pages.items()

    def resident_per_layer(self) -> list[int]:
        return self.in_tables.sum(axis=1).tolist()

    def planned_resident(self) -> list[set[int]]:
        """Per layer, the experts resident once the moves in flight are done: in the tables - evicting + growing.
        Read-only for callers: the same sets are returned until the next move (asked several times per step; at
        Qwen1.5-MoE shapes building them takes ~0.2 ms of host time)."""
        if self._planned is not None and self._planned[0] == self.version:
            return self._planned[1]
        out: list[set[int]] = [set(np.flatnonzero(row).tolist()) for row in self.in_tables]
        for layer, e in self._evicting:
            out[layer].discard(e)
        for layer, e in self._growing:
            out[layer].add(e)
        self._planned = (self.version, out)
        return out

    def planned_offloaded(self) -> list[int]:
        """Per layer, the experts offloaded once the moves in flight are done."""
        return [self.num_experts - len(r) for r in self.planned_resident()]

    # ------------------------------------------------------------------ start-up
    def place(self, experts: Sequence[Expert]) -> list[ExpertPages]:
        """Gives each expert three pages and puts it in the tables at once (start-up: no copy in flight).
        Raises PoolTooSmallError, nothing taken, when the pool cannot hold them all."""
        n = PAGES_PER_EXPERT * len(experts)
        pages = self.allocator.allocate_mid(EXPERT, n, owner=EXPERT_OWNER)
        if pages is None:
            have = self.allocator.mid_capacity(EXPERT)
            raise PoolTooSmallError(f"{len(experts)} experts need {n} expert pages; the pool holds {have} "
                                    f"({have // PAGES_PER_EXPERT} experts)")
        rows: list[ExpertPages] = []
        for i, (layer, e) in enumerate(experts):
            if (layer, e) in self._pages:
                raise ValueError(f"expert {e} of MoE layer {layer} is already resident")
            row = (pages[3 * i], pages[3 * i + 1], pages[3 * i + 2])
            self._pages[(layer, e)] = row
            self.in_tables[layer, e] = True
            rows.append(row)
        self.version += 1
        return rows

    def prefix(self, per_layer: int) -> list[Expert]:
        """The first `per_layer` experts of every layer's ranking."""
        if not 0 <= per_layer <= self.num_experts:
            raise ValueError(f"resident experts per layer must be in [0, {self.num_experts}], got {per_layer}")
        return [(layer, e) for layer in range(self.num_layers) for e in self.ranking[layer][:per_layer]]

    # ------------------------------------------------------------------ moves
    def begin_eviction(self, layer: int, expert: int) -> None:
        """The expert leaves after the forward pass now being prepared; its pages are deferred-freed with it."""
        pages = self._pages.get((layer, expert))
        if pages is None:
            raise KeyError(f"expert {expert} of MoE layer {layer} is not resident: it cannot be evicted")
        if (layer, expert) in self._evicting:
            raise ValueError(f"expert {expert} of MoE layer {layer} is already being evicted")
        self.allocator.defer_free(EXPERT, list(pages))
        self._evicting.append((layer, expert))
        self.version += 1

    def finish_evictions(self) -> list[Expert]:
        """After the forward pass that could read them: the evicted experts leave the tables."""
        done, self._evicting = self._evicting, []
        for layer, expert in done:
            del self._pages[(layer, expert)]
            self.in_tables[layer, expert] = False
        self.version += bool(done)
        return done

    def reserve_grow(self, layer: int, expert: int) -> ExpertPages | None:
        """Three pages for an expert that comes back (its copy goes into them); None when the pool has none."""
        if (layer, expert) in self._pages or (layer, expert) in self._growing:
            raise ValueError(f"expert {expert} of MoE layer {layer} is already resident or growing")
        pages = self.allocator.allocate_mid(EXPERT, PAGES_PER_EXPERT, owner=EXPERT_OWNER)
        if pages is None:
            return None
        self._growing[(layer, expert)] = (pages[0], pages[1], pages[2])
        self.version += 1
        return self._growing[(layer, expert)]

    def commit_grows(self, experts: list[Expert] | None = None) -> list[tuple[Expert, ExpertPages]]:
        """Growing experts whose copies have completed (the caller made sure) enter the tables: `experts`, or every
        growing one (None)."""
        if experts is None:
            done, self._growing = list(self._growing.items()), {}
        else:
            done = [(e, self._growing.pop(e)) for e in experts]
        for (layer, expert), pages in done:
            self._pages[(layer, expert)] = pages
            self.in_tables[layer, expert] = True
        self.version += bool(done)
        return done

    def check(self) -> None:
        """The invariants of the module docstring (tests call it)."""
        assert int(self.in_tables.sum()) == len(self._pages), "in_tables and the committed pages disagree"
        for layer, e in self._pages:
            assert self.in_tables[layer, e], f"expert {(layer, e)} holds pages but is not in the tables"
        for ex in self._evicting:
            assert ex in self._pages, f"evicting expert {ex} is not in the tables"
        for ex in self._growing:
            assert ex not in self._pages, f"growing expert {ex} is already in the tables"
