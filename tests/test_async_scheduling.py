"""Async scheduling (step n+1 launched before step n's tokens are read) gives the same outputs as the
synchronous loop: greedy against transformers, seeded sampling, stop tokens and strings, lengths, chunked
prefill, preemptions and aborts in flight, with no page left behind.

On the CPU the mechanism is the same as on a GPU (the previous step's sampled tokens fill the next step's
input rows with a device-side index copy, and are read one step later); only nothing overlaps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.testing.reference import hf_greedy, random_prompts, run_greedy

STEPS = 24
PROMPT_LENS = (5, 17, 33, 9)


def _llm(path: Path, async_scheduling: bool, **kw: object) -> LLM:
    llm = LLM(str(path), device="cpu", async_scheduling=async_scheduling, **{"gpu_memory_budget": "64MiB", **kw})
    assert llm.engine.async_scheduling is async_scheduling
    return llm


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_async_greedy_matches_transformers_with_chunks_and_preemption(arch: str, parity_checkpoints) -> None:
    path = parity_checkpoints[arch]
    ps = random_prompts(PROMPT_LENS)
    ref = hf_greedy(path, ps, STEPS)
    assert run_greedy(_llm(path, True), ps, STEPS) == ref
    assert run_greedy(_llm(path, True, max_num_batched_tokens=7), ps, STEPS) == ref
    # a pool with room for ~8 KV blocks: running requests are preempted while their next token is in flight
    probe = _llm(path, True, max_num_batched_tokens=16)
    split, geo = probe.engine.budget_split, probe.engine.geometry
    per_block = probe.engine.kv.num_layers * geo.size("kv")
    budget = (split["non_expert_weights"] + split["workspace"] + split["experts_resident"] + 8 * per_block
              + geo.huge_size)
    small = _llm(path, True, gpu_memory_budget=budget, max_num_batched_tokens=16)
    assert run_greedy(small, ps, STEPS) == ref
    assert small.stats()["preemptions"] > 0


def test_async_sampling_stops_and_lengths_match_sync(parity_checkpoints) -> None:
    path = parity_checkpoints["qwen2_moe"]
    sync, asyn = _llm(path, False), _llm(path, True)
    ps = random_prompts(PROMPT_LENS, seed=5)
    greedy = sync.generate({"prompt_token_ids": ps[0]}, SamplingParams(max_tokens=20, temperature=0.0,
                                                                        ignore_eos=True))[0].outputs[0]
    text = greedy.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    params = [
        # seeded sampling draws from the request's own generator: batch-independent, so comparable
        SamplingParams(max_tokens=15, temperature=1.0, top_p=0.9, top_k=40, seed=3, ignore_eos=True),
        # a stop token reached mid-run: the async loop has already launched the next step for it
        SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[greedy.token_ids[6]], ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
    ]
    if stop.strip() and "\ufffd" not in stop:
        params.append(SamplingParams(max_tokens=20, temperature=0.0, stop=[stop], ignore_eos=True))
    prompts = [{"prompt_token_ids": ps[i % len(ps)] if i != 1 and i != 4 else ps[0]} for i in range(len(params))]
    want = sync.generate(prompts, params)
    got = asyn.generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        ow, og = w.outputs[0], g.outputs[0]
        assert (og.token_ids, og.text, og.finish_reason, og.stop_reason) == (
            ow.token_ids, ow.text, ow.finish_reason, ow.stop_reason)
    assert got[1].outputs[0].finish_reason == "stop" and got[2].outputs[0].token_ids == want[2].outputs[0].token_ids
    assert asyn.stats()["kv_pages_used"] == 0
    asyn.engine.pool.allocator.check_invariants()


def test_async_abort_in_flight_leaks_nothing(parity_checkpoints) -> None:
    path = parity_checkpoints["qwen2_moe"]
    llm = _llm(path, True)
    engine = llm.engine
    ps = random_prompts(PROMPT_LENS, seed=9)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params)
    finished: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = (out.outputs[0].finish_reason, out.outputs[0].token_ids)
        steps += 1
        if steps == 4:  # r1 decodes now, with a token in flight
            assert engine._in_flight is not None
            engine.abort_request("r1")
    assert finished["r1"][0] == "abort"
    ref = run_greedy(_llm(path, False), ps, 16)
    for i in (0, 2, 3):
        assert finished[f"r{i}"] == ("length", ref[i])
    assert finished["r1"][1] == ref[1][: len(finished["r1"][1])]
    assert engine.stats()["kv_pages_used"] == 0 and engine._in_flight is None
    engine.pool.allocator.check_invariants()


def test_async_offload_modes_match_sync(parity_checkpoints) -> None:
    """fixed (every routed expert through the load buffers) and elastic (evictions and grows while a pass is in
    flight; routing counts read one step late): the same tokens as the synchronous loop, nothing leaked."""
    from test_elastic import prompts, tight_pool

    path = parity_checkpoints["qwen2_moe"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    heavy, light = prompts(6, seed=1), prompts(2, seed=2)
    pool = tight_pool(path, kv_blocks=10, limit=5)
    outs = {}
    for async_scheduling in (False, True):
        fixed = LLM(str(path), device="cpu", gpu_memory_budget="64MiB", offload_mode="fixed", offload_access="copy",
                    resident_experts=1,
                    async_scheduling=async_scheduling)
        got_fixed = [o.outputs[0].token_ids for o in fixed.generate(heavy, params)]
        elastic = LLM(str(path), device="cpu", page_pool_memory_bytes=pool, offload_mode="elastic",
                      offload_access="copy", adjuster="paper",
                      expert_offload_limit=5, max_num_batched_tokens=64, async_scheduling=async_scheduling)
        assert elastic.engine.async_scheduling is async_scheduling
        assert elastic.engine.runtime.async_steps is async_scheduling
        got_elastic = [o.outputs[0].token_ids for o in elastic.generate(heavy, params)]
        got_elastic += [o.outputs[0].token_ids for o in elastic.generate(light, params)]
        st = elastic.stats()
        assert st["expert_evictions"] > 0 and st["expert_grows"] > 0, st
        assert st["kv_pages_used"] == 0 and fixed.stats()["kv_pages_used"] == 0
        elastic.engine.pool.allocator.check_invariants()
        assert elastic.engine.pool.allocator.pending_deferred == 0
        outs[async_scheduling] = (got_fixed, got_elastic)
    assert outs[True] == outs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_async_scheduling_with_cuda_graphs_matches_sync(arch: str, tmp_path: Path) -> None:
    """On the GPU: decode and mixed CUDA graphs fed by the device-side fill, batches shrinking as requests end
    at different lengths and at a stop token, and an abort while a step is in flight."""
    from rimuru.testing.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(arch, tmp_path / arch, seed=1)
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in (3, 9, 17, 30, 64)]
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    params.append(SamplingParams(max_tokens=12, temperature=1.0, top_p=0.8, seed=4, ignore_eos=True))
    prompts.append(prompts[1])
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(path), device="cuda", dtype="float32", gpu_memory_budget="1GiB", max_num_seqs=16,
                  max_num_batched_tokens=64, async_scheduling=async_scheduling)
        assert llm.engine.async_scheduling is async_scheduling
        outs = llm.generate(prompts, params)
        results.append([o.outputs[0].token_ids for o in outs])
        assert llm.engine.runner.graph_steps > 20 and llm.engine.runner.mixed_graph_steps > 0
        assert llm.stats()["kv_pages_used"] == 0
    assert results[0] == results[1]
    # a stop token met mid-run, and an abort in flight
    engine = llm.engine
    stop = results[1][4][5]
    engine.add_request("stop", prompts[4]["prompt_token_ids"],
                       SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop], ignore_eos=True))
    engine.add_request("abort", prompts[3]["prompt_token_ids"], SamplingParams(max_tokens=30, ignore_eos=True))
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        steps += 1
        if steps == 5:
            engine.abort_request("abort")
    assert done["stop"] == results[1][4][: results[1][4].index(stop) + 1]
    assert engine.stats()["kv_pages_used"] == 0 and engine._in_flight is None
    engine.pool.allocator.check_invariants()
