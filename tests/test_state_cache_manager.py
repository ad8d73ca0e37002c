"""Per-request state pages on a real allocator: exact page ids, all-or-nothing admission, merge-back on free,
and the scheduler's admission, shortfall, preemption and finish counting them (CPU, no model)."""

from __future__ import annotations

import pytest

from rimuru.engine.kv_cache_manager import KVCacheManager
from rimuru.engine.request import Request, RequestStatus
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.scheduler import Scheduler
from rimuru.engine.state_cache_manager import StateCacheManager
from rimuru.memory.allocator import PageAllocator
from rimuru.memory.geometry import CONV, SSM, PageGeometry

# huge = expert = 64 B; ssm 32 B (2 per huge); kv 16 B; conv 12 B padded to 16 (4 per mid)
GEO = PageGeometry.custom(mid_sizes={"expert": 64, SSM: 32}, small_sizes={"kv": 16, CONV: 12})
LIN = 3  # linear-attention layers: 3 ssm + 3 conv pages per request = 3 x (32 + 16) B = 144 B = 9 KV pages


def request(seq: int, prompt: int = 8, max_tokens: int = 4) -> Request:
    return Request(request_id=str(seq), seq_id=seq, prompt=None, prompt_token_ids=[5] * prompt,
                   params=SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens, eos_token_id=None)


def test_pages_ids_and_merge_back() -> None:
    alloc = PageAllocator(GEO, num_huge_pages=6)
    state = StateCacheManager(alloc, LIN, kv_page_bytes=16)
    assert state.request_bytes == 144 and state.kv_pages == 9
    a, b = request(0), request(1)
    assert state.pages_needed(a) == 9
    assert state.allocate(a) and a.ssm_pages == [0, 1, 2]  # huge 0 and 1 split into ssm pages 0-3
    # the conv pages: ssm page 3 (the free half of huge 1) split into conv pages 6, 7, then huge 2 split into
    # expert-kind mids, mid 2 of them into conv pages 8-11
    assert a.conv_pages == [6, 7, 8] and state.pages_needed(a) == 0 and state.allocate(a)  # held: nothing more
    assert state.allocate(b) and b.ssm_pages == [6, 7, 8]  # huge 3 and 4
    assert b.conv_pages == [9, 10, 11]  # the rest of mid 2
    assert alloc.num_used(SSM) == 6 and alloc.num_used(CONV) == 6 and state.pages_in_use == 12
    state.check()
    alloc.check_invariants()
    state.free(a)
    state.free(b)
    state.free(b)  # a request without pages: nothing to do
    assert a.ssm_pages == a.conv_pages == [] and state.num_holders == 0
    alloc.check_invariants()
    assert alloc.num_free_huge == 6  # every split merged back


def test_allocation_is_all_or_nothing() -> None:
    alloc = PageAllocator(GEO, num_huge_pages=2)  # 4 ssm pages, or 3 ssm + 2 conv...
    state = StateCacheManager(alloc, LIN, kv_page_bytes=16)
    r = request(0)
    # 3 ssm pages fit (huge 0, 1), 3 conv pages need 48 B more than the free ssm half (32 B) gives
    assert alloc.mid_capacity(SSM) == 4 and alloc.small_capacity(CONV) == 8
    assert not state.allocate(r)
    assert r.ssm_pages == [] and alloc.num_used(SSM) == alloc.num_used(CONV) == 0 and alloc.num_free_huge == 2
    alloc.check_invariants()
    # kind by kind each fits, together they do not: no kind-wise shortfall
    assert state.missing_kv_pages(r) == 0
    small = PageAllocator(GEO, num_huge_pages=1)
    assert StateCacheManager(small, LIN, 16).missing_kv_pages(r) == (3 - 2) * 2 + 0  # one ssm page short


