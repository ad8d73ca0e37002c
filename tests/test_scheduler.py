"""The scheduler on a real allocator over a tiny geometry: exact chunks, page ids and preemptions.

Geometry: an expert (mid) page is 64 B and a KV (small) page 16 B, so a mid page splits into 4 KV
pages and a huge page is one mid page. Two attention layers, block_size 4: a block of 4 tokens costs
2 KV pages (one per layer).
"""

from __future__ import annotations

import pytest

from rimuru.engine.kv_cache_manager import KVCacheManager
from rimuru.engine.request import Request, RequestStatus
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.scheduler import Scheduler
from rimuru.memory.allocator import PageAllocator
from rimuru.memory.geometry import PageGeometry


def make(num_huge: int, max_seqs: int = 8, budget: int = 64) -> tuple[Scheduler, KVCacheManager]:
    geo = PageGeometry.custom(mid_sizes={"expert": 64}, small_sizes={"kv": 16})
    kv = KVCacheManager(PageAllocator(geo, num_huge), num_attention_layers=2, block_size=4)
    return Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv


def req(i: int, prompt_len: int) -> Request:
    return Request(request_id=f"r{i}", seq_id=i, prompt=None, prompt_token_ids=list(range(1, prompt_len + 1)),
                   params=SamplingParams(max_tokens=8), max_tokens=8, eos_token_id=None)


def advance(sched, tokens: dict[str, int] | None = None) -> None:
    """What the engine does after a forward pass: count computed tokens, append sampled ones."""
    for s in sched.scheduled:
        s.request.num_computed_tokens = s.start + s.num_new_tokens
        if s.samples:
            s.request.output_token_ids.append((tokens or {}).get(s.request.request_id, 7))


def test_chunked_prefill_under_token_budget() -> None:
    s, kv = make(num_huge=8, budget=8)
    a, b = req(0, 6), req(1, 9)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(x.request.request_id, x.start, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        ("r0", 0, 6, True), ("r1", 0, 2, False)]
    # r0: 2 blocks x 2 layers from mid page 0 (KV pages 0..3); r1: 1 block from mid page 1 (affinity: own mid)
    assert a.kv_pages == [[0, 1], [2, 3]]
    assert b.kv_pages == [[4, 5]]
    advance(out)
    out = s.schedule()
    # running first: r0 decodes 1 token, r1 continues its prefill with the 7 left of the budget
    assert [(x.request.request_id, x.start, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        ("r0", 6, 1, True), ("r1", 2, 7, True)]
    assert a.kv_pages == [[0, 1], [2, 3]]  # 7 tokens still fit in 2 blocks
    assert b.kv_pages == [[4, 5], [6, 7], [8, 9]]
    assert kv.pages_in_use == 10


def test_max_num_seqs_limits_admission() -> None:
    s, _ = make(num_huge=8, max_seqs=2)
    rs = [req(i, 3) for i in range(3)]
    for r in rs:
        s.add(r)
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]
    assert [r.status for r in rs] == [RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.WAITING]


def test_shortfall_reported_when_pages_run_out() -> None:
    s, kv = make(num_huge=2)  # 8 KV pages = 4 blocks
    a, b = req(0, 12), req(1, 8)  # a takes 3 blocks (6 pages); b needs 2 blocks (4 pages), 2 are left
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["r0"]
    assert out.shortfall_pages == 2
    assert b.status == RequestStatus.WAITING and b.kv_pages == []


def test_admissions_leave_the_reserve_free() -> None:
    # 16 KV pages (8 blocks); r0 takes 2 blocks (4 pages), 12 are free. A reserve of 10 pages (the elastic
    # adjuster's grows wait for them) keeps r1 (4 pages) out, and reports no shortfall: it would fit
    reserve = [10]
    geo = PageGeometry.custom(mid_sizes={"expert": 64}, small_sizes={"kv": 16})
    kv = KVCacheManager(PageAllocator(geo, 4), num_attention_layers=2, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, admission_reserve=lambda: reserve[0])
    r0, r1, r2 = req(0, 8), req(1, 8), req(2, 40)
    s.add(r0)
    reserve[0] = 0
    assert [x.request.request_id for x in s.schedule().scheduled] == ["r0"]
    reserve[0] = 10
    s.add(r1)
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["r0"] and out.shortfall_pages == 0
    assert r1.status == RequestStatus.WAITING and kv.capacity_pages() == 12
    # a reserve of 8 leaves room for r1 (12 - 4 >= 8); then r2 (10 blocks) lacks pages beyond the reserve: the
    # shortfall is what it lacks beyond the free pages (20 - 8 = 12), as without a reserve
    reserve[0] = 8
    s.add(r2)
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"] and out.shortfall_pages == 12
    # running requests are never held back by the reserve
    reserve[0] = 100
    assert [x.request.request_id for x in s.schedule().scheduled] == ["r0", "r1"]


