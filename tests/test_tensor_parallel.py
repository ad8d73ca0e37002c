"""Tensor parallelism: two ranks on the CPU (gloo, float32) serve the tokens one rank does, and transformers does.

Every engine test starts a real worker process (spawn), so each costs the worker's start-up (~10 s on two cores):
they are marked slow. The GPU tests run the same on two GPUs over NCCL.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from rimuru import LLM
from rimuru.config import EngineConfig
from rimuru.distributed.parallel_state import SINGLE, TensorParallel
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.tp_workers import PassPlan, WorkerFailed
from rimuru.memory.geometry import PageGeometry
from rimuru.model_spec import load_model_spec
from rimuru.models.layers import MergedLinear
from rimuru.models.loader import init_dummy_weights
from rimuru.models.parallel_linear import Shard, kv_head_shard, param_shards, rank_shard
from rimuru.models.registry import build_model
from rimuru.testing.reference import assert_greedy_matches, random_prompts, run_greedy
from rimuru.testing.tiny_models import ARCHS

STEPS = 8
PROMPT_LENS = (5, 17, 33)
slow = pytest.mark.slow
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENS)


# ---------------------------------------------------------------- units (no processes)

def test_a_shard_is_its_chunk_of_the_full_tensor() -> None:
    full = torch.arange(24.0).view(4, 6)
    assert torch.equal(Shard(0, 2, 1).take(full), full[2:])
    assert torch.equal(Shard(1, 3, 0).take(full), full[:, :2])
    assert Shard(1, 3, 0).full_shape((4, 2)) == (4, 6)
    assert rank_shard(SINGLE, 0) is None


def test_kv_heads_are_split_or_replicated() -> None:
    # 4 KV heads on 2 ranks: two each; 2 KV heads on 4 ranks: each head on two consecutive ranks
    assert kv_head_shard(TensorParallel(rank=1, size=2), 4) == (2, Shard(0, 2, 1))
    assert [kv_head_shard(TensorParallel(rank=r, size=4), 2)[1] for r in range(4)] == [
        Shard(0, 2, 0), Shard(0, 2, 0), Shard(0, 2, 1), Shard(0, 2, 1)]
    with pytest.raises(ValueError, match="multiple of num_key_value_heads=3"):
        kv_head_shard(TensorParallel(rank=0, size=4), 3)


def test_single_rank_collectives_are_the_identity() -> None:
    x = torch.randn(3, 4)
    assert SINGLE.all_reduce(x) is x and SINGLE.all_gather(x) is x and SINGLE.broadcast_object(7) == 7


def test_page_geometry_sizes_pages_per_rank(parity_checkpoints: dict[str, Path]) -> None:
    spec = load_model_spec(str(parity_checkpoints["qwen2_moe"]))
    one, two = (PageGeometry.for_model(spec, dtype=torch.float32, tp_size=n) for n in (1, 2))
    assert two.size("expert") * 2 == one.size("expert")
    assert two.size("kv") * 2 == one.size("kv") and two.kv_heads_per_rank == 1


def test_unsupported_combinations_are_refused_by_name(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(model="unused", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="offload_access='copy' is not supported with tensor_parallel_size > 1"):
        EngineConfig(model="unused", tensor_parallel_size=2, offload_mode="fixed", offload_access="copy")
    # refused before any worker starts
    with pytest.raises(ValueError, match="not supported for qwen3_5_moe_text"):
        LLM(str(tiny_checkpoint("qwen3_5_moe_text")), device="cpu", tensor_parallel_size=2)


def test_dummy_weights_of_a_rank_are_its_slice_of_one_ranks(parity_checkpoints: dict[str, Path]) -> None:
    """Dummy weights draw each full tensor and keep the rank's slice: replicated weights agree on every rank, and
    cut ones are the single-rank model's (no process group is needed to build and fill a rank's model)."""
    spec = load_model_spec(str(parity_checkpoints["qwen2_moe"]))
    kv = torch.empty(0)
    one = build_model(spec, torch.float32, "cpu", kv)
    init_dummy_weights(one, seed=3)
    rank = build_model(spec, torch.float32, "cpu", kv, tp=TensorParallel(rank=1, size=2))
    init_dummy_weights(rank, seed=3)
    full = dict(one.named_parameters())
    cuts = param_shards(rank)
    merged = {f"{n}.{s}": m for n, m in rank.named_modules() if isinstance(m, MergedLinear) for s in ("weight", "bias")}
    for name, p in rank.named_parameters():
        want = full[name]
        if name in cuts:
            want = cuts[name].take(want)
        elif name in merged:
            want = merged[name].local_of_full(want)
        assert torch.equal(p, want), name
    assert rank.model.layers[0].self_attn.num_heads == 2 and rank.lm_head.weight.shape[0] == spec.vocab_size // 2


# ---------------------------------------------------------------- two ranks

def serve_both(path: Path, steps: int = STEPS, ps: list[list[int]] | None = None,
               **kwargs: object) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of one rank and of two, on the same engine settings (each run leaves no page in use)."""
    ps = ps if ps is not None else prompts()
    kwargs = {"device": "cpu", "gpu_memory_budget": "64MiB", **kwargs}
    one = LLM(str(path), **kwargs)
    want = run_greedy(one, ps, steps)
    one.shutdown()
    two = LLM(str(path), tensor_parallel_size=2, **kwargs)
    try:
        got = run_greedy(two, ps, steps)
    finally:
        two.shutdown()
    return want, got