@pytest.mark.parametrize("reserve", [0, 5])
def test_scheduler_counts_state_in_admission_and_shortfall(reserve: int) -> None:
    alloc = PageAllocator(GEO, num_huge_pages=4)  # 256 B = 16 KV pages
    kv = KVCacheManager(alloc, num_attention_layers=1, block_size=4)
    state = StateCacheManager(alloc, LIN, kv_page_bytes=16)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, admission_reserve=lambda: reserve, state=state)
    reqs = [request(i, prompt=8) for i in range(3)]  # each: 9 state + 2 KV pages
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    # one admitted (11 of 16 pages, within 16 - reserve); the second needs its state and KV, 11 KV pages, and 2 are
    # left: the 3 free conv pages beside request 0's count only for conv pages. Short with or without the reserve.
    assert [s.request for s in out.scheduled] == reqs[:1]
    assert out.shortfall_pages == 11 - 2 and kv.capacity_pages() == 2
    assert reqs[0].ssm_pages and not reqs[1].ssm_pages
    state.check()
    # the running request's decode never asks for state; finishing frees its state with its KV
    for s in out.scheduled:
        s.request.num_computed_tokens = s.start + s.num_new_tokens
    sched.finish(reqs[0], RequestStatus.FINISHED_ABORTED)
    assert alloc.num_used(SSM) == alloc.num_used(CONV) == alloc.num_used("kv") == 0
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == reqs[1:2]


def test_preemption_frees_the_state_and_readmission_takes_it_again() -> None:
    alloc = PageAllocator(GEO, num_huge_pages=6)  # 24 KV pages: two requests' state (18) + 6 KV pages
    kv = KVCacheManager(alloc, num_attention_layers=1, block_size=4)
    state = StateCacheManager(alloc, LIN, kv_page_bytes=16)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, state=state)
    a, b = request(0, prompt=8, max_tokens=20), request(1, prompt=4, max_tokens=20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert len(out.scheduled) == 2 and state.num_holders == 2
    preempted = []
    for _ in range(12):  # decode until the pool cannot grow both
        for s in out.scheduled:
            r = s.request
            r.num_computed_tokens = s.start + s.num_new_tokens
            if s.samples:
                r.output_token_ids.append(7)
        out = sched.schedule()
        preempted += out.preempted
        if preempted:
            break
    assert preempted == [b] and b.ssm_pages == [] and b.num_computed_tokens == 0
    assert state.num_holders == 1 and sched.waiting[0] is b
    state.check()
    alloc.check_invariants()


# ---------------------------------------------------------------------------------------------- prefix caching
def _launch(out) -> None:  # noqa: ANN001
    for s in out.scheduled:
        s.request.num_computed_tokens = s.start + s.num_new_tokens


def test_snapshot_at_the_prompts_last_boundary_and_a_hit_that_copies_it() -> None:
    alloc = PageAllocator(GEO, num_huge_pages=8)
    kv = KVCacheManager(alloc, 1, 4, enable_prefix_caching=True)
    state = StateCacheManager(alloc, LIN, kv_page_bytes=16, enable_prefix_caching=True)
    snaps = state.snapshots
    assert snaps is not None and alloc.reclaimer is not None
    kv.spill = snaps.drop_lru
    sched = Scheduler(kv, 4, 64, state=state)
    r0 = request(0, prompt=9)  # blocks of 4: the boundary is 8, the last one before the prompt's last token
    sched.add(r0)
    out = sched.schedule()
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(0, 8)] and out.state_copies == []
    _launch(out)
    out = sched.schedule()  # from the boundary: the state after 8 tokens is copied before this pass
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(8, 1)]
    [snap] = r0.state_snapshots
    assert out.state_copies == [(r0.ssm_pages, snap.ssm_pages, r0.conv_pages, snap.conv_pages)]
    assert snap.num_tokens == 8 and snap.name == r0.block_hashes[1] and snap.refs == 1
    _launch(out)
    r0_blocks = [list(b) for b in r0.kv_pages[:2]]
    sched.finish(r0, RequestStatus.FINISHED_LENGTH)
    assert snap.refs == 0 and snaps.num_unreferenced == 1 and state.num_cached_pages == 2 * LIN
    assert alloc.num_used(SSM) == alloc.num_used(CONV) == LIN
    state.check()
    kv.check()
    # the same prompt: both blocks and the snapshot at 8 are cached; it starts at 8 from a copy in its own pages
    r1 = request(1, prompt=9)
    sched.add(r1)
    out = sched.schedule()
    assert [(s.start, s.num_new_tokens, s.num_cached_writes) for s in out.scheduled] == [(8, 1, 0)]
    assert r1.num_cached_tokens == 8 and r1.kv_pages[:2] == r0_blocks and snap.refs == 1
    assert set(r1.ssm_pages).isdisjoint(snap.ssm_pages) and set(r1.conv_pages).isdisjoint(snap.conv_pages)
    assert out.state_copies == [(snap.ssm_pages, r1.ssm_pages, snap.conv_pages, r1.conv_pages)]
    _launch(out)
    sched.finish(r1, RequestStatus.FINISHED_LENGTH)
    # a prompt sharing the first block only: short of the snapshot's boundary, no hit; its first chunk ends where
    # its cached chain does (4), a snapshot point of its own
    r2 = request(2, prompt=9)
    r2.prompt_token_ids = [5] * 4 + [6] * 5
    sched.add(r2)
    out = sched.schedule()
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(0, 4)] and r2.num_cached_tokens == 0
    assert r2.kv_chain_boundary == 4
    sched.finish(r2, RequestStatus.FINISHED_ABORTED)  # no snapshot taken: it never ran from a snapshot point
    assert snaps.num_snapshots == 1
    # a KV allocation that the free pages and the cached blocks cannot serve drops the snapshot before failing
    cap = kv.capacity_pages()
    big = request(9, prompt=4 * (cap + 1))
    assert kv.allocate(big, 4 * (cap + 1))
    assert snaps.num_snapshots == 0 and alloc.num_used(SSM) == alloc.num_used(CONV) == 0
    kv.free(big)
    state.check()
    kv.check()
    alloc.check_invariants()
    cached = alloc.num_used("kv")  # big's blocks, cached when it was freed
    assert cached > 0 and kv.reset_prefix_cache() == cached
    assert alloc.num_used("kv") == 0 and alloc.num_free_huge == 8


