"""The device half of expert residency: the expert tables the MoE kernel reads, and the weights in the pages.

`ExpertResidency` (residency.py) decides which experts hold which pages; this object mirrors every change
into the tables. Every resident expert owns three mid pages of kind "expert": W1 (gate, [f, d]), W3 (up,
[f, d]) and W2 (down, [d, f]). The table of MoE layer l is a device tensor [E, 3] int32 of those page ids,
-1 when the expert is not in the tables, or, where the kernel reads offloaded experts in host memory
(`read_absent_from`), the codes <= -2 of its rows in the pinned host store (kernels/fused_moe.py,
`host_row_code`); the fused MoE kernel reads weights through it. Tables are one
[L_moe, E, 3] tensor updated in place, so CUDA graphs captured over them stay valid; `host_tables` is the
same numbers on the host, so deciding what to load never reads the device.

At start-up the resident set of a layer is a prefix of its ranking (ExpertResidency.ranking: expert ids, most
popular first; uniform order 0..E-1 when none is given).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rimuru.experts.host_store import HostExpertStore
from rimuru.experts.residency import Expert, ExpertPages, ExpertResidency
from rimuru.kernels.fused_moe import host_row_code
from rimuru.memory.allocator import PageAllocator


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
    def __init__(self, residency: ExpertResidency, expert_view: torch.Tensor, device: torch.device) -> None:
        self.residency = residency
        self.expert_view = expert_view  # [n_mid, f*d]
        self.num_layers = residency.num_layers
        self.num_experts = residency.num_experts
        shape = (self.num_layers, self.num_experts, 3)
        self.tables = torch.full(shape, -1, dtype=torch.int32, device=device)  # [L_moe, E, 3]
        self.host_tables = torch.full(shape, -1, dtype=torch.int32)  # the same numbers on the host
        self.host_rows: list[torch.Tensor] | None = None  # per layer [3E, f*d] views of the store (read_absent_from)
        # what an absent expert's row holds: -1, or its host-row codes [E, 3] (the same for every layer)
        self._absent = torch.full((self.num_experts, 3), -1, dtype=torch.int32)
        # bumped by every write of host_tables (tables_changed): keys the absent mask derived from them
        self._tables_version = 0
        self._absent_mask: tuple[int, np.ndarray] | None = None

    @property
    def expert_page_bytes(self) -> int:
        return self.expert_view.shape[1] * self.expert_view.element_size()

    @property
    def allocator(self) -> PageAllocator:
        return self.residency.allocator

    @property
    def num_resident(self) -> int:
        return self.residency.num_resident

    @property
    def total_experts(self) -> int:
        return self.residency.total_experts

    @property
    def num_offloaded(self) -> int:
        """Routed experts with no pool pages now (read in host memory or copied in for a pass)."""
        return self.total_experts - self.num_resident

    def all_resident(self) -> bool:
        return self.residency.all_resident()

    def tables_changed(self) -> None:
        """host_tables were written (every writer calls this): what was derived from them is recomputed."""
        self._tables_version += 1

    def absent_mask(self) -> np.ndarray:
        """[L_moe, E] bool, True where the tables name no pool pages (the expert is not resident), as the tables
        are now. Read-only for callers, and the same array until the tables change: a new one then, so a caller may
        keep the array of a pass the tables have changed since (asked once or more per step; building it takes a
        comparison and a copy of the whole table)."""
        cached = self._absent_mask
        if cached is not None and cached[0] == self._tables_version:
            return cached[1]
        mask = (self.host_tables[:, :, 0] < 0).numpy()
        mask.setflags(write=False)
        self._absent_mask = (self._tables_version, mask)
        return mask

    # ------------------------------------------------------------------ start-up
    def read_absent_from(self, store: HostExpertStore) -> list[torch.Tensor]:
        """From now on an expert that is not resident is named in the tables by its rows in `store` (pinned on a
        GPU), which the MoE kernel reads directly; returns the per-layer host rows the provider hands it."""
        E = self.num_experts
        self.host_rows = [layer.view(3 * store.num_experts, -1) for layer in store.layers]
        # an expert the store does not hold (another rank's, under expert parallelism) stays absent: -1
        first = store.first_expert
        self._absent = torch.tensor([[host_row_code(e - first, j) if store.holds(e) else -1 for j in range(3)]
                                     for e in range(E)], dtype=torch.int32)
        absent = self.host_tables[:, :, 0] < 0  # [L, E]
        codes = self._absent.expand(self.num_layers, E, 3)
        self.host_tables[absent] = codes[absent]
        self.tables_changed()
        self.tables.copy_(self.host_tables.to(self.tables.device))
        return self.host_rows

    def make_resident(self, experts: Sequence[Expert]) -> None:
        """Gives each (moe_layer, expert) three expert pages and points its table row at them.
        Raises PoolTooSmallError (nothing taken) when the pool can't hold them all."""
        rows = self.residency.place(experts)
        if not rows:
            return
        pages = torch.tensor(rows, dtype=torch.int32)  # [n, 3]
        idx = torch.tensor(experts, dtype=torch.int64).view(-1, 2)
        self.tables[idx[:, 0], idx[:, 1]] = pages.to(self.tables.device)
        self.host_tables[idx[:, 0], idx[:, 1]] = pages
        self.tables_changed()

    def make_all_resident(self) -> None:
        self.make_resident(self.residency.prefix(self.num_experts))

    def make_prefix_resident(self, per_layer: int) -> None:
        """The first `per_layer` experts of each layer's ranking become resident."""
        self.make_resident(self.residency.prefix(per_layer))

    # ------------------------------------------------------------------ weights
    def write(self, layer: int, expert: int, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> None:
        """Copies one expert's matrices into its pages (the weight loader's sink)."""
        pages = self.residency.pages_of(layer, expert)
        if pages is None:
            raise KeyError(f"expert {expert} of MoE layer {layer} is not resident")
        for page, w in zip(pages, (w1, w3, w2), strict=True):
            self.expert_view[page].copy_(w.reshape(-1), non_blocking=True)

    def write_if_resident(self, layer: int, expert: int, w1: torch.Tensor, w3: torch.Tensor,
                          w2: torch.Tensor) -> None:
        if self.residency.is_resident(layer, expert):
            self.write(layer, expert, w1, w3, w2)

    def load_from_store(self, store: HostExpertStore) -> None:
        """Copies every resident expert's matrices from its home copy into its pages."""
        for (layer, expert), pages in self.residency.resident_items():
            src = store.expert(layer, expert)  # [3, f*d]
            for j, page in enumerate(pages):
                self.expert_view[page].copy_(src[j], non_blocking=True)

    def fill_random(self, seed: int, std: float = 0.02) -> None:
        """Dummy weights: normal(0, std) in every resident expert page (load_format="dummy")."""
        gen = torch.Generator(device=self.expert_view.device)
        gen.manual_seed(seed)
        for _, pages in self.residency.resident_items():
            for page in pages:
                self.expert_view[page].normal_(0.0, std, generator=gen)

    # ------------------------------------------------------------------ moves (the order: residency.py)
    def clear_rows(self, experts: Sequence[Expert]) -> None:
        """Evicted experts (already out of the residency) leave the tables."""
        for layer, expert in experts:
            # fills queued on the compute stream: no index tensor to copy over, so no host wait for the pass that
            # may still be in flight (async scheduling)
            if self.host_rows is None:
                self.tables[layer, expert] = -1
            else:
                for j in range(3):
                    self.tables[layer, expert, j] = int(self._absent[expert, j])
            self.host_tables[layer, expert] = self._absent[expert]
        if experts:
            self.tables_changed()

    def write_rows(self, grown: Sequence[tuple[Expert, ExpertPages]]) -> None:
        """Grown experts (committed in the residency; their copies completed) enter the tables."""
        for (layer, expert), pages in grown:
            row = torch.tensor(pages, dtype=torch.int32)
            # from pinned memory: a copy from pageable memory would first wait for the pass in flight
            src = row.pin_memory() if self.tables.is_cuda else row
            self.tables[layer, expert] = src.to(self.tables.device, non_blocking=True)
            self.host_tables[layer, expert] = row
        if grown:
            self.tables_changed()
