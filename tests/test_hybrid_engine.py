"""The engine serving a hybrid Qwen3.5-MoE model, its per-request state in ssm and conv pages of the pool.

Greedy tokens against transformers' Qwen3_5MoeForCausalLM (float32, CPU; equal except after a near-tie of the
reference's top-2 logits) with chunked prefill (a small max_num_batched_tokens), in static, fixed and elastic
modes, under budgets so tight that experts, KV and state compete for the same pages: requests wait for
evictions, are preempted (and recompute their state) or are aborted mid-prefill and mid-decode. After every run
no page is in use but the experts' and the load buffers', and the allocator's invariants hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.engine.llm_engine import LLMEngine
from rimuru.engine.request import Request
from rimuru.experts.direct_runtime import DirectRuntime
from rimuru.model_spec import FULL_ATTENTION, LINEAR_ATTENTION
from rimuru.testing.pools import CHUNK, assert_nothing_held, tight_budget
from rimuru.testing.reference import assert_greedy_matches, random_prompts

pytest.importorskip("transformers")

ARCH = "qwen3_5_moe_text"
L, F = LINEAR_ATTENTION, FULL_ATTENTION
STEPS = 12


@pytest.fixture(scope="module", params=[("LLLF", False), ("FLL", True)],
                ids=["LLLF-per_expert", "FLL-fused"])
def ckpt(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path]) -> Path:
    pattern, fused = request.param
    if pattern == "LLLF":  # transformers' default rule: full attention when (i + 1) % 4 == 0
        return tiny_checkpoint(ARCH, fused_experts=fused, seed=3)
    types = [F, L, L]
    return tiny_checkpoint(ARCH, fused_experts=fused, seed=3, num_hidden_layers=len(types), layer_types=types)


def greedy(llm: LLM, prompts: list[list[int]], steps: int = STEPS) -> list[list[int]]:
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_static_chunked_prefill_matches_transformers(ckpt: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="rimuru"):
        llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=CHUNK)
    assert llm.engine.kv.cache is not None and llm.engine.state is not None and llm.engine.state.snapshots is not None
    prompts = random_prompts((5, 17, 40, 70, 1), seed=21)  # one page, past a page, chunked, past a delta chunk
    got = greedy(llm, prompts)
    assert_greedy_matches(ckpt, prompts, got, STEPS)
    assert len({t for toks in got for t in toks}) > 5, got  # informative tokens, not one repeated id
    assert_nothing_held(llm.engine)
    # a second batch over pages the first one left: garbage state bytes are never read by a fresh request
    again = greedy(llm, prompts[::-1])
    assert again == got[::-1]
    assert_nothing_held(llm.engine)


def test_static_preempts_and_recomputes_the_state(ckpt: Path) -> None:
    # Room for about three requests' state and first chunks: decoding requests outgrow it and the latest are
    # preempted, their state pages freed and recomputed from their tokens when they run again.
    budget = tight_budget(ckpt, requests=3)
    llm = LLM(str(ckpt), gpu_memory_budget=budget, device="cpu", offload_mode="static",
              max_num_batched_tokens=CHUNK)
    prompts = random_prompts((6, 9, 4, 20, 5), seed=22)  # admitted within a few steps, then all grow
    steps = 40
    got = greedy(llm, prompts, steps)
    assert llm.stats()["preemptions"] > 0
    assert_greedy_matches(ckpt, prompts, got, steps)
    assert_nothing_held(llm.engine)


@pytest.mark.parametrize("access", ["direct", "copy"])
def test_elastic_evicts_experts_for_state_pages(ckpt: Path, access: str) -> None:
    # Every expert fits beside the load buffers (copy access) and about one request: the next requests' state pages
    # are the shortfall the adjuster evicts experts for, and the tokens stay transformers'.
    limit = 5
    budget = tight_budget(ckpt, requests=1, load_buffer_experts=limit if access == "copy" else 0)
    llm = LLM(str(ckpt), gpu_memory_budget=budget, device="cpu", offload_mode="elastic", adjuster="paper",
              expert_offload_limit=limit, max_num_batched_tokens=CHUNK, offload_access=access)
    engine = llm.engine
    start_resident = engine.runtime.cache.num_resident
    assert start_resident == engine.runtime.cache.total_experts
    prompts = random_prompts((12, 30, 7, 21), seed=23)
    got = greedy(llm, prompts)
    st = llm.stats()
    assert st["expert_evictions"] > 0 and st["peak_running"] > 1, st
    assert_greedy_matches(ckpt, prompts, got, STEPS)
    assert_nothing_held(engine)
    static = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=CHUNK)
    assert greedy(static, prompts) == got  # offloading never changes tokens


@pytest.mark.parametrize("access", ["direct", "copy"])
def test_fixed_mode_with_state_in_a_tight_pool(ckpt: Path, access: str) -> None:
    buffers = 4 if access == "copy" else 0
    budget = tight_budget(ckpt, requests=2, load_buffer_experts=buffers, offload_mode="fixed", resident_experts=4,
                          offload_access=access)
    llm = LLM(str(ckpt), gpu_memory_budget=budget, device="cpu", offload_mode="fixed", resident_experts=4,
              max_num_batched_tokens=CHUNK, offload_access=access)
    assert llm.engine.runtime.cache.num_resident == 4 * llm.engine.spec.num_moe_layers
    prompts = random_prompts((19, 6, 28), seed=24)
    got = greedy(llm, prompts)
    if access == "copy":
        assert llm.stats()["expert_bytes_loaded"] > 0
    else:  # the kernel read the offloaded experts in the host store: nothing was copied, no buffer was taken
        assert isinstance(llm.engine.runtime, DirectRuntime) and llm.engine.budget_split["load_buffers"] == 0
    assert_greedy_matches(ckpt, prompts, got, STEPS)
    assert_nothing_held(llm.engine)


def test_aborts_mid_prefill_and_mid_decode_free_the_state(ckpt: Path) -> None:
    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=CHUNK)
    engine = llm.engine
    prompts = random_prompts((40, 8, 33), seed=25)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    engine.step()  # request 0's first chunk: its state pages are taken
    req0 = engine._requests["0"]
    assert len(req0.ssm_pages) == len(engine.spec.linear_layer_ids) and 0 < req0.num_computed_tokens < 40
    engine.abort_request("0")  # mid-prefill
    while engine._requests["1"].num_output_tokens < 3:
        engine.step()
    engine.abort_request("1")  # mid-decode
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert [r for r in ("0", "1") if engine._requests.get(r) is not None and
            not engine._requests[r].status.finished] == []
    assert len(finished["2"]) == STEPS and len(finished["1"]) < STEPS
    assert_greedy_matches(ckpt, [prompts[2]], [finished["2"]], STEPS)
    assert_nothing_held(engine)


def test_a_pool_without_room_for_one_requests_state_is_refused(ckpt: Path) -> None:
    budget = tight_budget(ckpt, requests=0)
    with pytest.raises(ValueError, match="one request's state pages, the pool .* has no room"):
        LLM(str(ckpt), gpu_memory_budget=budget, device="cpu", offload_mode="static", max_num_batched_tokens=CHUNK)
    # one request's worth more: it starts, and its longest context is what is left beside one request's state
    llm = LLM(str(ckpt), gpu_memory_budget=tight_budget(ckpt, requests=2), device="cpu", offload_mode="static",
              max_num_batched_tokens=CHUNK)
    e = llm.engine
    assert e.state is not None
    room = (e.max_kv_pages() - e.state.kv_pages) // e.kv.num_layers * e.config.block_size
    assert e.max_model_len == min(room, e.spec.max_position_embeddings) > 0


def test_the_workspace_profiles_largest_step_runs_a_hybrid_model(ckpt: Path) -> None:
    # What a GPU start-up runs before the pool exists, on the CPU: every sequence's state on page 0 of a one-huge-page
    # scratch pool (the measured step's numbers do not matter, only that it runs and its outputs are finite).
    from rimuru.engine.workspace_profile import _largest_step, _ScratchPool
    from rimuru.memory.geometry import PageGeometry
    from rimuru.model_spec import ModelSpec
    from rimuru.models.loader import init_dummy_weights
    from rimuru.models.registry import build_model

    spec = ModelSpec.from_pretrained(ckpt)
    geo = PageGeometry.for_model(spec, dtype=torch.float32)
    scratch = _ScratchPool(spec, geo, torch.float32, torch.device("cpu"), spec.num_key_value_heads, 16)
    assert scratch.state is not None
    model = build_model(spec, torch.float32, "cpu", scratch.kv_view, scratch.provider)
    init_dummy_weights(model, seed=0)
    scratch.pool.buffer.zero_()
    model.bind_state_cache(scratch.state)
    batch = _largest_step(len(spec.attention_layer_ids), 48, 3, 16, spec.vocab_size, torch.device("cpu"),
                          len(spec.linear_layer_ids))
    with torch.inference_mode():
        hidden = model(batch)
    assert hidden.shape == (48, spec.hidden_size) and bool(torch.isfinite(hidden).all())


# ---------------------------------------------------------------------------------------------- prefix caching
def shared_prefix_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    common = torch.randint(3, 300, (40,), generator=g).tolist()
    exact = torch.randint(3, 300, (32,), generator=g).tolist()
    return [common + torch.randint(3, 300, (k,), generator=g).tolist() for k in (3, 9, 25)] + [exact, exact,
                                                                                               common[:20]]


def one_by_one(llm: LLM, prompts: list[list[int]], steps: int = STEPS) -> list[list[int]]:
    return [greedy(llm, [p], steps)[0] for p in prompts]


class Counted:
    """Prompt tokens the scheduler gave each request to compute (by prompt length), and every step's state copies."""

    def __init__(self, engine: LLMEngine) -> None:
        self.tokens: dict[int, int] = {}
        self.copies: list[tuple[list[int], list[int], list[int], list[int]]] = []
        self.first: dict[int, tuple[list[list[int]], list[int]]] = {}  # KV pages and ssm pages when first scheduled
        sched = engine.scheduler
        schedule = sched.schedule

        def counted():  # noqa: ANN202
            out = schedule()
            for s in out.scheduled:
                n = len(s.request.prompt_token_ids)
                self.tokens[n] = self.tokens.get(n, 0) + max(0, min(s.start + s.num_new_tokens, n) - s.start)
                self.first.setdefault(n, ([list(b) for b in s.request.kv_pages], list(s.request.ssm_pages)))
            self.copies += out.state_copies
            return out

        sched.schedule = counted  # type: ignore[method-assign]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_caching_keeps_the_tokens_and_hits_at_snapshotted_boundaries(ckpt: Path,
                                                                             async_scheduling: bool) -> None:
    args = {"gpu_memory_budget": "64MiB", "device": "cpu", "async_scheduling": async_scheduling}
    off = LLM(str(ckpt), enable_prefix_caching=False, **args)
    assert off.engine.state is not None and off.engine.state.snapshots is None
    on = LLM(str(ckpt), **args)
    ps = shared_prefix_prompts()  # lengths 43, 49, 65, 32, 32, 20: snapshot boundaries 32, 48, 64, 16, 16, 16
    want = one_by_one(off, ps)
    assert off.stats()["prefix_cache_hits"] == 0
    assert_greedy_matches(ckpt, ps, want, STEPS)
    counted = Counted(on.engine)
    assert one_by_one(on, ps) == want
    st = on.stats()
    # the 2nd and 3rd prompts start at the 1st one's snapshot (32), the repeated one at its twin's (16: a hit
    # leaves a token to compute); the common prefix's first 20 tokens reach no snapshotted boundary
    assert st["prefix_cache_hits"] == 32 + 32 + 16
    assert counted.tokens == {43: 43, 49: 49 - 32, 65: 65 - 32, 32: 32 + 16, 20: 20}
    snaps = on.engine.state.snapshots
    assert snaps is not None and snaps.num_snapshots == 5  # at 16, 32, 48 and 64 of the common prefix, 16 of exact
    assert st["state_pages_cached"] == 5 * 2 * len(on.engine.spec.linear_layer_ids)
    assert_nothing_held(on.engine)
    # batched and chunked, sharing blocks and snapshots within a step
    assert greedy(on, ps) == want
    assert greedy(LLM(str(ckpt), max_num_batched_tokens=7, **args), ps) == want
    assert_nothing_held(on.engine)


