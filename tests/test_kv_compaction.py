"""KV compaction: the allocator's relocation with exact page ids, every holder renamed (requests' grids, the cached
blocks they hold, refs-0 blocks dropped), the moved bytes where their holders look, whole mid pages after the pass,
and an engine that compacts at every step giving the tokens it gives without compaction.

Geometry (as tests/test_prefix_cache.py): an expert (mid) page is 64 B and a KV (small) page 16 B, so a mid page
holds 4 KV pages and a huge page is one mid page. Two attention layers, block_size 4: a block is 2 KV pages.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.engine.kv_cache_manager import KV, KVCacheManager
from rimuru.engine.kv_compaction import compact_kv
from rimuru.engine.request import Request
from rimuru.experts.residency import EXPERT
from rimuru.memory.allocator import USED, PageAllocator
from rimuru.memory.geometry import PageGeometry

GEO = PageGeometry.custom(mid_sizes={"expert": 64}, small_sizes={"kv": 16})


def req(i: int, n: int) -> Request:
    return Request(request_id=f"r{i}", seq_id=i, prompt=None, prompt_token_ids=[100 * i + j for j in range(n)],
                   params=SamplingParams(max_tokens=8), max_tokens=8, eos_token_id=None)


def test_relocate_moves_used_pages_out_and_the_mid_page_merges_after_the_pass() -> None:
    a = PageAllocator(GEO, 4)
    assert a.allocate_small(KV, 4, owner="a") == [0, 1, 2, 3]  # mid page 0, full
    assert a.allocate_small(KV, 3, owner="b") == [4, 5, 6]  # mid page 1
    assert a.allocate_small(KV, 2, owner="c") == [7, 8]  # the last of mid page 1, then mid page 2
    a.free_small(KV, [0, 2, 3, 4])  # mid 0 keeps 1; mid 1 keeps 5, 6, 7 (4 free); mid 2 keeps 8
    key0 = GEO.offset(EXPERT, 0)
    offsets, used = a.split_parents(KV, EXPERT)
    assert offsets.tolist() == [key0, GEO.offset(EXPERT, 1), GEO.offset(EXPERT, 2)] and used.tolist() == [1, 3, 1]
    assert a.used_smalls_in(KV, key0).tolist() == [1]
    assert a.mid_capacity(EXPERT) == 1  # mid page 3
    src, dst = a.relocate_small(KV, [key0])
    # page 1 goes to the fullest other mid page with room: mid 1's free page 4 (mid 2 has three free)
    assert src.tolist() == [1] and dst.tolist() == [4]
    assert a._small_state[KV][dst[0]] == USED
    assert a.mid_capacity(EXPERT) == 1  # the source is deferred until the pass ends
    a.check_invariants()
    a.complete_forward()
    assert a.mid_capacity(EXPERT) == 2  # mid page 0 merged
    a.check_invariants()
    # nothing fits elsewhere: refused, nothing changed
    b = PageAllocator(GEO, 2)
    assert b.allocate_small(KV, 4) == [0, 1, 2, 3] and b.allocate_small(KV, 2) == [4, 5]
    before = b.stats()
    assert b.relocate_small(KV, [GEO.offset(EXPERT, 0)]) is None and b.stats() == before


def test_held_sources_wait_for_release_held_then_the_next_complete_forward() -> None:
    """The engine compacts after its pass is queued and copies with the next one: the sources stay deferred through
    the step's own complete_forward and go at the end of the step that queued the copies."""
    a = PageAllocator(GEO, 4)
    a.allocate_small(KV, 4, owner="a")
    a.allocate_small(KV, 3, owner="b")
    a.free_small(KV, [0, 2, 3])  # mid 0 keeps page 1; mid 1 keeps 4, 5, 6
    src, dst = a.relocate_small(KV, [GEO.offset(EXPERT, 0)], hold=True)
    assert src.tolist() == [1] and dst.tolist() == [7]
    assert a.pending_deferred == 1
    a.complete_forward()  # the step that compacted ends: its pass cannot have read the destinations' new bytes
    assert a.pending_deferred == 1 and a.mid_capacity(EXPERT) == 2  # mid 0 still split: only mids 2, 3 are whole
    a.check_invariants()
    a.release_held()  # the next pass, with the copies before it, is queued
    assert a.pending_deferred == 1 and a.mid_capacity(EXPERT) == 2
    a.complete_forward()
    assert a.pending_deferred == 0 and a.mid_capacity(EXPERT) == 3  # mid 0 merged
    a.check_invariants()


