"""Scripted allocate/free sequences on tiny geometries, asserting exact page ids and counts."""

import pytest

from rimuru.memory import AllocatorError, DoubleFreeError, PageAllocator, PageGeometry, WrongKindError
from rimuru.model_spec import load_model_spec

# expert page 64 B = 4 kv pages of 16 B; huge = expert.
G1 = PageGeometry.custom(mid_sizes={"expert": 64}, small_sizes={"kv": 16})
# huge 128 B = 2 expert pages = 1 ssm page; an expert page = 4 kv pages, an ssm page = 8.
G2 = PageGeometry.custom(mid_sizes={"expert": 64, "ssm": 128}, small_sizes={"kv": 16})


def all_free(a: PageAllocator) -> bool:
    s = a.stats()
    return a.num_free_huge == a.num_huge_pages and s.free_bytes == {"huge": a.pool_bytes, "mid": 0, "small": 0}


def test_small_pages_split_mid_then_huge_and_merge_back():
    a = PageAllocator(G1, 2)
    assert a.small_capacity("kv") == 8 and a.mid_capacity("expert") == 2
    assert a.allocate_small("kv", 3, owner="a") == [0, 1, 2]
    assert a.num_free_huge == 1 and a.small_capacity("kv") == 1 + 4
    assert a.allocate_small("kv", 2, owner="b") == [3, 4]  # the last free small page first, then a split
    assert a.num_free_huge == 0 and a.small_capacity("kv") == 3
    before = a.stats()
    assert a.allocate_small("kv", 4, owner="c") is None  # all or nothing
    assert a.allocate_mid("expert", 1) is None
    assert a.stats() == before
    a.check_invariants()

    a.free_small("kv", [0, 1, 2, 3])  # every kv page of expert page 0 free -> expert 0 -> huge 0
    assert a.num_free_huge == 1 and a.small_capacity("kv") == 3 + 4
    assert a.allocate_mid("expert", 1) == [0]
    a.free_small("kv", [4])
    a.free_mid("expert", [0])
    a.check_invariants()
    assert all_free(a)


def test_stats_by_level_and_kind():
    a = PageAllocator(G2, 3)
    assert a.allocate_mid("expert", 1) == [0]  # huge 0 -> experts 0, 1
    assert a.allocate_mid("ssm", 1) == [1]  # huge 1 -> ssm 1
    assert a.allocate_small("kv", 2, owner="x") == [4, 5]  # free expert 1 (bytes 64..128) before a new huge
    assert a.num_free_huge == 1
    assert a.allocate_small("kv", 5, owner="x") == [6, 7, 16, 17, 18]  # own rest, then huge 2 -> expert 4
    s = a.stats()
    assert s.pool_bytes == 3 * 128
    assert s.free_bytes == {"huge": 0, "mid": 64, "small": 16}  # expert 5; kv 19
    assert s.used_pages == {"expert": 1, "ssm": 1, "kv": 7}
    assert s.used_bytes == {"expert": 64, "ssm": 128, "kv": 7 * 16}
    assert s.trapped_bytes == 16 and s.padding_bytes == 0 and s.pending_deferred == 0
    assert s.total_free_bytes + s.total_used_bytes == s.pool_bytes
    assert a.small_capacity("kv") == 1 + 4 and a.mid_capacity("expert") == 1 and a.mid_capacity("ssm") == 0

    a.free_mid("ssm", [1])
    assert a.num_free_huge == 1
    a.free_mid("expert", [0])  # huge 0 still holds the split expert 1
    assert a.num_free_huge == 1 and a.mid_capacity("expert") == 2 + 2
    assert a.small_capacity("kv") == 1 + 4 + 4 + 8
    a.free_small("kv", [16, 4, 7, 5, 17, 6, 18])  # any order
    a.check_invariants()
    assert all_free(a)


def test_small_pages_may_split_a_free_mid_of_another_kind():
    g = PageGeometry.custom(mid_sizes={"expert": 128, "ssm": 64}, small_sizes={"kv": 32})
    a = PageAllocator(g, 2)
    assert a.allocate_mid("ssm", 1) == [0]  # huge 0 -> ssm 0, 1
    assert a.allocate_small("kv", 1) == [2]  # ssm 1 = bytes 64..128 = kv 2, 3: no new huge page
    assert a.num_free_huge == 1
    a.free_small("kv", [2])
    a.free_mid("ssm", [0])
    assert all_free(a)


def test_huge_is_split_into_primary_mids_for_small_requests():
    a = PageAllocator(G2, 1)
    assert a.allocate_small("kv", 1) == [0]
    assert a.mid_capacity("expert") == 1 and a.mid_capacity("ssm") == 0  # split into experts, not ssm
    assert a.allocate_mid("ssm", 1) is None