def test_a_hit_takes_the_cached_blocks_and_a_copy_of_the_snapshot(ckpt: Path) -> None:
    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu")
    eng = llm.engine
    assert eng.state is not None and eng.state.snapshots is not None
    a, other = random_prompts((40, 30), seed=24)
    b = a[:32] + other[:10]  # shares a's first two blocks: a's snapshot boundary (32) is b's too
    c = a[:20] + other[10:30]  # shares one block, short of any snapshotted boundary
    counted = Counted(eng)
    want = one_by_one(LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", enable_prefix_caching=False),
                      [a, b, c])
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": a}, params)[0]
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == want[0]
    assert counted.tokens[40] == 40
    probe = Request("probe", 10**6, None, b, params, STEPS, None)
    name = eng.kv.block_hashes(probe, 2)[-1]
    snap = eng.state.snapshots.get(name)
    assert snap is not None and snap.refs == 0 and snap.num_tokens == 32 and eng.state.snapshots.num_snapshots == 1
    assert counted.copies == [(counted.first[40][1], snap.ssm_pages, counted.copies[0][2], snap.conv_pages)]
    blocks = eng.kv.lookup(probe).blocks
    assert len(blocks) == 2  # a's full blocks 0 and 1 (block 2 was partial)
    second = llm.generate({"prompt_token_ids": b}, params)[0]
    assert second.num_cached_tokens == 32 and second.outputs[0].token_ids == want[1]
    assert counted.tokens[42] == 10
    kv_b, ssm_b = counted.first[42]
    assert kv_b[:2] == [list(blk.pages) for blk in blocks]  # the cached pages themselves
    assert set(ssm_b).isdisjoint(snap.ssm_pages)  # own state pages: a copy, never shared
    assert counted.copies[1] == (snap.ssm_pages, ssm_b, snap.conv_pages, counted.copies[1][3])
    assert snap.refs == 0 and eng.state.snapshots.num_snapshots == 1  # b's boundary is a's: no second snapshot
    third = llm.generate({"prompt_token_ids": c}, params)[0]
    assert third.num_cached_tokens == 0 and counted.tokens[40] == 2 * 40 and third.outputs[0].token_ids == want[2]
    # c's cached KV chain (a's block 0) ended at 16 with no snapshot there: c's prefill snapshots 16 and its own 32
    assert eng.state.snapshots.num_snapshots == 3
    assert eng.state.snapshots.get(eng.kv.block_hashes(probe, 1)[-1]).num_tokens == 16
    assert_nothing_held(eng)
    assert eng.state.snapshots.num_snapshots == 0 and eng.kv.num_cached_pages == 0


