"""Random interleavings of a hybrid model's pool users: requests' KV blocks (cached when they end), requests' state
pages and the snapshots they leave, and experts, over geometries where an ssm page is a huge page (as at
Qwen3.5-35B-A3B) or a part of one.

After every step: whatever an allocator capacity counts as obtainable (free pages, and what the prefix cache and
the unheld snapshots would give back) is obtainable: an allocation of exactly that many succeeds, reclaiming on
the way; the allocator's, the cache's and the snapshots' own recounts agree.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from rimuru.engine.kv_cache_manager import KVCacheManager
from rimuru.engine.request import Request
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.state_cache_manager import StateCacheManager
from rimuru.memory import PageAllocator, PageGeometry
from rimuru.memory.geometry import CONV, SSM

GEOMETRIES = [
    PageGeometry.custom(mid_sizes={"expert": 64, SSM: 64}, small_sizes={"kv": 16, CONV: 16}),
    PageGeometry.custom(mid_sizes={"expert": 64, SSM: 32}, small_sizes={"kv": 16, CONV: 12}),
    PageGeometry.custom(mid_sizes={"expert": 32, SSM: 64}, small_sizes={"kv": 8, CONV: 16}),
]
LIN, BLOCK = 3, 4  # 3 ssm pages a request: where two fit a huge page, requests and snapshots share some


class ReclaimMachine(RuleBasedStateMachine):
    @initialize(geo=st.sampled_from(GEOMETRIES), num_huge=st.integers(4, 12))
    def setup(self, geo: PageGeometry, num_huge: int) -> None:
        self.a = PageAllocator(geo, num_huge)
        self.kv = KVCacheManager(self.a, 1, BLOCK, enable_prefix_caching=True)
        self.state = StateCacheManager(self.a, LIN, kv_page_bytes=geo.size("kv"), enable_prefix_caching=True)
        self.kv.spill = self.state.snapshots.drop_lru
        self.running: list[Request] = []
        self.experts: list[int] = []
        self.seq = 0

    @rule(tokens=st.integers(1, 3 * BLOCK), prefix=st.integers(0, 3), snapshot=st.booleans())
    def run_a_request(self, tokens: int, prefix: int, snapshot: bool) -> None:
        self.seq += 1
        r = Request(request_id=str(self.seq), seq_id=self.seq, prompt=None,
                    prompt_token_ids=[prefix] * BLOCK + [self.seq] * tokens, params=SamplingParams(max_tokens=1),
                    max_tokens=1, eos_token_id=None)
        if not self.state.allocate(r):
            return
        if not self.kv.allocate(r, len(r.prompt_token_ids)):
            self.state.free(r)
            return
        name = self.kv.block_hashes(r, 1)[0]
        if snapshot and self.state.snapshots.get(name) is None and self.state.take_snapshot(r, name, BLOCK):
            self.state.take_copies()
        self.running.append(r)

    @rule(data=st.data())
    def end_a_request(self, data: st.DataObject) -> None:
        if self.running:
            r = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
            self.kv.free(r)  # its full blocks stay cached
            self.state.free(r)  # its snapshots wait in the LRU

    @rule(count=st.integers(1, 4))
    def bring_experts_home(self, count: int) -> None:
        got = self.a.allocate_mid("expert", count)
        if got is not None:
            self.experts += got

    @rule(data=st.data())
    def evict_experts(self, data: st.DataObject) -> None:
        if self.experts:
            k = data.draw(st.integers(1, len(self.experts)))
            self.a.free_mid("expert", self.experts[-k:])
            del self.experts[-k:]

    @invariant()
    def capacities_are_obtainable(self) -> None:
        if not hasattr(self, "a"):
            return
        self.a.check_invariants()
        self.kv.check()
        self.state.check()
        for kind in ("expert", SSM):
            n = self.a.mid_capacity(kind)
            if n:  # the allocator asserts that reclaiming freed what it promised
                ids = self.a.allocate_mid(kind, n)
                assert ids is not None, (kind, n)
                self.a.free_mid(kind, ids)
                self.a.check_invariants()
                self.kv.check()
                self.state.check()
        n = self.a.small_capacity(CONV)
        if n:
            ids = self.a.allocate_small(CONV, n)
            assert ids is not None, n
            self.a.free_small(CONV, ids)

    def teardown(self) -> None:
        if not hasattr(self, "a"):
            return
        for r in self.running:
            self.kv.free(r)
            self.state.free(r)
        self.state.reset_prefix_cache()
        self.kv.reset_prefix_cache()
        if self.experts:
            self.a.free_mid("expert", self.experts)
        assert self.a.num_free_huge == self.a.num_huge_pages


TestReclaim = ReclaimMachine.TestCase
TestReclaim.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                suppress_health_check=[HealthCheck.too_slow])
