"""Prefix caching in the unified pool: exact page ids of hits, LRU reclaim for KV and whole mid pages for experts,
no leak, and identical engine outputs with it on and off.

Geometry (as tests/test_scheduler.py): an expert (mid) page is 64 B and a KV (small) page 16 B, so a mid page
holds 4 KV pages and a huge page is one mid page. Two attention layers, block_size 4: a block of 4 tokens is 2
KV pages (one per layer), so one mid page holds 2 blocks.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.config import EngineConfig, add_engine_args
from rimuru.engine.kv_cache_manager import KVCacheManager
from rimuru.engine.prefix_cache import ROOT, hash_block
from rimuru.engine.request import Request, RequestStatus
from rimuru.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from rimuru.experts.residency import EXPERT, ExpertResidency
from rimuru.memory.allocator import PageAllocator
from rimuru.memory.geometry import PageGeometry

GEO = PageGeometry.custom(mid_sizes={"expert": 64}, small_sizes={"kv": 16})


def make(num_huge: int, budget: int = 64, reclaimable: int | None = None) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(PageAllocator(GEO, num_huge), num_attention_layers=2, block_size=4,
                        enable_prefix_caching=True)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget,
                  reclaimable=None if reclaimable is None else (lambda: reclaimable))
    return s, kv


def req(i: int, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(request_id=f"r{i}", seq_id=i, prompt=None, prompt_token_ids=list(tokens),
                   params=SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens, eos_token_id=None)


def advance(sched) -> None:
    """What the engine does after a forward pass: count computed tokens, append sampled ones."""
    for s in sched.scheduled:
        s.request.num_computed_tokens = s.start + s.num_new_tokens
        if s.samples:
            s.request.output_token_ids.append(7)


def run_prefill(s: Scheduler, r: Request) -> list[tuple[int, int, int]]:
    """Admits `r` alone, runs its prefill step, finishes it; returns (start, new tokens, cached writes)."""
    s.add(r)
    out = s.schedule()
    chunks = [(x.start, x.num_new_tokens, x.num_cached_writes) for x in out.scheduled]
    advance(out)
    s.finish(r, RequestStatus.FINISHED_STOPPED)
    return chunks


def check(kv: KVCacheManager) -> None:
    kv.allocator.check_invariants()
    kv.check()


def test_block_names_chain_the_prefix() -> None:
    a = hash_block(ROOT, [1, 2, 3, 4])
    assert a == hash_block(ROOT, [1, 2, 3, 4]) and len(a) == 32
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(ROOT, [1, 2, 3, 5]), [5, 6, 7, 8])
    assert hash_block(ROOT, [1, 2, 3, 4]) != hash_block(ROOT, [1, 2, 3, 4 + 2**32])  # int64, not truncated


def test_hit_takes_the_first_requests_pages_and_computes_only_the_tail() -> None:
    s, kv = make(num_huge=8)
    prompt = list(range(1, 11))  # 10 tokens: blocks 0 and 1 full, block 2 holds 2
    a = req(0, prompt)
    assert run_prefill(s, a) == [(0, 10, 0)]
    # a's full blocks stay cached (mid page 0: pages 0..3); its partial block 2 (pages 4, 5) was freed
    assert kv.pages_in_use == 0 and kv.num_cached_pages == 4 and kv.allocator.num_used("kv") == 4
    assert kv.capacity_pages() == 32  # cached pages count as free
    check(kv)
    b = req(1, prompt)
    s.add(b)
    out = s.schedule()
    assert [(x.start, x.num_new_tokens, x.num_cached_writes) for x in out.scheduled] == [(8, 2, 0)]
    assert b.kv_pages == [[0, 1], [2, 3], [4, 5]]  # a's two blocks, then one new block
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)
    assert kv.pages_in_use == 6 and kv.num_cached_pages == 0
    check(kv)
    advance(out)
    s.finish(b, RequestStatus.FINISHED_STOPPED)
    assert kv.pages_in_use == 0 and kv.num_cached_pages == 4
    check(kv)


def test_partial_hit_stops_at_the_first_block_that_differs() -> None:
    s, kv = make(num_huge=8)
    run_prefill(s, req(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    c = req(1, [1, 2, 3, 4, 50, 6, 7, 8, 9])  # block 1 differs in one token: block 0 only
    s.add(c)
    out = s.schedule()
    assert [(x.start, x.num_new_tokens) for x in out.scheduled] == [(4, 5)]
    assert c.kv_pages[0] == [0, 1] and c.num_cached_tokens == 4
    # blocks after a difference never hit, even with equal tokens: a block's name is its whole prefix
    d = req(2, [9, 9, 9, 9, 5, 6, 7, 8, 9])
    s.add(d)
    out = s.schedule()
    assert [(x.request.request_id, x.start) for x in out.scheduled if x.request is d] == [("r2", 0)]
    check(kv)


def test_full_hit_recomputes_exactly_one_token_without_writing_it() -> None:
    s, kv = make(num_huge=8)
    prompt = list(range(1, 9))  # 8 tokens: exactly 2 blocks
    a = req(0, prompt)
    run_prefill(s, a)
    b = req(1, prompt)
    s.add(b)
    out = s.schedule()
    # every block is cached: the last token is computed again (the first sampled token needs its logits), and its
    # KV, already in the shared page, is not written
    assert [(x.start, x.num_new_tokens, x.num_cached_writes, x.samples) for x in out.scheduled] == [
        (7, 1, 1, True)]
    assert b.kv_pages == [[0, 1], [2, 3]] and kv.pages_in_use == 4  # no new page
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (16, 7)
    advance(out)
    # decoding goes on in a new block
    out = s.schedule()
    assert [(x.start, x.num_new_tokens, x.num_cached_writes) for x in out.scheduled] == [(8, 1, 0)]
    assert b.kv_pages == [[0, 1], [2, 3], [4, 5]]
    check(kv)


def test_requests_running_together_share_blocks_and_the_last_one_out_caches_them() -> None:
    s, kv = make(num_huge=8)
    prompt = list(range(1, 10))
    a = req(0, prompt)
    s.add(a)
    advance(s.schedule())  # a's prompt blocks are offered as its prefill is scheduled
    b = req(1, prompt)
    s.add(b)
    out = s.schedule()
    assert [(x.request.request_id, x.start) for x in out.scheduled] == [("r0", 9), ("r1", 8)]
    assert b.kv_pages[:2] == a.kv_pages[:2] == [[0, 1], [2, 3]]
    assert kv.pages_in_use == 8  # 2 shared blocks once, each request's own third block
    advance(out)
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    assert kv.num_cached_pages == 0 and kv.pages_in_use == 6  # b still holds the shared blocks
    s.finish(b, RequestStatus.FINISHED_STOPPED)
    assert kv.num_cached_pages == 4 and kv.pages_in_use == 0
    check(kv)


def test_cached_blocks_are_reclaimed_lru_before_a_kv_allocation_fails() -> None:
    s, kv = make(num_huge=4)  # 16 KV pages = 8 blocks
    for i, base in enumerate((10, 20, 30)):  # 8-token prompts: 2 blocks = one mid page each (0, 1, 2)
        run_prefill(s, req(i, [base + t for t in range(8)]))
    assert kv.num_cached_pages == 12 and kv.allocator.free_small_capacity("kv") == 4
    # 16 tokens need 4 blocks (8 pages): the 4 free pages, then the least recently used cached blocks: r0's (its
    # tail block first), which empties mid page 0
    d = req(3, list(range(100, 116)))
    s.add(d)
    out = s.schedule()
    assert out.shortfall_pages == 0 and d.kv_pages == [[0, 1], [2, 3], [12, 13], [14, 15]]
    assert kv.num_cached_pages == 8
    check(kv)
    # r1's and r2's blocks are still there
    assert kv.lookup(req(9, [20 + t for t in range(8)])).num_tokens == 7
    # more than free + cached pages: nothing is reclaimed, the shortfall is what even the cache cannot give
    e = req(4, list(range(200, 240)))  # 10 blocks = 20 pages; 8 can be had
    s.add(e)
    out = s.schedule()
    assert out.shortfall_pages == 12 and kv.num_cached_pages == 8 and e.kv_pages == []
    check(kv)


def test_cached_pages_go_before_experts_are_evicted() -> None:
    # the runtime could evict experts for plenty of pages; cached pages must serve first: no stall, no shortfall
    s, kv = make(num_huge=2, reclaimable=100)  # 8 KV pages
    run_prefill(s, req(0, list(range(1, 9))))
    run_prefill(s, req(1, list(range(11, 19))))
    assert kv.num_cached_pages == 8 and kv.allocator.free_small_capacity("kv") == 0
    r = req(2, list(range(21, 33)))  # 3 blocks = 6 pages
    s.add(r)
    out = s.schedule()
    assert [x.request for x in out.scheduled] == [r] and out.shortfall_pages == 0 and not out.stalled
    check(kv)


def test_experts_take_whole_mid_pages_emptied_of_cached_blocks_lru_first() -> None:
    s, kv = make(num_huge=4)
    alloc = kv.allocator
    run_prefill(s, req(0, list(range(1, 9))))  # mid page 0: two cached blocks (pages 0..3)
    run_prefill(s, req(1, [21, 22, 23, 24]))  # mid page 1: one cached block (pages 4, 5); 6, 7 free
    live = req(2, [31, 32, 33])  # a running request takes the free pages 6, 7 of mid page 1: it is not whole
    s.add(live)
    s.schedule()
    assert live.kv_pages == [[6, 7]]
    # mid page 0 holds cached blocks alone; 2 and 3 are free
    assert alloc.free_mid_capacity(EXPERT) == 2 and alloc.mid_capacity(EXPERT) == 3
    residency = ExpertResidency(alloc, num_layers=1, num_experts=2)
    assert residency.reserve_grow(0, 0) == (0, 2, 3)  # free mid pages 2 and 3, then mid page 0 emptied
    assert kv.num_cached_pages == 2 and kv.lookup(req(9, list(range(1, 9)))).num_tokens == 0
    assert alloc.mid_capacity(EXPERT) == 0 and residency.reserve_grow(0, 1) is None  # mid page 1 is not whole
    check(kv)
    # once the running request ends (its partial block freed), mid page 1 holds r1's cached block alone: whole
    live.num_computed_tokens = 3
    s.finish(live, RequestStatus.FINISHED_STOPPED)
    assert alloc.mid_capacity(EXPERT) == 1 and kv.num_cached_pages == 2
    check(kv)


def test_the_elastic_adjuster_sees_cached_pages_as_free_and_grows_into_them() -> None:
    # 1 MoE layer x 4 experts, 2 resident (mid pages 0..5), load buffers held for good at limit 2 (6..17); twelve
    # finished requests left one mid page of cached blocks each (18..29). The paper's rules: fewer than 2 free mid
    # pages -> evict one; more than 9 -> grow. Counted without the cache nothing is free (an eviction); counted as
    # free, 12 whole mid pages: one grow, into the three least recently used requests' mid pages
    from rimuru.experts.adjuster import PaperAdjuster
    from rimuru.experts.elastic_core import ElasticCore
    from rimuru.experts.popularity import ExpertPopularity, OnlinePopularity
    from rimuru.experts.runtime import StepDemand

    s, kv = make(num_huge=30)
    alloc = kv.allocator
    residency = ExpertResidency(alloc, num_layers=1, num_experts=4)
    residency.place(residency.prefix(2))
    core = ElasticCore(residency, PaperAdjuster(), OnlinePopularity(ExpertPopularity.uniform("m", 1, 4)), 2, 4)
    assert core.place_start(2) == list(range(6, 18))
    for i in range(12):
        run_prefill(s, req(i, [100 * i + t for t in range(8)]))
    assert alloc.free_mid_capacity(EXPERT) == 0 and kv.num_cached_pages == 48
    state = core.state(StepDemand())
    assert state.free_mid_pages == 12 and state.kv_mid_pages == 0
    moves = core.plan(StepDemand())
    assert moves.evict == [] and [pages for _, pages in moves.grow] == [(18, 19, 20)]
    assert kv.num_cached_pages == 36 and kv.lookup(req(99, list(range(8)))).num_tokens == 0
    check(kv)
    residency.check()


def test_mid_pages_are_emptied_least_recently_used_first() -> None:
    s, kv = make(num_huge=3)
    for i, base in enumerate((10, 20, 30)):  # mid pages 0, 1, 2, released in that order
        run_prefill(s, req(i, [base + t for t in range(8)]))
    run_prefill(s, req(3, [10 + t for t in range(8)]))  # r0's blocks are used again: mid page 0 is the newest
    assert kv.allocator.allocate_mid(EXPERT, 1) == [1]
    assert kv.allocator.allocate_mid(EXPERT, 1) == [2]
    assert kv.lookup(req(9, [10 + t for t in range(8)])).num_tokens == 7
    check(kv)


def test_no_page_leaks_under_preemption_and_shared_prefixes() -> None:
    rng = random.Random(3)
    s, kv = make(num_huge=6, budget=16)  # 24 KV pages: preemption happens
    alloc = kv.allocator
    start = alloc.stats()
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice((4, 8, 11)))] for _ in range(3)]
    reqs = []
    for i in range(30):
        tail = [rng.randrange(1, 50) for _ in range(rng.randrange(0, 7))]
        r = req(i, rng.choice(prefixes) + tail or [1], max_tokens=rng.randrange(1, 10))
        reqs.append(r)
        s.add(r)
    steps = 0
    while s.has_unfinished():
        steps += 1
        assert steps < 2000
        out = s.schedule()
        advance(out)
        for x in out.scheduled:
            r = x.request
            if x.samples and r.num_output_tokens >= r.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
        check(kv)
    assert s.num_preemptions > 0 and kv.prefix_cache_hits > 0
    assert kv.pages_in_use == 0 and kv.num_cached_pages == alloc.num_used("kv")
    assert kv.reset_prefix_cache() > 0
    check(kv)
    assert alloc.stats() == start  # back to where it started: every huge page free


def test_prefix_caching_off_frees_at_once() -> None:
    kv = KVCacheManager(PageAllocator(GEO, 4), num_attention_layers=2, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = list(range(1, 9))
    run_prefill(s, req(0, prompt))
    assert kv.allocator.num_used("kv") == 0 and kv.cache is None
    b = req(1, prompt)
    assert run_prefill(s, b) == [(0, 8, 0)] and b.num_cached_tokens == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def test_flag_is_vllms() -> None:
    parser = add_engine_args(argparse.ArgumentParser())
    assert EngineConfig.from_cli_args(parser.parse_args(["m"])).enable_prefix_caching is True
    args = parser.parse_args(["m", "--no-enable-prefix-caching"])
    assert EngineConfig.from_cli_args(args).enable_prefix_caching is False
    assert parser.parse_args(["m", "--enable-prefix-caching"]).enable_prefix_caching is True


def test_simulator_keeps_prefix_caching_off() -> None:
    # the simulator's prompts carry no real tokens (all zeros), so a cache would hit on everything: it shares the
    # KV cache manager with prefix caching off
    import numpy as np

    from rimuru.experts.popularity import ExpertPopularity
    from rimuru.model_spec import ModelSpec
    from rimuru.sim.cost_model import HardwareConfig
    from rimuru.sim.simulator import SimConfig, SimRequest, Simulation, plan_memory

    spec = ModelSpec.from_hf_config({
        "model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
        "intermediate_size": 128, "max_position_embeddings": 4096})
    probe = SimConfig(mode="elastic", budget_bytes=1 << 40, max_num_seqs=64, max_num_batched_tokens=512)
    mem = plan_memory(spec, probe)
    cfg = SimConfig(mode="elastic", budget_bytes=mem.non_expert_weights + mem.workspace + 72 * 8192,
                    max_num_seqs=64, max_num_batched_tokens=512, hardware=HardwareConfig(step_overhead_s=0.01),
                    adjuster_kind="paper", expert_offload_limit=4)
    sim = Simulation(spec, ExpertPopularity.zipf("tiny", 2, 8, exponent=1.0, seed=0), cfg)
    assert sim.kv.cache is None and sim.allocator.reclaimer is None
    rng = np.random.default_rng(0)
    reqs = [SimRequest(int(rng.integers(8, 80)), int(rng.integers(4, 60)), 0.005 * i) for i in range(40)]
    res = sim.run(reqs)
    assert res.output_tokens == sum(r.output_len for r in reqs)
    assert res.final_pages["kv_pages"] == res.final_pages["kv_pages_tracked"] == 0


# ---------------------------------------------------------------------------------------------- the engine
def shared_prefix_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    common = torch.randint(3, 300, (40,), generator=g).tolist()
    exact = torch.randint(3, 300, (32,), generator=g).tolist()  # 2 blocks of 16: a full hit when sent again
    return [common + torch.randint(3, 300, (k,), generator=g).tolist() for k in (3, 9, 25)] + [exact, exact,
                                                                                               common[:20]]


def greedy(llm: LLM, prompts: list[list[int]], one_by_one: bool) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    if one_by_one:
        outs = [llm.generate({"prompt_token_ids": p}, params)[0] for p in prompts]
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.stats()["kv_pages_used"] == 0
    llm.engine.pool.allocator.check_invariants()
    llm.engine.kv.check()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_tokens_equal_with_prefix_caching_on_and_off(parity_checkpoints: dict[str, Path],
                                                            async_scheduling: bool) -> None:
    path = str(parity_checkpoints["qwen3_moe"])
    args = {"gpu_memory_budget": "64MiB", "device": "cpu", "async_scheduling": async_scheduling}
    off = LLM(path, enable_prefix_caching=False, **args)
    on = LLM(path, **args)
    ps = shared_prefix_prompts()
    want = greedy(off, ps, one_by_one=True)
    assert off.stats()["prefix_cache_hits"] == 0
    assert greedy(on, ps, one_by_one=True) == want
    st = on.stats()
    # hits: 32 tokens of the common prefix for the 2nd and 3rd prompts, 31 for the repeated one (its last token
    # is recomputed), 16 for the prefix's first 20 tokens
    assert st["prefix_cache_hits"] == 32 + 32 + 31 + 16
    assert st["prefix_cache_queries"] == sum(len(p) for p in ps)
    assert st["kv_pages_cached"] > 0 and st["kv_pages_free"] == on.engine.kv.capacity_pages()
    # batched, with everything cached now; then chunked prefills that reach cached blocks mid-prompt
    assert greedy(on, ps, one_by_one=False) == want
    chunked = LLM(path, max_num_batched_tokens=7, **args)
    assert greedy(chunked, ps, one_by_one=False) == want


def test_a_hit_never_writes_the_shared_pages_and_reports_cached_tokens(parity_checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(parity_checkpoints["qwen2_moe"]), gpu_memory_budget="64MiB", device="cpu")
    eng = llm.engine
    prompt = shared_prefix_prompts()[3]  # 32 tokens
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert first.num_cached_tokens == 0
    blocks = eng.kv.lookup(Request("probe", 10**6, None, prompt, params, 6, None)).blocks
    pages = [p for b in blocks for p in b.pages]
    assert len(blocks) == 2 and len(pages) == 2 * eng.kv.num_layers
    # the pool's bytes as the model's KV view reads them (float32 on the CPU)
    view = eng.pool.kv_view(eng.spec.num_key_value_heads, eng.spec.head_dim, torch.float32, eng.config.block_size)
    before = view[pages].clone()
    # the runner computes a full hit's last token without writing its KV into the shared page
    probe = Request("probe", 10**6, None, prompt, params, 6, None)
    probe.kv_pages = [list(b.pages) for b in blocks]
    for cached_writes, slot in ((1, -1), (0, blocks[1].pages[0] * eng.config.block_size + 15)):
        h = eng.runner.host_arrays(SchedulerOutput(scheduled=[ScheduledRequest(probe, 31, 1, cached_writes)]))
        assert h.slot_mapping.shape[1] == 1 and int(h.slot_mapping[0, 0]) == slot
    again = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert again.num_cached_tokens == 31 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert torch.equal(view[pages], before)
    # after every request ended and the cache is cleared, the pool is as it started
    assert llm.reset_prefix_cache() == len(pages)
    assert eng.pool.allocator.num_used("kv") == 0
    eng.pool.allocator.check_invariants()