def test_a_shared_system_prompt_hits_from_the_third_request(ckpt: Path) -> None:
    """A system prompt of 40 tokens before each user's text: the first request snapshots only its own last boundary;
    the second finds the system prompt's KV blocks cached (two full blocks: 32 tokens) but no state there, computes
    everything and snapshots 32 on its way; every later one starts at 32. Tokens as without prefix caching."""
    system, *users = random_prompts((40, 11, 23, 9, 17), seed=31)
    prompts = [system + u for u in users]
    args = {"gpu_memory_budget": "64MiB", "device": "cpu"}
    want = one_by_one(LLM(str(ckpt), enable_prefix_caching=False, **args), prompts)
    llm = LLM(str(ckpt), **args)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    outs = [llm.generate({"prompt_token_ids": p}, params)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0, 0, 32, 32]
    snaps = llm.engine.state.snapshots
    assert snaps is not None and snaps.num_snapshots == 1 + 2 + 1 + 1  # each prompt's own end, and 32 once
    assert_nothing_held(llm.engine)


@pytest.mark.parametrize("mode", ["static", "elastic"])
def test_snapshots_are_reclaimed_under_pressure_and_nothing_leaks(ckpt: Path, mode: str) -> None:
    # Room for about three requests (one in elastic mode, which then evicts experts): every prompt leaves a snapshot
    # (one request's state) and KV blocks behind, so later requests' state and KV reclaim them, least recently used
    # first, and the tokens stay the same.
    args: dict[str, object] = {"offload_mode": mode, "max_num_batched_tokens": CHUNK, "device": "cpu"}
    if mode == "elastic":
        args.update(adjuster="paper", expert_offload_limit=5, offload_access="direct")
    budget = tight_budget(ckpt, requests=3 if mode == "static" else 1)
    llm = LLM(str(ckpt), gpu_memory_budget=budget, **args)
    off = LLM(str(ckpt), gpu_memory_budget=budget, enable_prefix_caching=False, **args)
    eng = llm.engine
    assert eng.state is not None and eng.state.snapshots is not None
    prompts = random_prompts((33, 40, 21, 50, 37, 45, 29, 60), seed=25)
    prompts += [prompts[0][:32] + [7, 8, 9], prompts[-1]]  # at the oldest snapshot's boundary, and the newest's
    want = one_by_one(off, prompts)
    created = 0
    create = eng.state.snapshots.create

    def counting(*a: object) -> object:
        nonlocal created
        created += 1
        return create(*a)  # type: ignore[arg-type]

    eng.state.snapshots.create = counting  # type: ignore[method-assign]
    # a shortfall (what experts are evicted for) leaves no snapshot unheld but the one the blocked request would
    # start from
    sched, schedule, shortfalls = eng.scheduler, eng.scheduler.schedule, []

    def checked():  # noqa: ANN202
        out = schedule()
        if out.shortfall_pages:
            shortfalls.append(out.shortfall_pages)
            hit = sched._state_prefix(sched.waiting[0], sched.kv.lookup(sched.waiting[0]))[1] if sched.waiting else None
            assert all(s is hit for s in eng.state.snapshots._lru.values())
        return out

    sched.schedule = checked  # type: ignore[method-assign]
    assert one_by_one(llm, prompts) == want
    snaps = eng.state.snapshots
    assert created >= len(prompts) - 2 and snaps.num_snapshots < created  # some were reclaimed
    outs = [llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
            for p in (prompts[-1], prompts[0][:32] + [7, 8, 9])]
    assert outs[0].num_cached_tokens == 48
    assert_nothing_held(eng)
    # batched under the same pressure: preemption, shared prefixes, snapshots taken and reclaimed in one run
    batch = prompts + [p[:40] + [11, 12] for p in prompts[:4]]
    assert greedy(llm, batch) == greedy(off, batch)
    # (the three-layer model's elastic pool is never short: its case checks the tokens and the leaks only)
    assert shortfalls or mode == "elastic"
    if shortfalls and mode == "elastic":
        assert llm.stats()["expert_evictions"] > 0
    assert_nothing_held(eng)