@slow
@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_serve_the_tokens_of_one_and_of_transformers(arch: str, parity_checkpoints: dict[str, Path]) -> None:
    """Static mode, every architecture (mixtral and olmoe checkpoints hold fused experts, the others per expert)."""
    path = parity_checkpoints[arch]
    want, got = serve_both(path, offload_mode="static")
    assert got == want
    assert_greedy_matches(path, prompts(), got, STEPS)


@slow
def test_kv_heads_replicated_past_their_count(tiny_checkpoint) -> None:
    """One KV head on two ranks: both hold it; OLMoE's full-width k norm then counts it on both."""
    path = tiny_checkpoint("olmoe", num_key_value_heads=1, seed=5)
    want, got = serve_both(path)
    assert got == want
    assert_greedy_matches(path, prompts(), got, STEPS)


@slow
def test_fixed_mode_reads_each_ranks_slice_of_the_offloaded_experts(parity_checkpoints: dict[str, Path]) -> None:
    want, got = serve_both(parity_checkpoints["qwen2_moe"], offload_mode="fixed", resident_experts=3)
    assert got == want


def tight_budget(path: Path, kv_blocks: int, tp_size: int) -> int:
    """A CPU budget whose pool holds every expert and `kv_blocks` KV blocks of one rank of `tp_size`."""
    spec = load_model_spec(str(path))
    probe = LLM(str(path), device="cpu", gpu_memory_budget="64MiB", max_num_batched_tokens=64)
    split = probe.engine.budget_split
    probe.shutdown()
    geo = PageGeometry.for_model(spec, dtype=torch.float32, tp_size=tp_size)
    experts = 3 * spec.num_moe_layers * spec.num_experts * geo.size("expert")
    kv = kv_blocks * len(spec.attention_layer_ids) * geo.size("kv")
    return split["non_expert_weights"] + split["workspace"] + experts + kv + geo.huge_size


