"""Random interleavings of allocate / free / defer / complete_forward, for several geometries.

After every step: no two live pages share a byte, free + used bytes = pool, and the allocator's own
recount (`check_invariants`) agrees. At the end, freeing everything gives back all huge pages.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from rimuru.memory import PageAllocator, PageGeometry

GEOMETRIES = [
    PageGeometry.custom(mid_sizes={"expert": 64}, small_sizes={"kv": 16}),
    PageGeometry.custom(mid_sizes={"expert": 96, "ssm": 64}, small_sizes={"kv": 16, "conv": 20}),
    PageGeometry.custom(mid_sizes={"expert": 128, "ssm": 64}, small_sizes={"kv": 32}),
    PageGeometry.custom(mid_sizes={"expert": 48}, small_sizes={"kv": 16, "conv": 8}),
]
OWNERS = st.sampled_from([None, "a", "b", "c"])


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(geo=st.sampled_from(GEOMETRIES), num_huge=st.integers(1, 4))
    def setup(self, geo: PageGeometry, num_huge: int) -> None:
        self.g = geo
        self.a = PageAllocator(geo, num_huge)
        self.live: dict[str, set[int]] = {k: set() for k in (*geo.mid_kinds, *geo.small_kinds)}
        self.deferred: list[tuple[str, list[int]]] = []

    def _take(self, kind: str, ids: list[int] | None, count: int, capacity: int) -> None:
        if count > capacity:
            assert ids is None
            return
        assert ids is not None and len(ids) == count and len(set(ids)) == count
        assert not (set(ids) & self.live[kind])
        self.live[kind] |= set(ids)

    @rule(data=st.data(), count=st.integers(0, 12), owner=OWNERS)
    def allocate_small(self, data: st.DataObject, count: int, owner: object) -> None:
        if not self.g.small_kinds:
            return
        kind = data.draw(st.sampled_from(self.g.small_kinds))
        cap = self.a.small_capacity(kind)
        before = self.a.stats()
        ids = self.a.allocate_small(kind, count, owner)
        if ids is None:
            assert self.a.stats() == before  # no side effects
        self._take(kind, ids, count, cap)

    @rule(data=st.data(), count=st.integers(0, 4))
    def allocate_mid(self, data: st.DataObject, count: int) -> None:
        kind = data.draw(st.sampled_from(self.g.mid_kinds))
        cap = self.a.mid_capacity(kind)
        self._take(kind, self.a.allocate_mid(kind, count), count, cap)

    def _pick(self, data: st.DataObject) -> tuple[str, list[int]] | None:
        kinds = [k for k, ids in self.live.items() if ids]
        if not kinds:
            return None
        kind = data.draw(st.sampled_from(sorted(kinds)))
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live[kind])), min_size=1, unique=True))
        self.live[kind] -= set(ids)
        return kind, ids

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if picked := self._pick(data):
            kind, ids = picked
            if self.g.level(kind) == "small":
                self.a.free_small(kind, ids)
            else:
                self.a.free_mid(kind, ids)

    @rule(data=st.data())
    def defer(self, data: st.DataObject) -> None:
        if picked := self._pick(data):
            self.a.defer_free(*picked)
            self.deferred.append(picked)

    @rule()
    def complete_forward(self) -> None:
        self.a.complete_forward()
        self.deferred.clear()

    @invariant()
    def bytes_are_accounted(self) -> None:
        if not hasattr(self, "a"):
            return
        self.a.check_invariants()
        spans = sorted(
            (self.g.offset(k, i), self.g.offset(k, i) + self.g.size(k))
            for k, ids in (*self.live.items(), *self.deferred)
            for i in ids
        )
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start, "two live pages overlap"
        assert all(0 <= s and e <= self.a.pool_bytes for s, e in spans)
        s = self.a.stats()
        assert s.total_used_bytes == sum(e - b for b, e in spans)
        assert s.total_free_bytes + s.total_used_bytes == s.pool_bytes
        assert s.pending_deferred == sum(len(ids) for _, ids in self.deferred)

    def teardown(self) -> None:
        if not hasattr(self, "a"):
            return
        for kind, ids in self.live.items():
            if self.g.level(kind) == "small":
                self.a.free_small(kind, ids)
            else:
                self.a.free_mid(kind, ids)
        self.a.complete_forward()
        self.a.check_invariants()
        assert self.a.num_free_huge == self.a.num_huge_pages
        assert self.a.stats().free_bytes == {"huge": self.a.pool_bytes, "mid": 0, "small": 0}


AllocatorMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestAllocatorInterleavings = AllocatorMachine.TestCase
