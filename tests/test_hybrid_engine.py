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
from rimuru.experts.direct_runtime import DirectRuntime
from rimuru.experts.residency import EXPERT
from rimuru.memory.geometry import CONV, SSM
from rimuru.model_spec import FULL_ATTENTION, LINEAR_ATTENTION
from rimuru.testing.reference import assert_greedy_matches, random_prompts

pytest.importorskip("transformers")

ARCH = "qwen3_5_moe_text"
L, F = LINEAR_ATTENTION, FULL_ATTENTION
STEPS = 12
CHUNK = 16  # max_num_batched_tokens: every prompt longer than this is prefilled in chunks


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


def assert_nothing_held(engine: LLMEngine) -> None:
    """No request holds a page: KV, ssm and conv pages all back; only experts (and load buffers) remain."""
    alloc = engine.pool.allocator
    alloc.check_invariants()
    assert alloc.pending_deferred == 0
    assert alloc.num_used("kv") == 0 and engine.kv.pages_in_use == 0
    assert alloc.num_used(SSM) == 0 and alloc.num_used(CONV) == 0
    assert engine.state is not None and engine.state.num_holders == 0
    engine.state.check()
    st = engine.stats()
    assert st["state_bytes_used"] == 0 and st["kv_bytes_used"] == 0 and st["running"] == st["waiting"] == 0
    assert st["expert_bytes_used"] + st["free_bytes"] == st["pool_bytes"]


def tight_budget(ckpt: Path, requests: int, load_buffer_experts: int = 0, **args: object) -> int:
    """A budget holding every expert, `load_buffer_experts` load-buffer slots, and the state plus the first
    CHUNK-token KV of about `requests` requests (sizes from a probe engine with the same batch limits)."""
    probe = LLM(str(ckpt), gpu_memory_budget="1GiB", device="cpu", max_num_batched_tokens=CHUNK, **args)
    e = probe.engine
    split, geo = e.budget_split, e.geometry
    experts = 3 * e.runtime.cache.total_experts * geo.size(EXPERT)
    buffers = 2 * 3 * load_buffer_experts * geo.size(EXPERT)
    assert e.state is not None
    per_request = e.state.request_bytes + e.kv.blocks_for(CHUNK) * e.kv.num_layers * geo.size("kv")
    budget = split["non_expert_weights"] + split["workspace"] + experts + buffers + requests * per_request
    del probe
    return budget + geo.huge_size


def test_static_chunked_prefill_matches_transformers(ckpt: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="rimuru"):
        llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=CHUNK)
    assert "prefix caching is off" in caplog.text and llm.engine.kv.cache is None
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