def test_affinity_returns_the_owners_own_mid_pages():
    a = PageAllocator(G1, 4)
    assert a.allocate_small("kv", 4, owner="a") == [0, 1, 2, 3]
    assert a.allocate_small("kv", 4, owner="b") == [4, 5, 6, 7]
    assert a.allocate_small("kv", 4, owner="c") == [8, 9, 10, 11]
    a.free_small("kv", [0, 1])  # expert 0 partial, kept for a
    a.free_small("kv", [4, 5])  # expert 1 partial, kept for b
    assert a.allocate_small("kv", 2, owner="b") == [4, 5]  # b's own page, although expert 0 is older
    assert a.allocate_small("kv", 1, owner="c") == [0]  # c has none free: oldest partial page
    a.free_small("kv", [4, 5, 6, 7])  # b finishes: its expert page merges, its huge page returns
    assert a.num_free_huge == 2
    a.check_invariants()


def test_bulk_prefill_gets_contiguous_ids():
    g = PageGeometry.for_model(load_model_spec("qwen1.5-moe-a2.7b"))
    a = PageAllocator(g, 100)
    assert a.allocate_small("kv", 2000, owner=1) == list(range(2000))  # 45 full expert pages + 20
    assert a.num_free_huge == 100 - 46 and a.stats().free_bytes["small"] == 24 * 131_072
    assert a.allocate_small("kv", 48, owner=2) == list(range(2000, 2024)) + list(range(2024, 2048))
    a.free_small("kv", range(2000))
    a.free_small("kv", range(2000, 2048))
    a.check_invariants()
    assert all_free(a)


def test_deferred_release_of_mid_pages():
    a = PageAllocator(G1, 2)
    assert a.allocate_mid("expert", 2) == [0, 1]
    a.defer_free("expert", [1])
    assert a.stats().pending_deferred == 1 and a.mid_capacity("expert") == 0
    with pytest.raises(DoubleFreeError, match="pending deferred release"):
        a.free_mid("expert", [1])
    with pytest.raises(DoubleFreeError, match="pending deferred release"):
        a.defer_free("expert", [1])
    assert a.allocate_mid("expert", 1) is None  # not reusable before the forward pass ends
    a.complete_forward()
    assert a.stats().pending_deferred == 0 and a.num_free_huge == 1
    assert a.allocate_mid("expert", 1) == [1]
    a.check_invariants()


def test_deferred_release_of_small_pages():
    a = PageAllocator(G1, 2)
    assert a.allocate_small("kv", 4) == [0, 1, 2, 3]
    a.defer_free("kv", [1, 2])
    assert a.allocate_small("kv", 1) == [4]  # 1 and 2 stay unusable
    a.check_invariants()
    a.complete_forward()
    assert a.small_capacity("kv") == 2 + 3
    assert a.allocate_small("kv", 2) == [5, 6]  # partial pages in order of becoming partial
    a.complete_forward()  # nothing pending: no-op
    a.free_small("kv", [0, 3, 4, 5, 6])
    assert all_free(a)


def test_errors_are_clear():
    g = PageGeometry.custom(mid_sizes={"expert": 64}, small_sizes={"kv": 16, "conv": 32})
    a = PageAllocator(g, 2)
    assert a.allocate_small("kv", 2) == [0, 1]
    assert a.allocate_mid("expert", 1) == [1]
    with pytest.raises(DoubleFreeError, match="kv page 2 is already free"):
        a.free_small("kv", [2])
    with pytest.raises(WrongKindError, match="belong to kv page 0"):
        a.free_small("conv", [0])
    with pytest.raises(WrongKindError, match="belong to expert page 1"):
        a.free_small("kv", [4])
    with pytest.raises(AllocatorError, match="split into small pages"):
        a.free_mid("expert", [0])
    with pytest.raises(DoubleFreeError, match="appears twice"):
        a.free_small("kv", [1, 1])
    with pytest.raises(AllocatorError, match="out of range"):
        a.free_small("kv", [8])
    with pytest.raises(AllocatorError, match="unknown page kind 'nope'"):
        a.allocate_small("nope", 1)
    with pytest.raises(AllocatorError, match="'expert' is a mid page kind, not a small one"):
        a.allocate_small("expert", 1)
    with pytest.raises(AllocatorError, match="'kv' is a small page kind"):
        a.allocate_mid("kv", 1)
    with pytest.raises(AllocatorError, match="non-negative"):
        a.allocate_small("kv", -1)
    with pytest.raises(AllocatorError, match="huge pages are never handed out"):
        a.defer_free("huge", [0])
    with pytest.raises(AllocatorError, match="num_huge_pages must be positive"):
        PageAllocator(g, 0)
    a.free_small("kv", [0, 1])
    with pytest.raises(AllocatorError, match="kv page 0 is not allocated"):
        a.free_small("kv", [0])  # its expert page merged back
    assert a.allocate_small("kv", 0) == [] and a.allocate_mid("expert", 0) == []
    a.check_invariants()


def test_padding_is_reported():
    g = PageGeometry.custom(mid_sizes={"expert": 64}, small_sizes={"conv": 12})
    a = PageAllocator(g, 1)
    assert g.size("conv") == 16
    assert a.allocate_small("conv", 3) == [0, 1, 2]
    assert a.stats().padding_bytes == 3 * (16 - 12)