@slow
def test_elastic_mode_moves_the_same_experts_on_both_ranks(parity_checkpoints: dict[str, Path]) -> None:
    """Rank 0's evictions and grows reach rank 1 as its expert tables; tokens equal one rank's (static mode), with
    chunked prefills (64-token steps) on the way."""
    path = parity_checkpoints["qwen2_moe"]
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in torch.randint(8, 40, (6,), generator=g)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    one = LLM(str(path), device="cpu", gpu_memory_budget="64MiB", max_num_batched_tokens=64)
    want = [o.outputs[0].token_ids for o in one.generate([{"prompt_token_ids": p} for p in ps], params)]
    one.shutdown()
    two = LLM(str(path), device="cpu", tensor_parallel_size=2, gpu_memory_budget=tight_budget(path, 10, 2),
              offload_mode="elastic", adjuster="paper", expert_offload_limit=5, max_num_batched_tokens=64)
    try:
        got = [o.outputs[0].token_ids for o in two.generate([{"prompt_token_ids": p} for p in ps], params)]
        light = [o.outputs[0].token_ids for o in two.generate([{"prompt_token_ids": p} for p in ps[:1]], params)]
        st = two.stats()
        assert st["expert_evictions"] > 0 and st["expert_grows"] > 0, st
        assert st["kv_pages_used"] == 0
        two.engine.pool.allocator.check_invariants()
    finally:
        two.shutdown()
    assert got == want and light == want[:1]


@slow
def test_preempted_requests_recompute_the_same_tokens(parity_checkpoints: dict[str, Path]) -> None:
    path = parity_checkpoints["qwen3_moe"]
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(3, 300, (30,), generator=g).tolist() for _ in range(4)]
    budget = tight_budget(path, 8, 2)
    two = LLM(str(path), device="cpu", tensor_parallel_size=2, gpu_memory_budget=budget, offload_mode="static",
              max_num_batched_tokens=64)
    try:
        got = run_greedy(two, ps, 20)
        assert two.stats()["preemptions"] > 0
    finally:
        two.shutdown()
    one = LLM(str(path), device="cpu", gpu_memory_budget="64MiB")
    assert run_greedy(one, ps, 20) == got


@slow
def test_a_killed_worker_fails_the_engine_clearly_and_soon(parity_checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(parity_checkpoints["qwen2_moe"]), device="cpu", gpu_memory_budget="64MiB", tensor_parallel_size=2)
    try:
        worker = llm.engine.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailed, match=r"rank 1 \(pid \d+\) exited with code -9"):
            run_greedy(llm, prompts(), STEPS)
        assert time.monotonic() - t0 < 10
        with pytest.raises(WorkerFailed):  # and stays failed
            llm.engine.step()
    finally:
        llm.shutdown()
    assert not worker.is_alive()


@slow
def test_a_worker_that_raises_reports_its_error(parity_checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(parity_checkpoints["qwen2_moe"]), device="cpu", gpu_memory_budget="64MiB", tensor_parallel_size=2)
    try:
        workers = llm.engine.workers
        workers.send(PassPlan(arrays=[], max_query_len=1, sample=False))  # a pass no rank can run
        t0 = time.monotonic()
        with pytest.raises(WorkerFailed, match="rank 1 raised:(.|\n)*ValueError"):
            while time.monotonic() - t0 < 10:
                run_greedy(llm, prompts()[:1], 2)
        assert time.monotonic() - t0 < 10
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for p in workers.procs)


# ---------------------------------------------------------------- two GPUs (NCCL)

@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_two_ranks_serve_the_tokens_of_transformers(arch: str, parity_checkpoints: dict[str, Path]) -> None:
    path = parity_checkpoints[arch]
    llm = LLM(str(path), device="cuda", dtype="float32", gpu_memory_budget="2GiB", tensor_parallel_size=2)
    try:
        got = run_greedy(llm, prompts(), STEPS)
    finally:
        llm.shutdown()
    assert_greedy_matches(path, prompts(), got, STEPS)


@pytest.mark.gpu
@two_gpus
def test_cuda_elastic_two_ranks_through_moves(parity_checkpoints: dict[str, Path]) -> None:
    path = parity_checkpoints["qwen2_moe"]
    llm = LLM(str(path), device="cuda", dtype="float32", gpu_memory_budget="2GiB", tensor_parallel_size=2,
              offload_mode="elastic", adjuster="paper", expert_offload_limit=5, max_num_batched_tokens=64)
    try:
        got = run_greedy(llm, prompts(), STEPS)
    finally:
        llm.shutdown()
    assert_greedy_matches(path, prompts(), got, STEPS)
