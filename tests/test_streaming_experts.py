"""Streaming layers in the offload modes: when a batch routes to nearly every expert, a layer's offloaded
experts are all copied without reading the routing on the host (experts/offload_provider.py). Loading a
superset of the routed experts must not change a token; the decision follows the expected number of unused
loads; elastic evictions and grows keep working with it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.experts import offload_provider
from rimuru.experts.offload_provider import OffloadExpertProvider
from rimuru.testing.reference import hf_greedy, random_prompts, run_greedy

STEPS = 16
PROMPT_LENS = (5, 17, 33, 9, 21, 40)


def _fixed(path: Path, resident: float) -> LLM:
    return LLM(str(path), device="cpu", gpu_memory_budget="64MiB", offload_mode="fixed", offload_access="copy",
               resident_experts=resident)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_streaming_changes_no_token_and_skips_routing_reads(arch: str, parity_checkpoints,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = parity_checkpoints[arch]
    ps = random_prompts(PROMPT_LENS, seed=4)
    ref = hf_greedy(path, ps, STEPS)
    runs = {}
    for label, max_unused in (("never", -1.0), ("always", float("inf")), ("rule", offload_provider.STREAM_MAX_UNUSED)):
        monkeypatch.setattr(offload_provider, "STREAM_MAX_UNUSED", max_unused)
        llm = _fixed(path, 1)
        provider = llm.engine.runtime.provider
        assert isinstance(provider, OffloadExpertProvider)
        assert run_greedy(llm, ps, STEPS) == ref, label
        c = llm.engine.runtime.loader.counters
        runs[label] = (provider.routing_reads, provider.streamed_layers, c.experts_loaded, c.hits + c.misses)
        assert c.experts_loaded == c.on_demand + c.prefetched
    never, always, rule = runs["never"], runs["always"], runs["rule"]
    assert never[0] > 0 and never[1] == 0
    assert always[0] == 0 and always[1] > 0
    # streaming copies every offloaded expert of a layer: at least what the routed-only decisions copied
    assert always[2] >= never[2] and always[3] >= never[3]
    # the rule streams the big prefill steps and reads the routing of the small decode steps
    assert rule[0] > 0 and rule[1] > 0


def test_streaming_decision_follows_expected_unused_loads(parity_checkpoints) -> None:
    llm = _fixed(parity_checkpoints["qwen3_moe"], 2)  # 2 MoE layers, 8 experts, top-2; 6 offloaded per layer
    provider = llm.engine.runtime.provider
    L, E, k = 2, 8, provider.top_k
    assert (provider.cache.num_layers, provider.cache.num_experts, k) == (L, E, 2)
    # uniform: expected unused = 6 * (1 - 2/8)^T <= 0.5  <=>  T >= 9
    for tokens, streams in ((1, False), (8, False), (9, True), (400, True)):
        provider.begin_pass(tokens)
        assert provider.streaming == [streams] * L, tokens
    # a skewed popularity whose offloaded experts are cold: the same batch is not worth streaming
    cold = np.full((L, E), 0.005)
    cold[:, :2] = (1 - 6 * 0.005) / 2  # the two resident experts take nearly all the traffic
    provider.popularity = lambda: cold
    provider.begin_pass(9)
    assert provider.streaming == [False, False]
    provider.begin_pass(400)
    assert provider.streaming == [True, True]  # 6 * (1 - 0.01)^400 = 0.11
    assert provider.loader.counters.prefetched > 0  # layer 0's experts were copied before the pass


def test_elastic_with_streaming_evicts_grows_and_keeps_tokens(parity_checkpoints, monkeypatch) -> None:
    from test_elastic import prompts, tight_pool

    monkeypatch.setattr(offload_provider, "STREAM_MAX_UNUSED", float("inf"))
    path = parity_checkpoints["qwen2_moe"]
    limit = 5
    llm = LLM(str(path), page_pool_memory_bytes=tight_pool(path, kv_blocks=10, limit=limit), device="cpu",
              offload_mode="elastic", offload_access="copy", adjuster="paper", expert_offload_limit=limit,
              max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    heavy, light = prompts(6, seed=1), prompts(2, seed=2)
    got = [o.outputs[0].token_ids for o in llm.generate(heavy, params)]
    got += [o.outputs[0].token_ids for o in llm.generate(light, params)]
    st = llm.stats()
    assert st["expert_evictions"] > 0 and st["expert_grows"] > 0
    provider = llm.engine.runtime.provider
    assert provider.streamed_layers > 0 and provider.routing_reads == 0
    static = LLM(str(path), gpu_memory_budget="64MiB", device="cpu")
    want = [o.outputs[0].token_ids for o in static.generate(heavy + light, params)]
    assert got == want
    assert st["kv_pages_used"] == 0
    llm.engine.pool.allocator.check_invariants()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_piecewise_graphs_stream_without_host_waits(parity_checkpoints, monkeypatch) -> None:
    """Piecewise graphs with streaming layers: the copy stream feeds the load buffers while no boundary reads
    the routing; tokens equal static mode (float32)."""
    path = str(parity_checkpoints["qwen2_moe"])
    ps = random_prompts(PROMPT_LENS, seed=4)
    common = dict(device="cuda", dtype="float32", gpu_memory_budget="1GiB")
    static = run_greedy(LLM(path, enforce_eager=True, **common), ps, STEPS)
    monkeypatch.setattr(offload_provider, "STREAM_MAX_UNUSED", float("inf"))
    llm = LLM(path, offload_mode="fixed", offload_access="copy", resident_experts=1, **common)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.boundaries is not None
    assert run_greedy(llm, ps, STEPS) == static
    provider = llm.engine.runtime.provider
    assert provider.routing_reads == 0 and provider.streamed_layers > 0
    assert llm.engine.runner.graph_steps == llm.engine.forward_steps


@pytest.mark.parametrize("max_unused", [float("inf"), -1.0])  # every layer streams / none does (prefetch by prediction)
def test_a_load_buffer_is_fenced_only_after_the_kernel_it_is_handed_to(parity_checkpoints, monkeypatch,
                                                                         max_unused: float) -> None:
    """A buffer's fence must be recorded on the compute stream after the kernel that reads it: `table(l)` hands the
    buffer it claimed for layer l to a kernel queued once the call returns, so no `fence_consumed` inside the call
    (the next layer's streaming or prefetch) may already count that buffer as consumed. (On the GPU such a fence
    fires before the kernel runs and the copies for layer l+2 overwrite the slots it reads.)"""
    monkeypatch.setattr(offload_provider, "STREAM_MAX_UNUSED", max_unused)
    llm = _fixed(parity_checkpoints["qwen2_moe"], 1)
    provider, loader = llm.engine.runtime.provider, llm.engine.runtime.loader
    calls: list[list] = []  # per table() call running: [its layer, the buffer it claimed for that layer or None]
    early, fences = [], []
    real_fence, real_claim, real_table = loader.fence_consumed, loader.claim, provider.table

    def fence_consumed() -> None:
        fences.append(1)
        if calls and calls[-1][1] is not None and calls[-1][1].consumed:
            early.append(calls[-1][0])
        real_fence()

    def claim(layer: int):
        buf = real_claim(layer)
        if calls and calls[-1][0] == layer:
            calls[-1][1] = buf
        return buf

    def table(layer: int, ids: torch.Tensor) -> torch.Tensor:
        calls.append([layer, None])
        try:
            return real_table(layer, ids)
        finally:
            calls.pop()

    monkeypatch.setattr(loader, "fence_consumed", fence_consumed)
    monkeypatch.setattr(loader, "claim", claim)
    monkeypatch.setattr(provider, "table", table)
    run_greedy(llm, random_prompts(PROMPT_LENS, seed=4), 4)
    assert len(fences) > 0 and (provider.streamed_layers > 0) == (max_unused > 0)
    assert early == [], f"layers whose buffer was fenced before its kernel was queued: {sorted(set(early))}"
