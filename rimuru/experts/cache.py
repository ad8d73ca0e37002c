"""Which routed experts are resident in pool pages, and the device tables that say where.

Every resident expert owns three mid pages of kind "expert": W1 (gate, [f, d]), W3 (up, [f, d]) and
W2 (down, [d, f]). The table of MoE layer l is a device tensor [E, 3] int32 of those page ids, -1
when the expert is not resident; the fused MoE kernel reads weights through it. Tables are one
[L_moe, E, 3] tensor updated in place, so CUDA graphs captured over them stay valid; `host_tables`
is the same numbers on the host, so deciding what to load never reads the device.

Each layer has a popularity ranking (expert ids, most popular first; uniform order 0..E-1 when none is
given). The resident set of a layer is always a prefix of its ranking (DESIGN.md §4).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rimuru.experts.host_store import HostExpertStore
from rimuru.memory.allocator import PageAllocator
from rimuru.model_spec import ModelSpec

EXPERT = "expert"
EXPERT_OWNER = -1  # allocator owner id of every expert page (requests use ids >= 0)


class PoolTooSmallError(RuntimeError):
    pass


def resolve_resident_count(resident_experts: float | None, num_experts: int) -> int:
    """`fixed` mode: experts kept resident per layer, from a count (>= 1, whole) or a fraction (< 1,
    rounded down, at least 1)."""
    if resident_experts is None:
        raise ValueError("offload_mode='fixed' needs resident_experts: a count per layer (>= 1) or a fraction (< 1)")
    r = float(resident_experts)
    if r <= 0:
        raise ValueError(f"resident_experts must be positive, got {resident_experts}")
    if r < 1:
        return max(1, int(r * num_experts))
    if r != int(r):
        raise ValueError(f"resident_experts={resident_experts} is neither a whole count (>= 1) nor a fraction (< 1)")
    if int(r) > num_experts:
        raise ValueError(f"resident_experts={int(r)} is more than the {num_experts} experts of a layer")
    return int(r)


def resolve_offload_limit(expert_offload_limit: int | None, num_experts: int, resident: int) -> int:
    """The most experts a layer may have offloaded (= load-buffer slots); default E - resident."""
    offloaded = num_experts - resident
    if expert_offload_limit is None:
        return offloaded
    if expert_offload_limit < offloaded:
        raise ValueError(f"expert_offload_limit={expert_offload_limit} is below the {offloaded} experts per layer "
                         f"that resident_experts={resident} of {num_experts} leaves offloaded; raise the limit or "
                         f"resident_experts")
    if expert_offload_limit > num_experts:
        raise ValueError(f"expert_offload_limit={expert_offload_limit} is more than the {num_experts} experts "
                         "of a layer")
    return expert_offload_limit


class ExpertCache:
    def __init__(self, spec: ModelSpec, allocator: PageAllocator, expert_view: torch.Tensor,
                 device: torch.device, ranking: Sequence[Sequence[int]] | None = None) -> None:
        self.spec = spec
        self.allocator = allocator
        self.expert_view = expert_view  # [n_mid, f*d]
        self.num_layers = spec.num_moe_layers
        self.num_experts = spec.num_experts
        self.tables = torch.full((self.num_layers, self.num_experts, 3), -1, dtype=torch.int32, device=device)
        self.host_tables = torch.full((self.num_layers, self.num_experts, 3), -1, dtype=torch.int32)  # mirror
        self._pages: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.ranking = self._check_ranking(ranking)  # per layer: expert ids, most popular first
        self._evicting: list[tuple[int, int]] = []  # still in the tables until the forward pass ends
        self._growing: dict[tuple[int, int], tuple[int, int, int]] = {}  # pages reserved, copy in flight

    def _check_ranking(self, ranking: Sequence[Sequence[int]] | None) -> list[list[int]]:
        L, E = self.num_layers, self.num_experts
        if ranking is None:
            return [list(range(E)) for _ in range(L)]
        rows = [[int(e) for e in row] for row in ranking]
        if len(rows) != L:
            raise ValueError(f"the expert ranking has {len(rows)} layers; the model has {L} MoE layers")
        for layer, row in enumerate(rows):
            if sorted(row) != list(range(E)):
                raise ValueError(f"the expert ranking of MoE layer {layer} must order each of the {E} experts "
                                 f"exactly once, got {row}")
        return rows

    @property
    def num_resident(self) -> int:
        return len(self._pages)

    @property
    def total_experts(self) -> int:
        return self.num_layers * self.num_experts

    def all_resident(self) -> bool:
        """Every expert is in the tables now (`_pages` holds exactly the rows that are not -1): a pass over them
        reads no host memory. O(1): asked once per step."""
        return len(self._pages) == self.total_experts

    def resident_per_layer(self) -> list[int]:
        counts = [0] * self.num_layers
        for layer, _ in self._pages:
            counts[layer] += 1
        return counts

    def make_resident(self, experts: list[tuple[int, int]]) -> None:
        """Gives each (moe_layer, expert) three expert pages and points its table row at them.

        Raises PoolTooSmallError (nothing taken) when the pool can't hold them all."""
        n = 3 * len(experts)
        pages = self.allocator.allocate_mid(EXPERT, n, owner=EXPERT_OWNER)
        if pages is None:
            have = self.allocator.mid_capacity(EXPERT)
            raise PoolTooSmallError(
                f"{len(experts)} experts need {n} expert pages; the pool holds {have} "
                f"({have // 3} experts)")
        rows = torch.tensor(pages, dtype=torch.int32).view(-1, 3)
        idx = torch.tensor(experts, dtype=torch.int64).view(-1, 2)
        self.tables[idx[:, 0], idx[:, 1]] = rows.to(self.tables.device)
        self.host_tables[idx[:, 0], idx[:, 1]] = rows
        for (layer, expert), row in zip(experts, rows.tolist(), strict=True):
            self._pages[(layer, expert)] = tuple(row)  # type: ignore[assignment]

    def make_all_resident(self) -> None:
        self.make_resident([(layer, e) for layer in range(self.num_layers) for e in range(self.num_experts)])

    def make_prefix_resident(self, per_layer: int) -> None:
        """`fixed` mode: the first `per_layer` experts of each layer's ranking become resident."""
        if not 0 <= per_layer <= self.num_experts:
            raise ValueError(f"resident experts per layer must be in [0, {self.num_experts}], got {per_layer}")
        self.make_resident([(layer, e) for layer in range(self.num_layers) for e in self.ranking[layer][:per_layer]])

    def is_resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._pages

    def pages_of(self, layer: int, expert: int) -> tuple[int, int, int] | None:
        return self._pages.get((layer, expert))

    def write(self, layer: int, expert: int, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> None:
        """Copies one expert's matrices into its pages (the weight loader's sink)."""
        pages = self._pages.get((layer, expert))
        if pages is None:
            raise KeyError(f"expert {expert} of MoE layer {layer} is not resident")
        for page, w in zip(pages, (w1, w3, w2), strict=True):
            self.expert_view[page].copy_(w.reshape(-1), non_blocking=True)

    def write_if_resident(self, layer: int, expert: int, w1: torch.Tensor, w3: torch.Tensor,
                          w2: torch.Tensor) -> None:
        if (layer, expert) in self._pages:
            self.write(layer, expert, w1, w3, w2)

    def load_from_store(self, store: HostExpertStore) -> None:
        """Copies every resident expert's matrices from its home copy into its pages."""
        for (layer, expert), pages in self._pages.items():
            src = store.expert(layer, expert)  # [3, f*d]
            for j, page in enumerate(pages):
                self.expert_view[page].copy_(src[j], non_blocking=True)

    # ------------------------------------------------------------------ elastic moves (DESIGN.md section 4)
    #
    #   step N:  schedule -> adjuster decides --> reserve_grow: pages taken now, copy issued (copy stream)
    #                                         \-> begin_eviction: pages deferred, row STAYS in the table
    #            forward pass N (reads the evicted expert if routed; never the grown one: not in the table)
    #            finish_evictions: rows -> -1; the engine's allocator.complete_forward() frees the pages
    #   step N+1: commit_grow (after the compute stream waited for the copy): row -> the grown pages

    def begin_eviction(self, layer: int, expert: int) -> None:
        """The expert leaves after the forward pass now being prepared; its pages are released with it."""
        pages = self._pages.get((layer, expert))
        if pages is None:
            raise KeyError(f"expert {expert} of MoE layer {layer} is not resident: it cannot be evicted")
        if (layer, expert) in self._evicting:
            raise ValueError(f"expert {expert} of MoE layer {layer} is already being evicted")
        self.allocator.defer_free(EXPERT, list(pages))
        self._evicting.append((layer, expert))

    def finish_evictions(self) -> list[tuple[int, int]]:
        """After the forward pass has completed: evicted experts leave the tables (pages are deferred-freed)."""
        done, self._evicting = self._evicting, []
        for layer, expert in done:
            # one fill per row, queued on the compute stream: no index tensor to copy over, so no host wait
            # for the pass that may still be in flight (async scheduling)
            self.tables[layer, expert] = -1
            self.host_tables[layer, expert] = -1
            del self._pages[(layer, expert)]
        return done

    def reserve_grow(self, layer: int, expert: int) -> tuple[int, int, int] | None:
        """Three expert pages for an expert that will come back; None when the pool has none."""
        if (layer, expert) in self._pages or (layer, expert) in self._growing:
            raise ValueError(f"expert {expert} of MoE layer {layer} is already resident or growing")
        pages = self.allocator.allocate_mid(EXPERT, 3, owner=EXPERT_OWNER)
        if pages is None:
            return None
        self._growing[(layer, expert)] = (pages[0], pages[1], pages[2])
        return self._growing[(layer, expert)]

    def commit_grow(self, layer: int, expert: int) -> None:
        """The expert's copy has completed (the caller made sure): it enters the tables."""
        pages = self._growing.pop((layer, expert))
        row = torch.tensor(pages, dtype=torch.int32)
        # from pinned memory: a copy from pageable memory would first wait for the pass in flight
        self.tables[layer, expert] = (row.pin_memory() if self.tables.is_cuda else row).to(self.tables.device,
                                                                                           non_blocking=True)
        self.host_tables[layer, expert] = row
        self._pages[(layer, expert)] = pages

    def planned_resident(self) -> list[set[int]]:
        """Per layer, the experts resident after the moves in flight: resident - evicting + growing."""
        out: list[set[int]] = [set() for _ in range(self.num_layers)]
        for layer, e in self._pages:
            out[layer].add(e)
        for layer, e in self._evicting:
            out[layer].discard(e)
        for layer, e in self._growing:
            out[layer].add(e)
        return out

    def fill_random(self, seed: int, std: float = 0.02) -> None:
        """Dummy weights: normal(0, std) in every resident expert page (load_format="dummy")."""
        gen = torch.Generator(device=self.expert_view.device)
        gen.manual_seed(seed)
        for pages in self._pages.values():
            for page in pages:
                self.expert_view[page].normal_(0.0, std, generator=gen)
