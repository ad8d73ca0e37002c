"""Offloaded experts read by the MoE kernel in host memory (offload_access="direct"): no load buffers, no copies
for a pass, no decision on the host.

The tables name an offloaded expert by its rows in the pinned host store (ExpertCache.read_absent_from,
kernels/fused_moe.py); the kernel reads those rows over PCIe while it reads the resident experts from the pool. A
routed offloaded expert costs its bytes over PCIe once per pass (per group of M blocks), the same bytes a copy
would move, but nothing waits on the host: no routing read, no piecewise graphs; the whole pass is one CUDA graph,
through evictions and grows (the tables change in place between passes).

    fixed    DirectRuntime          the first K of each layer's ranking resident, the rest read from the store
    elastic  DirectElasticRuntime   elastic_runtime.py's decisions and grow copies; evicted experts are named by
                                    their host rows instead of leaving the tables

Bytes read from host memory are counted from the routing counts (elastic: the counter it keeps anyway); fixed mode
keeps no counter, and counts none. In elastic mode each decode pass's reads also go to the step-cost tracker beside the
reads the adjuster's model expected of the same experts (`StepCostTracker.read_excess`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rimuru.experts.cache import ExpertCache
from rimuru.experts.cost_adjuster import expected_activated
from rimuru.experts.elastic_core import ElasticCore
from rimuru.experts.elastic_runtime import ElasticRuntime
from rimuru.experts.host_store import HostExpertStore
from rimuru.experts.loader import ExpertLoader
from rimuru.experts.routing_counter import RoutingCounter
from rimuru.experts.runtime import GraphPlan, StaticRuntime
from rimuru.experts.static_provider import StaticExpertProvider


class DirectRuntime(StaticRuntime):
    """`fixed` mode with direct access: the split never moves, and nothing is copied after start-up. Every answer is
    static mode's (no decision reaches the host) except where the weights live: the host store holds every expert."""

    def __init__(self, cache: ExpertCache, store: HostExpertStore, host_rows: Sequence[torch.Tensor]) -> None:
        super().__init__(cache, mode="fixed")
        self.store = store
        self.provider = StaticExpertProvider(cache.expert_view, cache.tables, host_rows=host_rows)

    def write_expert(self, layer: int, expert: int, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> None:
        self.store.write(layer, expert, w1, w3, w2)
        self.cache.write_if_resident(layer, expert, w1, w3, w2)

    def fill_random_experts(self, seed: int) -> None:
        # the same draws as static mode's pages (HostExpertStore.fill_random), so every mode serves one model
        self.store.fill_random(seed=seed, device=self.cache.tables.device)
        self.cache.load_from_store(self.store)

    def memory_split(self) -> dict[str, int]:
        return {**super().memory_split(), "host_experts": self.store.nbytes}

    def stats(self) -> dict[str, float]:
        # the kernel's reads from host memory are not counted here (no routing counter): leave the figure out rather
        # than report static mode's 0 bytes (`/metrics` then has no rimuru:expert_bytes_loaded for this mode)
        out = super().stats()
        del out["expert_bytes_loaded"]
        return out


class DirectElasticRuntime(ElasticRuntime):
    """`elastic` mode with direct access: the core's moves and grow copies as in ElasticRuntime (its loader holds no
    buffer pages: it only copies grows), whole graphs over the live tables for every pass."""

    def __init__(self, core: ElasticCore, cache: ExpertCache, store: HostExpertStore, loader: ExpertLoader,
                 provider: StaticExpertProvider, counter: RoutingCounter, pcie_bandwidth: float,
                 async_steps: bool) -> None:
        super().__init__(core, cache, store, loader, provider, counter, pcie_bandwidth, async_steps)
        # offloaded experts read in host memory (routing counts x offloaded experts), and the passes with any expert
        # out, by pass kind (decode: one token per sequence; mixed: prefill chunks beside or without decodes): what
        # each kind of step costs the split
        self.direct_reads = {"decode": 0, "mixed": 0}
        self.direct_passes = {"decode": 0, "mixed": 0}
        self._absent_ids: tuple[np.ndarray, np.ndarray | None] | None = None  # (absent mask, its flat ids)

    def graph_plan(self) -> GraphPlan:
        return GraphPlan(counter=self.counter)

    def pass_reads_routing(self, num_tokens: int) -> bool:
        return False

    def before_pass(self, num_tokens: int) -> None:
        self._time_pass(num_tokens)  # no streaming layers, no buffers: the kernel reads offloaded experts itself

    def _absent_during_pass(self) -> np.ndarray | None:
        # the flat ids of the offloaded experts the pass reads in host memory (None: every expert resident); cached
        # with the tables' absent mask, so a step with nothing moving builds nothing
        mask = self.cache.absent_mask()  # [L, E]
        if self._absent_ids is None or self._absent_ids[0] is not mask:
            self._absent_ids = (mask, np.flatnonzero(mask) if mask.any() else None)
        return self._absent_ids[1]

    def _read_from_host(self, counts: np.ndarray, absent: np.ndarray | None, decode: bool) -> int:
        if absent is None:
            return 0
        measured = int(np.count_nonzero(counts.reshape(-1)[absent] > 0))
        read = measured * self.store.expert_bytes
        if counts.any():  # a pass ran (a step without one snapshots zeros)
            kind = "decode" if decode else "mixed"
            self.direct_reads[kind] += measured
            self.direct_passes[kind] += 1
        step_cost = self.core.step_cost
        if decode and step_cost is not None:
            # the reads the adjuster's model expected of these experts for this batch: its formula, the popularity
            # estimate before these counts join it, and the batch's picks per layer (tokens x top_k, real rows)
            E = counts.shape[1]
            picks = counts.sum(axis=1)[absent // E]
            p = self.core.popularity.probabilities().reshape(-1)[absent]
            step_cost.observe_reads(float(expected_activated(p, picks, 1).sum()), measured)
        return read

    @property
    def host_reads(self) -> int:
        return sum(self.direct_reads.values())

    @property
    def direct_bytes(self) -> int:
        """Bytes passes read from host memory so far."""
        return self.host_reads * self.store.expert_bytes

    @property
    def host_tier(self) -> None:
        return None  # the kernel reads offloaded experts itself: the host tier acts on the copy path only

    @property
    def bytes_loaded(self) -> int:
        return self.loader.counters.bytes_loaded + self.direct_bytes

    @property
    def expert_wait_s(self) -> float | None:
        return None

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "expert_bytes_loaded": self.bytes_loaded, "expert_bytes_direct": self.direct_bytes,
                **{f"expert_host_reads_{k}": float(v) for k, v in self.direct_reads.items()},
                **{f"offloaded_passes_{k}": float(v) for k, v in self.direct_passes.items()}}