def _leave_a_snapshot(kv: KVCacheManager, state: StateCacheManager, i: int) -> bytes:
    """A 6-token request that snapshots its state after its first block (4 tokens) and ends: the snapshot's name."""
    r = request(i, prompt=6)
    r.prompt_token_ids = [10 + i] * 6
    assert state.allocate(r)
    assert kv.allocate(r, 6)
    name = kv.block_hashes(r, 1)[0]
    assert state.take_snapshot(r, name, 4)
    assert len(state.take_copies()) == 1
    kv.free(r)
    state.free(r)
    return name


def test_state_allocations_reclaim_snapshots_lru_and_a_reset_frees_them() -> None:
    alloc = PageAllocator(GEO, num_huge_pages=6)  # room for two requests' state pages and a little KV
    kv = KVCacheManager(alloc, 1, 4, enable_prefix_caching=True)
    state = StateCacheManager(alloc, LIN, kv_page_bytes=16, enable_prefix_caching=True)
    snaps = state.snapshots
    assert snaps is not None
    made = []
    for i in range(3):  # each leaves a snapshot: the third request's state and snapshot need the first's pages
        made.append(_leave_a_snapshot(kv, state, i))
        state.check()
        alloc.check_invariants()
    assert snaps.get(made[0]) is None and snaps.get(made[2]) is not None  # the oldest went first
    left = snaps.num_snapshots
    assert left in (1, 2) and state.num_cached_pages == 2 * LIN * left
    assert state.reset_prefix_cache() == 2 * LIN * left
    assert snaps.num_snapshots == 0 and alloc.num_used(SSM) == alloc.num_used(CONV) == 0
    kv.reset_prefix_cache()
    assert alloc.num_free_huge == 6


# As Qwen3.5-35B-A3B's pages: one expert matrix = one ssm page = one huge page (64 B here, 2 MiB there); KV and
# conv pages are small pages split out of expert-kind mid pages
GEO_HUGE_SSM = PageGeometry.custom(mid_sizes={"expert": 64, SSM: 64}, small_sizes={"kv": 16, CONV: 16})