@pytest.mark.parametrize("grids", ["lists", "arrays"])
@pytest.mark.parametrize("seed", range(6))
def test_compaction_renames_every_holder_and_the_bytes_follow(seed: int, grids: str) -> None:
    """Requests of random lengths fill a pool of 12 mid pages, a third of them sharing a cached prefix with an
    earlier one; half end (their full blocks cached, refs 0), shorter ones take the holes, a third end. A pool "of
    bytes" (one signature per page) checks that after the moves every holder finds its own bytes; after the pass a
    mid page more is whole."""
    rng = np.random.default_rng(seed)
    alloc = PageAllocator(GEO, 12)
    kv = KVCacheManager(alloc, num_attention_layers=2, block_size=4, enable_prefix_caching=True)
    data = np.full(GEO.num_pages(KV, alloc.pool_bytes), -1, dtype=np.int64)  # the pool's bytes: a signature a page
    running: list[Request] = []

    def admit(i: int, n: int) -> bool:
        r = req(i, n)
        if running and rng.random() < 0.35:  # shares the first blocks of a running request
            other = running[int(rng.integers(len(running)))]
            r.prompt_token_ids = other.prompt_token_ids[:8] + r.prompt_token_ids[8:]
        prefix = kv.lookup(r)
        if not kv.allocate(r, n - prefix.num_tokens, prefix):
            return False
        r.num_computed_tokens = n
        for b, row in enumerate(r.kv_pages[len(prefix.blocks):], start=len(prefix.blocks)):
            data[row] = [1000 * i + 10 * b + layer for layer in range(len(row))]  # written by its pass
        running.append(r)
        return True

    i = 0
    while admit(i, int(rng.integers(4, 15))):
        i += 1
    for r in [running[j] for j in rng.permutation(len(running))[: len(running) // 2]]:
        kv.free(r)
        running.remove(r)
    for _ in range(4):
        i += 1
        admit(i, int(rng.integers(1, 6)))
    for r in [running[j] for j in rng.permutation(len(running))[: len(running) // 3]]:
        kv.free(r)  # their partial last blocks free pages here and there
        running.remove(r)
    expected = {r.seq_id: data[np.asarray(r.kv_pages)].copy() for r in running}
    whole_before = alloc.mid_capacity(EXPERT)
    class Arrays:  # the runner's int32 page arrays stand in for the lists where it has them: every other request
        renamed: dict[int, np.ndarray] = {}

        def page_grid(self, r: Request) -> np.ndarray | None:
            return np.asarray(r.kv_pages, dtype=np.int32) if r.seq_id % 2 else None

        def grid_renamed(self, r: Request, grid: np.ndarray) -> None:
            self.renamed[r.seq_id] = grid

    arrays = Arrays() if grids == "arrays" else None
    moves = compact_kv(kv, running, EXPERT, mid_pages=2, max_pages=64, grids=arrays)
    assert moves is not None and len(moves) > 0
    assert (data[moves.src] >= 0).all()  # only pages holding bytes move
    data[moves.dst] = data[moves.src]  # what the runner's copy does before the pass
    data[moves.src] = -2  # the sources are free after it
    for r in running:
        assert (data[np.asarray(r.kv_pages)] == expected[r.seq_id]).all(), r.request_id
    if arrays is not None:  # told of every renamed grid, with the pages of the request's new list
        assert arrays.renamed and all(np.array_equal(g, r.kv_pages) for r in running
                                      if (g := arrays.renamed.get(r.seq_id)) is not None)
    # the cached blocks the requests hold name pages of theirs
    assert kv.cache is not None
    held = {p for r in running for row in r.kv_pages for p in row}
    for r in running:
        for j in range(r.num_offered_blocks):
            block = kv.cache.get(r.block_hashes[j])
            if block is not None and block.refs > 0:
                assert set(block.pages) <= held
    alloc.complete_forward()
    alloc.check_invariants()
    kv.check()
    assert alloc.mid_capacity(EXPERT) >= whole_before + 1
    for r in running:
        kv.free(r)
    kv.check()
    assert kv.pages_in_use == 0


def test_nothing_to_compact_moves_nothing() -> None:
    alloc = PageAllocator(GEO, 4)
    kv = KVCacheManager(alloc, num_attention_layers=2, block_size=4)
    assert compact_kv(kv, [], EXPERT, mid_pages=2, max_pages=16) is None
    r = req(1, 16)  # 4 blocks, 8 pages: two full mid pages, nothing free to move them into
    assert kv.allocate(r, 16)
    assert compact_kv(kv, [r], EXPERT, mid_pages=1, max_pages=16) is None
    assert compact_kv(kv, [r], EXPERT, mid_pages=0, max_pages=16) is None
    alloc.check_invariants()


@pytest.mark.parametrize("arch,device", [("qwen2_moe", "cpu"), ("qwen3_5_moe_text", "cpu"), pytest.param(
    "qwen2_moe", "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_an_engine_that_compacts_every_step_gives_the_same_tokens(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch,
                                                                  prefix_caching: bool, arch: str, device: str) -> None:
    """The runtime is made to wait for two whole mid pages at every step, so every step moves the live KV pages of
    the emptiest mid pages (and the runner copies their bytes before the pass: on a GPU, behind the pass in flight
    with async scheduling, and before CUDA graph replays): greedy tokens are the ones of an engine that never
    compacts, with shared prefixes, and no page is left held. A hybrid model's state pages stay where they are."""
    path: Path = tiny_checkpoint(arch)
    base = [[5, 9, 14, 3, 8, 21, 4, 17, 6, 11, 2, 30, 7, 19, 13, 12]]
    batch = [{"prompt_token_ids": base[0] + [40 + i] * (3 + 5 * i)} for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def run(compact: bool) -> tuple[list[list[int]], int]:
        llm = LLM(str(path), gpu_memory_budget="64MiB" if device == "cpu" else "1GiB", device=device,
                  enforce_eager=device == "cpu", max_num_batched_tokens=48, enable_prefix_caching=prefix_caching,
                  dtype="float32")
        if compact:
            monkeypatch.setattr(llm.engine.runtime, "mid_pages_awaited", lambda: 2)
        out = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
        moved = llm.engine.kv_pages_moved
        alloc = llm.engine.pool.allocator
        alloc.check_invariants()
        llm.engine.kv.check()
        assert llm.engine.kv.pages_in_use == 0 and alloc.pending_deferred == 0
        assert llm.stats()["kv_pages_moved"] == moved
        llm.shutdown()
        return out, moved

    plain, none_moved = run(False)
    compacted, moved = run(True)
    assert none_moved == 0 and moved > 0
    assert compacted == plain


def test_a_step_without_a_pass_queues_the_last_compactions_copies(tiny_checkpoint,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The moves of a compaction travel with the next pass; when every request is aborted after a step that
    compacted, the next step has no pass and queues the copies alone. The cached prefix blocks they renamed then
    serve a later request whose greedy tokens are an uncompacted engine's, and no page is left held."""
    path: Path = tiny_checkpoint("qwen2_moe")
    base = [5, 9, 14, 3, 8, 21, 4, 17, 6, 11, 2, 30, 7, 19, 13, 12]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    later = {"prompt_token_ids": base + [33, 34, 35]}

    def engine() -> LLM:
        return LLM(str(path), gpu_memory_budget="64MiB", device="cpu", enforce_eager=True, max_num_batched_tokens=48,
                   enable_prefix_caching=True, dtype="float32")

    plain = engine()
    want = plain.generate([later], params)[0].outputs[0].token_ids
    plain.shutdown()

    llm = engine()
    eng = llm.engine
    monkeypatch.setattr(eng.runtime, "mid_pages_awaited", lambda: 2)
    queued_alone: list[int] = []
    copy_alone = eng._copy_kv
    monkeypatch.setattr(eng, "_copy_kv", lambda moves: (queued_alone.append(len(moves)), copy_alone(moves)))
    for i in range(6):
        eng.add_request(f"r{i}", base + [40 + i] * (3 + 5 * i), params)
    for _ in range(40):
        eng.step()
        if eng._kv_moves is not None and eng.scheduler.running:
            break
    assert eng._kv_moves is not None, "no step compacted"
    moved = len(eng._kv_moves)
    assert eng.pool.allocator.pending_deferred >= moved  # the sources are held past the step's end
    for i in range(6):
        eng.abort_request(f"r{i}")
    eng.step()  # aborts taken in, nothing scheduled: the copies go alone
    assert queued_alone == [moved] and eng._kv_moves is None and not eng.has_unfinished_requests()
    alloc = eng.pool.allocator
    assert alloc.pending_deferred == 0
    alloc.check_invariants()
    eng.kv.check()
    hits = eng.kv.prefix_cache_hits
    got = llm.generate([later], params)[0].outputs[0].token_ids
    assert eng.kv.prefix_cache_hits > hits  # the prefix came from the cache
    assert got == want
    llm.shutdown()
