"""The release rule (memory/pass_fence.py): pages freed while a pass may still read them are written by the copy
stream only behind that pass.

CPU: an elastic engine with async scheduling runs through evictions, grows and load-buffer attaches; every byte
range the allocator frees is stamped with the passes launched by then, and every copy-stream write (a grow's copy,
the load buffers taking pages) must have ordered itself after at least those passes. GPU: the hazard itself — a
pass still reading an evicted expert's pages while a grow copies into them — is seen without the fence and never
with it.
"""

from __future__ import annotations

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.experts.residency import EXPERT


def _tight_elastic(ckpt, limit: int = 2) -> LLM:
    probe = LLM(str(ckpt), gpu_memory_budget="1GiB", max_num_batched_tokens=64, enforce_eager=True, device="cpu")
    split, geo = probe.engine.budget_split, probe.engine.geometry
    per_block = probe.engine.kv.num_layers * geo.size("kv")
    budget = (split["non_expert_weights"] + split["workspace"] + split["experts_resident"] + 10 * per_block
              + geo.huge_size)
    return LLM(str(ckpt), gpu_memory_budget=budget, device="cpu", offload_mode="elastic", offload_access="copy",
               adjuster="paper",
               expert_offload_limit=limit, max_num_batched_tokens=64, async_scheduling=True)


