"""Which experts hold pool pages in a simulation: the expert cache's page bookkeeping without tensors.

Uses the real allocator with the expert cache's page kind and owner, and the engine's ordering rules:

    decide ──► grow: 3 pages reserved now ─────────► copy during the step ─► resident after the step
           └─► evict: pages deferred (still readable) ─────────────────────► released after the step

and the elastic engine's lazy load buffers (experts/elastic.py): pages taken before the first pass with an expert
out, given back after a pass with every expert home.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from rimuru.experts.adjuster import Expert
from rimuru.experts.loader import BUFFER_OWNER
from rimuru.memory.allocator import PageAllocator

EXPERT = "expert"  # the expert cache's mid page kind and owner (rimuru/experts/cache.py)
EXPERT_OWNER = -1
PAGES_PER_EXPERT = 3


class SimResidency:
    def __init__(self, allocator: PageAllocator, num_layers: int, num_experts: int) -> None:
        self.allocator = allocator
        self.resident = np.zeros((num_layers, num_experts), dtype=bool)  # readable by this step's forward
        self.pages: dict[Expert, list[int]] = {}
        self._arriving: list[Expert] = []
        self._leaving: list[Expert] = []
        self.buffer_pages: list[int] = []  # the load buffers' pages while they hold any
        self.evictions = 0
        self.grows = 0

    @property
    def num_pages(self) -> int:
        """Expert pages taken: resident, arriving and leaving ones (until released), and the load buffers'."""
        return PAGES_PER_EXPERT * len(self.pages) + len(self.buffer_pages)

    def all_resident(self) -> bool:
        return bool(self.resident.all()) and not self._arriving

    def attach_buffers(self, count: int) -> bool:
        """The load buffers take `count` pages; False, nothing taken, if the pool has not that many free."""
        pages = self.allocator.allocate_mid(EXPERT, count, owner=BUFFER_OWNER)
        if pages is None:
            return False
        self.buffer_pages = pages
        return True

    def release_buffers(self) -> None:
        """Every expert home after a pass: the buffers' pages go (nothing reads them in the simulation)."""
        self.allocator.free_mid(EXPERT, self.buffer_pages)
        self.buffer_pages = []

    def resident_sets(self) -> list[frozenset[int]]:
        return [frozenset(np.flatnonzero(row).tolist()) for row in self.resident]

    def load(self, experts: Iterable[Expert]) -> bool:
        """Start-up: make experts resident at once (no copy is simulated); False, nothing taken, if they don't fit."""
        experts = list(experts)
        pages = self.allocator.allocate_mid(EXPERT, PAGES_PER_EXPERT * len(experts), owner=EXPERT_OWNER)
        if pages is None:
            return False
        for i, (layer, e) in enumerate(experts):
            self.pages[(layer, e)] = pages[PAGES_PER_EXPERT * i: PAGES_PER_EXPERT * (i + 1)]
            self.resident[layer, e] = True
        return True

    def grow(self, experts: Iterable[Expert]) -> list[Expert]:
        """Reserves pages for each expert (in order, while they fit); they become resident after the step."""
        done = []
        for layer, e in experts:
            if (layer, e) in self.pages:
                raise ValueError(f"expert {e} of layer {layer} already holds pages")
            pages = self.allocator.allocate_mid(EXPERT, PAGES_PER_EXPERT, owner=EXPERT_OWNER)
            if pages is None:
                break
            self.pages[(layer, e)] = pages
            self._arriving.append((layer, e))
            done.append((layer, e))
        self.grows += len(done)
        return done

    def evict(self, experts: Iterable[Expert]) -> None:
        """The experts stay readable by this step's forward pass; their pages are released after it."""
        for layer, e in experts:
            if not self.resident[layer, e]:
                raise ValueError(f"expert {e} of layer {layer} is not resident")
            self.allocator.defer_free(EXPERT, self.pages[(layer, e)])
            self._leaving.append((layer, e))
            self.evictions += 1

    def complete_forward(self) -> None:
        for layer, e in self._leaving:
            self.resident[layer, e] = False
            del self.pages[(layer, e)]
        for layer, e in self._arriving:
            self.resident[layer, e] = True
        self._leaving, self._arriving = [], []
        self.allocator.complete_forward()
