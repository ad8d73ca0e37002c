"""`fixed` mode's runtime: a fixed set of experts resident, the rest in pinned host memory, copied into two load
buffers for the passes that route to them (experts/offload_provider.py decides per layer, experts/loader.py
copies). The split never moves; `ElasticRuntime` (elastic_runtime.py) builds on this one and moves it.
"""

from __future__ import annotations

import torch

from rimuru.experts.cache import ExpertCache
from rimuru.experts.host_store import HostExpertStore
from rimuru.experts.host_tier import HostExpertTier, no_tier_stats
from rimuru.experts.loader import ExpertLoader
from rimuru.experts.offload_provider import OffloadExpertProvider
from rimuru.experts.routing_counter import RoutingCounter
from rimuru.experts.runtime import FixedResidency, GraphPlan
from rimuru.experts.static_provider import StaticExpertProvider


class OffloadRuntime(FixedResidency):
    """`provider` is the copy path's OffloadExpertProvider, or, for elastic mode with direct access
    (DirectElasticRuntime), the StaticExpertProvider whose tables name host rows: that subclass overrides every
    method below that needs the offload provider's pass hooks (routing reads, load waits, the host tier)."""

    def __init__(self, cache: ExpertCache, store: HostExpertStore, loader: ExpertLoader,
                 provider: OffloadExpertProvider | StaticExpertProvider, mode: str = "fixed") -> None:
        self.mode = mode
        self.cache = cache
        self.store = store
        self.loader = loader
        self.provider = provider

    def graph_plan(self) -> GraphPlan:
        return GraphPlan(counter=self.provider.counter, piecewise=self.provider)

    def write_expert(self, layer: int, expert: int, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> None:
        self.store.write(layer, expert, w1, w3, w2)
        self.cache.write_if_resident(layer, expert, w1, w3, w2)

    def swap_routing_counter(self, counter: RoutingCounter | None) -> RoutingCounter | None:
        previous, self.provider.counter = self.provider.counter, counter
        return previous

    def fill_random_experts(self, seed: int) -> None:
        # the same draws as static mode's pages (HostExpertStore.fill_random), so every mode serves one model
        self.store.fill_random(seed=seed, device=self.cache.tables.device)
        self.cache.load_from_store(self.store)

    def pass_reads_routing(self, num_tokens: int) -> bool:
        return self.provider.pass_reads_routing(num_tokens)

    def before_pass(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.provider.begin_pass(num_tokens)

    @property
    def bytes_loaded(self) -> int:
        return self.loader.counters.bytes_loaded

    @property
    def expert_wait_s(self) -> float | None:
        return self.provider.table_wait_s

    @property
    def host_reads(self) -> int:
        return 0  # copy access: offloaded experts reach a pass through the load buffers, never read in host memory

    def memory_split(self) -> dict[str, int]:
        page = self.cache.expert_page_bytes
        return {"experts_resident": 3 * self.cache.num_resident * page,
                "load_buffers": len(self.loader.buffer_pages) * page, "host_experts": self.store.nbytes}

    @property
    def host_tier(self) -> HostExpertTier | None:
        """The provider's host tier (None: every routed offloaded expert is copied)."""
        return self.provider.host_tier

    def stats(self) -> dict[str, float]:
        c = self.loader.counters
        tier = self.host_tier
        return {"expert_bytes_loaded": c.bytes_loaded, "prefetch_hits": c.hits, "prefetch_misses": c.misses,
                "expert_evictions": 0, "expert_grows": 0, "expert_reranks": 0,
                **(tier.stats() if tier is not None else no_tier_stats())}

    @property
    def host_compute_s(self) -> float:
        """Host seconds the host tier has spent so far (0 without one)."""
        tier = self.host_tier
        return 0.0 if tier is None else tier.counters.compute_s

    @property
    def host_experts_computed(self) -> int:
        tier = self.host_tier
        return 0 if tier is None else tier.counters.experts