def _fill_with_cached_blocks(alloc: PageAllocator, kv: KVCacheManager, n: int) -> list[Request]:
    """n finished requests of one full block each (4 tokens, one KV page): their blocks stay cached, refs 0."""
    done = []
    for i in range(n):
        r = request(100 + i, prompt=4)
        r.prompt_token_ids = [100 + i] * 4
        assert kv.allocate(r, 4)
        kv.free(r)
        done.append(r)
    return done


def test_a_requests_state_reclaims_cached_kv_blocks_of_the_other_mid_kind() -> None:
    # The prefix cache's blocks fill every huge page; a new request's ssm pages (mid pages of another kind than the
    # expert-kind mid pages the KV pages were split from) and conv pages must reclaim them, oldest first, or a pool
    # full of cached KV would refuse every request's state and admission would stall.
    alloc = PageAllocator(GEO_HUGE_SSM, num_huge_pages=6)
    kv = KVCacheManager(alloc, 1, 4, enable_prefix_caching=True)
    state = StateCacheManager(alloc, 2, kv_page_bytes=16, enable_prefix_caching=True)
    kv.spill = state.snapshots.drop_lru
    _fill_with_cached_blocks(alloc, kv, 6 * 4)  # 4 KV pages a huge page: all 6 hold cached blocks alone
    assert alloc.num_free_huge == 0 and alloc.num_used("kv") == 24 and kv.cache.num_unreferenced_pages == 24
    assert alloc.free_mid_capacity(SSM) == 0 and alloc.free_small_capacity(CONV) == 0
    assert alloc.mid_capacity(SSM) == 6 and alloc.small_capacity(CONV) == 6 * 4
    r = request(0)
    assert state.missing_kv_pages(r) == 0
    assert state.allocate(r)  # 2 ssm pages (2 huge pages) + 2 conv pages (one expert-kind mid page)
    assert alloc.num_used("kv") == 24 - 3 * 4  # three huge pages' blocks reclaimed
    left = {b.name for b in kv.cache._lru.values()}
    assert len(left) == 12
    kv.check()
    state.check()
    alloc.check_invariants()
    state.free(r)
    assert kv.reset_prefix_cache() == 12 and alloc.num_free_huge == 6


def test_expert_pages_reclaim_the_huge_pages_of_unheld_snapshots() -> None:
    # Snapshots that no request holds are reclaimable for experts too where their ssm pages alone use huge pages
    # (an ssm page is a huge page here, as at Qwen3.5-35B-A3B): an expert coming home must not wait behind them.
    alloc = PageAllocator(GEO_HUGE_SSM, num_huge_pages=16)
    kv = KVCacheManager(alloc, 1, 4, enable_prefix_caching=True)
    state = StateCacheManager(alloc, 2, kv_page_bytes=16, enable_prefix_caching=True)
    snaps = state.snapshots
    names = []
    for i in range(3):  # each leaves a snapshot: 2 ssm pages (2 huge pages) and 2 conv pages
        names.append(_leave_a_snapshot(kv, state, i))
    assert snaps.num_unreferenced == 3 and alloc.num_used(SSM) == 6
    held = request(9, prompt=6)
    assert state.allocate(held)  # a running request's ssm pages are not reclaimable
    free = alloc.free_mid_capacity("expert")
    assert snaps.reclaimable_mid("expert") == 6 and snaps.reclaimable_mid(SSM) == 6
    assert alloc.mid_capacity("expert") >= free + 6
    got = alloc.allocate_mid("expert", free + 3)
    assert got is not None
    assert snaps.get(names[0]) is None and snaps.get(names[1]) is None  # oldest first, two for three huge pages
    assert snaps.get(names[2]) is not None
    state.check()
    kv.check()
    alloc.check_invariants()
    alloc.free_mid("expert", got)
    state.free(held)
    state.reset_prefix_cache()
    kv.reset_prefix_cache()
    assert alloc.num_free_huge == 16