def test_preemption_frees_latest_running_request_and_requeues_it_first() -> None:
    s, kv = make(num_huge=2)  # 8 KV pages = 4 blocks
    a, b = req(0, 4), req(1, 8)  # a: 1 block (2 pages), b: 2 blocks (4 pages): 6 of 8 used
    s.add(a)
    s.add(b)
    advance(s.schedule())
    assert kv.pages_in_use == 6
    # a (5 tokens) needs a 2nd block: the last 2 pages. b (9 tokens) needs a 3rd block: none left, and b is
    # the most recently started running request, so b itself is preempted; no waiting request is admitted.
    out = s.schedule()
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in out.scheduled] == [("r0", 4, 1)]
    assert out.preempted == [b]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.kv_pages == []
    assert list(s.waiting) == [b] and b.num_preemptions == 1 and s.num_preemptions == 1
    assert b.output_token_ids == [7]  # recompute keeps what was generated
    assert kv.pages_in_use == 4 and len(a.kv_pages) == 2
    advance(out)
    # next step b comes back: its prompt and its token are recomputed (9 tokens, 3 blocks = 6 pages: 4 free)
    out = s.schedule()
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in out.scheduled] == [("r0", 5, 1)]
    assert out.shortfall_pages == 2


def test_preempting_another_request_lets_the_earlier_one_continue() -> None:
    s, kv = make(num_huge=2)
    a, b = req(0, 8), req(1, 4)  # a: 2 blocks, b: 1 block; 6 of 8 pages
    s.add(a)
    s.add(b)
    advance(s.schedule())
    advance(s.schedule())  # a (9 tokens) takes a 3rd block: 8 used; b (5 tokens) needs a 2nd: b is preempted
    assert kv.pages_in_use == 6 and len(a.kv_pages) == 3 and b.kv_pages == []
    advance(s.schedule())
    assert [len(a.kv_pages), kv.pages_in_use] == [3, 6]


def test_finish_and_abort_free_every_page() -> None:
    s, kv = make(num_huge=4)
    a, b, c = req(0, 5), req(1, 6), req(2, 3)
    for r in (a, b, c):
        s.add(r)
    advance(s.schedule())
    assert kv.pages_in_use == 2 * (2 + 2 + 1)
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    s.finish(c, RequestStatus.FINISHED_LENGTH)
    assert kv.pages_in_use == 0 and not s.has_unfinished()
    st = kv.allocator.stats()
    assert st.num_free_huge == 4 and st.trapped_bytes == 0
    kv.allocator.check_invariants()


def test_waiting_request_can_be_aborted() -> None:
    s, kv = make(num_huge=1, max_seqs=1)
    a, b = req(0, 3), req(1, 3)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert list(s.waiting) == [] and b.status == RequestStatus.FINISHED_ABORTED
    with pytest.raises(AssertionError):
        s.finish(a, RequestStatus.RUNNING)


def test_oldest_wait_is_the_head_of_the_queue_on_the_requests_clock() -> None:
    """What the elastic adjuster's TTFT target reads (StepDemand.oldest_wait_s): how long the first waiting request
    has waited, on the clock its arrival time was taken on (the engine's monotonic clock, the simulator's own)."""
    sched, _ = make(num_huge=1, max_seqs=1)
    assert sched.oldest_wait_s(100.0) == 0.0  # no queue
    first, second = req(0, 4), req(1, 4)
    first.arrival_time, second.arrival_time = 10.0, 12.5
    sched.add(first)
    sched.add(second)
    assert sched.oldest_wait_s(14.0) == pytest.approx(4.0)
    sched.schedule()  # max_num_seqs = 1: the first runs, the second is now the head
    assert [r.request_id for r in sched.waiting] == ["r1"] and sched.oldest_wait_s(14.0) == pytest.approx(1.5)
    assert sched.oldest_wait_s(12.0) == 0.0  # never negative (a clock read before the arrival)