def test_cached_kv_blocks_give_way_to_the_next_requests_state(ckpt: Path) -> None:
    # Waves of new prompts, all at once, in a pool with room for about three requests: each wave's KV blocks stay
    # cached and fill the pool, and the next wave's state pages (ssm mid pages, conv pages) must reclaim them, so
    # as many requests run at once as without the cache (a pool that kept them would admit one at a time).
    budget = tight_budget(ckpt, requests=3)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    peaks: dict[bool, list[int]] = {}
    tokens: dict[bool, list[list[int]]] = {}
    for caching in (False, True):
        llm = LLM(str(ckpt), gpu_memory_budget=budget, device="cpu", max_num_batched_tokens=CHUNK,
                  enable_prefix_caching=caching)
        eng = llm.engine
        peaks[caching], tokens[caching] = [], []
        for wave in range(3):
            eng.peak_running = 0
            prompts = random_prompts([70 + 9 * i for i in range(5)], seed=40 + wave)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            tokens[caching] += [o.outputs[0].token_ids for o in outs]
            peaks[caching].append(eng.peak_running)
        if caching:
            assert eng.kv.num_cached_pages > 0  # the last waves' blocks stayed
        assert_nothing_held(eng)
        llm.shutdown()
    assert tokens[True] == tokens[False]
    assert min(peaks[True][1:]) >= min(peaks[False]) >= 2, peaks