# 8 or more MoE layers: lazy load buffers. The hybrid's requests also free ssm and conv pages (finished, preempted),
# which grows and load buffers may then write: stamped and checked like every other freed page.
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_5_moe_text"])
def test_copy_stream_writes_wait_for_every_pass_that_could_read_their_pages(tiny_checkpoint, arch: str) -> None:
    llm = _tight_elastic(tiny_checkpoint(arch, num_hidden_layers=9))
    engine = llm.engine
    fence, alloc, geo = engine.fence, engine.pool.allocator, engine.geometry
    loader = engine.runtime.loader
    stamps: list[tuple[int, int, int]] = []  # (first byte, end byte, passes launched when the bytes became free)
    deferred: list[tuple[str, int]] = []  # free once the step's pass is launched: stamped at complete_forward

    def stamp(kind: str, ids) -> None:
        size = geo.size(kind)
        stamps.extend((geo.offset(kind, i), geo.offset(kind, i) + size, fence.passes_launched) for i in ids)

    def freeing(free):
        def wrapper(kind: str, ids) -> None:
            ids = list(ids)
            stamp(kind, ids)
            free(kind, ids)
        return wrapper

    def defer(kind: str, ids) -> None:
        ids = list(ids)
        deferred.extend((kind, i) for i in ids)
        defer_free(kind, ids)

    def complete() -> None:
        for kind, i in deferred:
            stamp(kind, [i])
        deferred.clear()
        complete_forward()

    defer_free, complete_forward = alloc.defer_free, alloc.complete_forward
    alloc.defer_free, alloc.complete_forward = defer, complete
    alloc.free_small, alloc.free_mid = freeing(alloc.free_small), freeing(alloc.free_mid)
    checked = {"grow": 0, "attach": 0}

    def must_cover(pages: list[int], what: str) -> None:
        size = geo.size(EXPERT)
        for p in pages:
            start = geo.offset(EXPERT, p)
            need = max((s for a, b, s in stamps if a < start + size and start < b), default=0)
            assert fence.covered >= need, f"{what} writes page {p} freed after pass {need}; waited for {fence.covered}"
        checked[what] += 1

    copy, add_slots = loader.copy_to_pages, loader.add_slots

    def copy_checked(layer: int, expert: int, pages):
        done = copy(layer, expert, pages)
        must_cover(list(pages), "grow")
        return done

    def attach_checked(pages: list[int]) -> None:
        add_slots(pages)
        must_cover(pages, "attach")

    loader.copy_to_pages, loader.add_slots = copy_checked, attach_checked
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    heavy = [{"prompt_token_ids": torch.randint(3, 300, (int(n),), generator=g).tolist()}
             for n in torch.randint(8, 40, (6,), generator=g)]
    light = heavy[:1]
    llm.generate(heavy, params)
    for _ in range(8):  # light traffic: experts come home, the buffers go
        llm.generate(light, params)
        if engine.runtime.cache.all_resident():
            break
    st = llm.stats()
    assert st["expert_evictions"] > 0 and st["expert_grows"] > 0, st
    assert checked["grow"] == st["expert_grows"] and checked["attach"] >= 1, checked
    assert fence.passes_launched == engine.forward_steps
    if engine.state is not None:  # state pages went back while passes ran, and the copy stream reused bytes
        # what is left is the prefix cache's state snapshots
        assert engine.state.num_holders == 0 and alloc.num_used("ssm") == engine.state.num_cached_pages // 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_grow_into_pages_a_running_pass_reads_waits_for_it() -> None:
    from rimuru.experts.cache import ExpertCache
    from rimuru.experts.host_store import HostExpertStore
    from rimuru.experts.loader import ExpertLoader
    from rimuru.experts.residency import ExpertResidency
    from rimuru.memory.allocator import PageAllocator
    from rimuru.memory.geometry import PageGeometry
    from rimuru.memory.pass_fence import PassFence

    dev = torch.device("cuda")
    f, d = 256, 512
    geo = PageGeometry.custom(mid_sizes={EXPERT: f * d * 2}, small_sizes={"kv": 4096})
    alloc = PageAllocator(geo, num_huge_pages=6)
    pool = torch.zeros(6 * geo.huge_size // 2, dtype=torch.bfloat16, device=dev)
    view = pool.view(-1, f * d)
    store = HostExpertStore(1, 2, f, d, torch.bfloat16, pin=True)
    store.layers[0][0].fill_(1.0)
    store.layers[0][1].fill_(2.0)

    def race(fence: PassFence) -> torch.Tensor:
        """Expert 0 is resident; a pass reads it late (the compute stream sleeps first); expert 0 is evicted and
        expert 1 grows into the freed pages while that pass is in flight. Returns what the pass read."""
        residency = ExpertResidency(alloc, 1, 2)
        cache = ExpertCache(residency, view, dev)
        cache.make_resident([(0, 0)])
        cache.load_from_store(store)
        loader = ExpertLoader(cache, store, [], fence)
        torch.cuda.synchronize()
        pages = list(residency.pages_of(0, 0))
        # index and output on the device before the sleep: nothing queued behind it may make the host wait for the
        # stream (a host list index is copied from pageable memory; a new output block can take a cudaMalloc, which
        # may synchronise the device), or the grow below would be issued only after the read and hide the race
        index = torch.tensor(pages, device=dev)
        seen = torch.empty((len(pages), view.shape[1]), dtype=view.dtype, device=dev)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of a pass that reads expert 0 at its end
        torch.index_select(view, 0, index, out=seen)
        fence.pass_launched()
        residency.begin_eviction(0, 0)
        cache.clear_rows(residency.finish_evictions())
        alloc.complete_forward()
        grown = residency.reserve_grow(0, 1)
        assert grown is not None and sorted(grown) == sorted(pages)  # the same pages, handed out again
        loader.copy_to_pages(0, 1, grown)
        torch.cuda.synchronize()
        residency.commit_grows()  # give the pages back for the next run
        residency.begin_eviction(0, 1)
        residency.finish_evictions()
        alloc.complete_forward()
        return seen

    # CUDA loads a kernel lazily at its first launch, and a load may synchronise the context (CUDA's lazy-loading
    # hazards): a first launch between the sleep and the grow (the read, a table fill) would hold the host until
    # the pass ended and hide the race. One run first loads every kernel the race launches.
    race(PassFence(dev))
    unfenced = race(PassFence(dev))  # nobody watches: it records no events, so nothing is waited for
    assert bool((unfenced == 2.0).any()), "the race was not reproduced: the test could not tell a missing fence"
    watched = PassFence(dev)
    watched.watch()
    fenced = race(watched)
    assert bool((fenced == 1.0).all())  # the pass read expert 0 as it was
