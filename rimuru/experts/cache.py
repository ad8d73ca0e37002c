"""Which routed experts are resident in pool pages, and the device tables that say where.

Every resident expert owns three mid pages of kind "expert": W1 (gate, [f, d]), W3 (up, [f, d]) and
W2 (down, [d, f]). The table of MoE layer l is a device tensor [E, 3] int32 of those page ids, -1
when the expert is not resident; the fused MoE kernel reads weights through it. Tables are one
[L_moe, E, 3] tensor updated in place, so CUDA graphs captured over them stay valid.
"""

from __future__ import annotations

import torch

from rimuru.memory.allocator import PageAllocator
from rimuru.model_spec import ModelSpec

EXPERT = "expert"
EXPERT_OWNER = -1  # allocator owner id of every expert page (requests use ids >= 0)


class PoolTooSmallError(RuntimeError):
    pass


class ExpertCache:
    def __init__(self, spec: ModelSpec, allocator: PageAllocator, expert_view: torch.Tensor,
                 device: torch.device) -> None:
        self.spec = spec
        self.allocator = allocator
        self.expert_view = expert_view  # [n_mid, f*d]
        self.num_layers = spec.num_moe_layers
        self.num_experts = spec.num_experts
        self.tables = torch.full((self.num_layers, self.num_experts, 3), -1, dtype=torch.int32, device=device)
        self._pages: dict[tuple[int, int], tuple[int, int, int]] = {}

    @property
    def num_resident(self) -> int:
        return len(self._pages)

    @property
    def total_experts(self) -> int:
        return self.num_layers * self.num_experts

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
        for (layer, expert), row in zip(experts, rows.tolist(), strict=True):
            self._pages[(layer, expert)] = tuple(row)  # type: ignore[assignment]

    def make_all_resident(self) -> None:
        self.make_resident([(layer, e) for layer in range(self.num_layers) for e in range(self.num_experts)])

    def pages_of(self, layer: int, expert: int) -> tuple[int, int, int] | None:
        return self._pages.get((layer, expert))

    def write(self, layer: int, expert: int, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> None:
        """Copies one expert's matrices into its pages (the weight loader's sink)."""
        pages = self._pages.get((layer, expert))
        if pages is None:
            raise KeyError(f"expert {expert} of MoE layer {layer} is not resident")
        for page, w in zip(pages, (w1, w3, w2), strict=True):
            self.expert_view[page].copy_(w.reshape(-1), non_blocking=True)

    def fill_random(self, seed: int, std: float = 0.02) -> None:
        """Dummy weights: normal(0, std) in every resident expert page (load_format="dummy")."""
        gen = torch.Generator(device=self.expert_view.device)
        gen.manual_seed(seed)
        for pages in self._pages.values():
            for page in pages:
                self.expert_view[page].normal_(0.0, std, generator=gen)
