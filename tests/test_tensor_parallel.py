"""Tensor parallelism: two ranks on the CPU (gloo, float32) serve the tokens one rank does, and transformers does.

Every engine test starts a real worker process (spawn), so each costs the worker's start-up (~5 s on two cores):
they are marked slow. After each run no rank's pool has a page in use and every rank reads rank 0's expert tables
(`LLMEngine.pool_reports`). Hybrid models (Qwen3.5-MoE, Qwen3-Next in both expert layouts) run in static mode and,
Qwen3-Next, in elastic mode with state pages in a tight pool. The GPU tests run the same on two GPUs over NCCL.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.sweep_processes import process_ended
from rimuru import LLM
from rimuru.config import EngineConfig
from rimuru.distributed.parallel_state import SINGLE, TensorParallel, free_port
from rimuru.engine import tp_workers
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.tp_workers import PassPlan, WorkerFailed
from rimuru.memory.geometry import CONV, SSM, PageGeometry
from rimuru.model_spec import ModelSpec, load_model_spec
from rimuru.models.layers import MergedLinear
from rimuru.models.loader import init_dummy_weights
from rimuru.models.parallel_linear import (
    PaddedShard,
    Shard,
    VocabParallelEmbedding,
    kv_head_shard,
    param_shards,
    rank_shard,
    vocab_shard,
)
from rimuru.models.registry import build_model
from rimuru.testing.pools import assert_nothing_held
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


def test_a_padded_shard_ends_in_zero_rows() -> None:
    full = torch.arange(10.0).view(5, 2)  # V = 5 rows on 2 ranks: 3 each, the last rank's third row padding
    first, last = (PaddedShard(0, 2, r, size=5) for r in range(2))
    assert torch.equal(first.take(full), full[:3])
    assert torch.equal(last.take(full), torch.cat([full[3:], torch.zeros(1, 2)]))
    assert last.full_shape((3, 2)) == (5, 2) and last.per_rank == 3
    assert vocab_shard(SINGLE, 5) is None


def test_a_ranks_embedding_is_its_vocabulary_rows(parity_checkpoints: dict[str, Path]) -> None:
    """Rank 1 of 2 holds rows [V/2, V) of the embedding (the tied head's rows too), and before the all-reduce a token
    of rank 0's half looks up zeros; the two ranks' lookups sum to the full embedding's."""
    spec = load_model_spec(str(parity_checkpoints["qwen3_moe"]))  # tied embeddings
    kv = torch.empty(0)
    one = build_model(spec, torch.float32, "cpu", kv)
    init_dummy_weights(one, seed=3)
    ranks = [build_model(spec, torch.float32, "cpu", kv, tp=TensorParallel(rank=r, size=2)) for r in range(2)]
    for rank in ranks:
        init_dummy_weights(rank, seed=3)
    V, half = spec.vocab_size, spec.vocab_size // 2
    full = one.model.embed_tokens.weight
    emb = ranks[1].model.embed_tokens
    assert isinstance(emb, VocabParallelEmbedding) and ranks[1].lm_head is None
    assert torch.equal(emb.weight, full[half:]) and emb.vocab_start == half
    ids = torch.tensor([0, half - 1, half, V - 1])
    local = emb.local_lookup(ids)
    assert torch.equal(local[:2], torch.zeros(2, spec.hidden_size))
    assert torch.equal(local[2:], full[[half, V - 1]])
    summed = ranks[0].model.embed_tokens.local_lookup(ids) + local
    assert torch.equal(summed, one.model.embed_tokens(ids))


def test_an_odd_vocabulary_is_padded_to_the_ranks(tiny_checkpoint) -> None:
    """V = 301 on 2 ranks: 151 rows each, rank 1's last one zeros; the loader reads each rank's rows of the
    embedding and of an untied LM head."""
    from rimuru.models.loader import load_checkpoint

    path = tiny_checkpoint("qwen2_moe", vocab_size=301)
    spec = load_model_spec(str(path))
    kv = torch.empty(0)
    one = build_model(spec, torch.float32, "cpu", kv)
    load_checkpoint(one, spec, path, lambda *a: None)
    rank = build_model(spec, torch.float32, "cpu", kv, tp=TensorParallel(rank=1, size=2))
    load_checkpoint(rank, spec, path, lambda *a: None)
    for got, want in ((rank.model.embed_tokens.weight, one.model.embed_tokens.weight),
                      (rank.lm_head.weight, one.lm_head.weight)):
        assert got.shape[0] == 151
        assert torch.equal(got[:150], want[151:]) and torch.equal(got[150], torch.zeros(spec.hidden_size))


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


def test_expert_parallel_ranks_hold_whole_experts_of_their_block() -> None:
    tp, ep = TensorParallel(rank=1, size=2), TensorParallel(rank=1, size=2, expert_parallel=True)
    assert tp.local_experts(8) == range(8) and tp.expert_part(32) == 16
    assert ep.local_experts(8) == range(4, 8) and ep.expert_part(32) == 32
    assert SINGLE.local_experts(8) == range(8) and SINGLE.expert_part(32) == 32
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by tensor_parallel_size=4"):
        TensorParallel(rank=0, size=4, expert_parallel=True).local_experts(6)


def test_expert_parallel_pages_hold_whole_experts(parity_checkpoints: dict[str, Path]) -> None:
    spec = load_model_spec(str(parity_checkpoints["qwen2_moe"]))
    one = PageGeometry.for_model(spec, dtype=torch.float32)
    ep = PageGeometry.for_model(spec, dtype=torch.float32, tp_size=2, expert_parallel=True)
    assert ep.size("expert") == one.size("expert") and ep.expert_numel == spec.moe_intermediate_size * spec.hidden_size
    assert ep.size("kv") * 2 == one.size("kv")  # attention stays tensor-parallel


def test_expert_parallel_is_a_flag_and_static_only() -> None:
    import argparse

    from rimuru.config import add_engine_args

    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["m", "--tensor-parallel-size", "2", "--enable-expert-parallel"])
    config = EngineConfig.from_cli_args(args)
    assert config.enable_expert_parallel and config.tensor_parallel_size == 2
    assert not EngineConfig.from_cli_args(add_engine_args(argparse.ArgumentParser()).parse_args(["m"])) \
        .enable_expert_parallel
    for mode, access in (("elastic", "direct"), ("elastic", "copy"), ("fixed", "copy")):
        with pytest.raises(ValueError, match=f"enable_expert_parallel runs in .*got '{mode}' with '{access}'"):
            EngineConfig(model="unused", tensor_parallel_size=2, enable_expert_parallel=True, offload_mode=mode,
                         offload_access=access)
    EngineConfig(model="unused", tensor_parallel_size=2, enable_expert_parallel=True, offload_mode="fixed")


def test_unsupported_combinations_are_refused_by_name(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(model="unused", tensor_parallel_size=0)
    for mode in ("fixed", "elastic"):  # copy access is supported under tensor parallelism
        EngineConfig(model="unused", tensor_parallel_size=2, offload_mode=mode, offload_access="copy")


def assert_rank_holds_its_slices(one: torch.nn.Module, rank: torch.nn.Module) -> None:
    """Every parameter of the rank's model is its shard (or merged-section slice) of the one-rank model's."""
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


def test_dummy_weights_of_a_rank_are_its_slice_of_one_ranks(parity_checkpoints: dict[str, Path]) -> None:
    """Dummy weights draw each full tensor and keep the rank's slice: replicated weights agree on every rank, and
    cut ones are the single-rank model's (no process group is needed to build and fill a rank's model)."""
    spec = load_model_spec(str(parity_checkpoints["qwen2_moe"]))
    kv = torch.empty(0)
    one = build_model(spec, torch.float32, "cpu", kv)
    init_dummy_weights(one, seed=3)
    rank = build_model(spec, torch.float32, "cpu", kv, tp=TensorParallel(rank=1, size=2))
    init_dummy_weights(rank, seed=3)
    assert_rank_holds_its_slices(one, rank)
    assert rank.model.layers[0].self_attn.num_heads == 2 and rank.lm_head.weight.shape[0] == spec.vocab_size // 2


def one_rank_and_rank_1_of_2(path: Path) -> tuple[ModelSpec, torch.nn.Module, torch.nn.Module]:
    """The checkpoint loaded by one rank and by rank 1 of 2 (float32, CPU), the rank's tensors checked to be its
    slices of the one rank's."""
    from rimuru.models.loader import load_checkpoint

    spec = load_model_spec(str(path))
    kv = torch.empty(0)
    one = build_model(spec, torch.float32, "cpu", kv)
    load_checkpoint(one, spec, path, lambda *a: None)
    rank = build_model(spec, torch.float32, "cpu", kv, tp=TensorParallel(rank=1, size=2))
    load_checkpoint(rank, spec, path, lambda *a: None)
    assert_rank_holds_its_slices(one, rank)
    return spec, one, rank


def test_a_hybrid_ranks_weights_are_its_heads(tiny_checkpoint) -> None:
    """Qwen3.5-MoE rank 1 of 2: gated DeltaNet's in_proj_qkv and conv channels hold the rank's q, k and v heads of
    each section, z / b / a / A_log / dt_bias its value heads; the gated attention's q_proj its heads' [q | gate]
    rows; the checkpoint's slices read by the loader equal the dummy weights' slices of the full tensors."""
    spec, one, rank = one_rank_and_rank_1_of_2(tiny_checkpoint("qwen3_5_moe_text", seed=3))
    lin = spec.linear_layer_ids[0]
    dn, dn1 = rank.model.layers[lin].linear_attn, one.model.layers[lin].linear_attn
    kd, vd = dn1.key_dim, dn1.value_dim  # full widths: q and k [Hk*dk] each, v [Hv*dv]
    w = dn1.in_proj_qkv.weight
    want_qkv = torch.cat([w[kd // 2 : kd], w[kd + kd // 2 : 2 * kd], w[2 * kd + vd // 2 :]])
    assert torch.equal(dn.in_proj_qkv.weight, want_qkv)
    assert torch.equal(dn.A_log, dn1.A_log[dn1.num_v_heads // 2 :])
    assert dn.state_shapes() == ((dn1.conv_dim // 2, 3), (dn1.num_v_heads // 2, dn1.head_k_dim, dn1.head_v_dim))
    attn = spec.attention_layer_ids[0]
    q1 = one.model.layers[attn].self_attn.qkv_proj.weight[: 2 * spec.num_attention_heads * spec.head_dim]
    q = rank.model.layers[attn].self_attn.qkv_proj.weight[: q1.shape[0] // 2]
    assert torch.equal(q, q1[q1.shape[0] // 2 :])  # heads 2 and 3, each [q | gate]


def test_a_qwen3_next_rank_takes_its_slices_of_the_split_projections(tiny_checkpoint) -> None:
    """Qwen3-Next rank 1 of 2: the loader splits in_proj_qkvz / in_proj_ba whole, then each part is cut as Qwen3.5's
    in_proj_qkv / z / b / a are: the rank's parameters equal its slices of the one-rank model's."""
    spec, one, rank = one_rank_and_rank_1_of_2(tiny_checkpoint("qwen3_next", seed=3))
    dn, dn1 = rank.model.layers[0].linear_attn, one.model.layers[0].linear_attn
    assert torch.equal(dn.in_proj_b.weight, dn1.in_proj_b.weight[dn1.num_v_heads // 2 :])


# ---------------------------------------------------------------- two ranks

def assert_no_rank_holds_a_page(llm: LLM) -> None:
    """After a run, on every rank: no KV, ssm or conv page in use (rank 0's prefix cache reset first; a hybrid
    model's state checked as in the one-rank tests), the allocator's invariants hold, and the expert tables the
    passes read are rank 0's."""
    engine = llm.engine
    if engine.state is not None:
        assert_nothing_held(engine)
    engine.reset_prefix_cache()
    reports = engine.pool_reports()
    assert [r["rank"] for r in reports] == list(range(engine.tp.size))
    for r in reports:
        assert r["kv_pages_in_use"] == r["state_holders"] == 0, r
        assert r["used"]["kv"] == r["used"].get("ssm", 0) == r["used"].get("conv", 0) == 0, r
        if engine.tp.expert_parallel:
            assert_ranks_hold_complementary_experts(reports, engine.spec.num_experts)
        else:
            assert np.array_equal(r["expert_tables"], reports[0]["expert_tables"]), r["rank"]


def assert_ranks_hold_complementary_experts(reports: list[dict], num_experts: int) -> None:
    """Expert parallelism: rank r's tables name experts [r E/N, (r+1) E/N) of every layer, by pages (>= 0) or by
    host rows of its own store (<= -2, fixed mode), and no other (-1 rows), so every expert is held by exactly one
    rank; every rank holds as many expert pages, the same ids."""
    n = len(reports)
    per_rank = num_experts // n
    pages0 = reports[0]["expert_tables"][reports[0]["expert_tables"] >= 0]
    for r in reports:
        tables = r["expert_tables"]  # [L, E, 3]
        mine = slice(r["rank"] * per_rank, (r["rank"] + 1) * per_rank)
        assert (tables[:, mine] != -1).all(), r["rank"]
        others = np.delete(tables, np.arange(num_experts)[mine], axis=1)
        assert (others == -1).all(), r["rank"]
        assert r["used"]["expert"] == (tables >= 0).sum() == pages0.size, r["rank"]
        assert np.array_equal(np.sort(tables[tables >= 0]), np.sort(pages0)), "the ranks' allocators differ"


def serve_both(path: Path, steps: int = STEPS, ps: list[list[int]] | None = None,
               **kwargs: object) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of one rank and of two, on the same engine settings (each run leaves no page in use, on any
    rank)."""
    ps = ps if ps is not None else prompts()
    kwargs = {"device": "cpu", "gpu_memory_budget": "64MiB", **kwargs}
    one = LLM(str(path), **kwargs)
    want = run_greedy(one, ps, steps)
    one.shutdown()
    two = LLM(str(path), tensor_parallel_size=2, **kwargs)
    try:
        got = run_greedy(two, ps, steps)
        assert_no_rank_holds_a_page(two)
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
@pytest.mark.parametrize("arch", ARCHS)
def test_expert_parallel_ranks_serve_the_tokens_of_one_and_of_transformers(arch: str,
                                                                          parity_checkpoints: dict[str, Path]) -> None:
    """Static mode, each rank holding half of every layer's experts whole (mixtral and olmoe checkpoints hold fused
    experts, the others per expert), with chunked prefill; the ranks' tables hold complementary experts."""
    path = parity_checkpoints[arch]
    want, got = serve_both(path, offload_mode="static", max_num_batched_tokens=16, enable_expert_parallel=True)
    assert got == want
    assert_greedy_matches(path, prompts(), got, STEPS)


@slow
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_expert_parallel_fixed_mode_reads_each_ranks_offloaded_experts_from_its_own_store(
        arch: str, parity_checkpoints: dict[str, Path]) -> None:
    """Fixed mode with direct access: each rank keeps 2 of its 4 experts per layer resident and names the other 2 by
    host rows of its own store, which holds its 4 experts only (half the one-rank store's bytes)."""
    path = parity_checkpoints[arch]
    kwargs = {"device": "cpu", "gpu_memory_budget": "64MiB"}
    one = LLM(str(path), **kwargs)
    want = run_greedy(one, prompts(), STEPS)
    one.shutdown()
    two = LLM(str(path), tensor_parallel_size=2, offload_mode="fixed", resident_experts=2, enable_expert_parallel=True,
              **kwargs)
    try:
        got = run_greedy(two, prompts(), STEPS)
        store, E = two.engine.runtime.store, two.engine.spec.num_experts
        assert (store.first_expert, store.num_experts, store.f) == (0, E // 2, two.engine.spec.moe_intermediate_size)
        reports = two.engine.pool_reports()
        for r in reports:  # half of each rank's experts named by host rows of its own store
            assert ((r["expert_tables"] <= -2).sum(axis=(1, 2)) == 3 * 2).all(), r["rank"]
        assert_no_rank_holds_a_page(two)
    finally:
        two.shutdown()
    assert got == want
    assert_greedy_matches(path, prompts(), got, STEPS)


@slow
def test_expert_parallel_ranks_each_charge_half_the_experts(parity_checkpoints: dict[str, Path]) -> None:
    """A rank's pool holds E/N whole experts of every layer: half the one-rank bytes of resident experts, as under
    tensor parallelism, and the engine reports the group's experts all resident."""
    path = str(parity_checkpoints["qwen2_moe"])
    one = LLM(path, device="cpu", gpu_memory_budget="64MiB")
    full = one.engine.budget_split["experts_resident"]
    one.shutdown()
    two = LLM(path, device="cpu", gpu_memory_budget="64MiB", tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        assert two.engine.budget_split["experts_resident"] * 2 == full
        stats = two.stats()
        assert stats["resident_experts"] == stats["total_experts"] == two.engine.runtime.cache.num_resident * 2
    finally:
        two.shutdown()


@slow
def test_expert_parallel_serves_a_hybrid_model_as_one_rank(tiny_checkpoint) -> None:
    path = hybrid_checkpoint(tiny_checkpoint, "qwen3_next-fused")
    want, got = serve_both(path, offload_mode="static", max_num_batched_tokens=16, enable_expert_parallel=True)
    assert got == want


@slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_an_odd_vocabulary_serves_the_tokens_of_one_rank(arch: str, tiny_checkpoint) -> None:
    """V = 301 on two ranks (tied and untied heads): the padding row's logit never reaches the sampler."""
    path = tiny_checkpoint(arch, vocab_size=301, seed=3)
    want, got = serve_both(path)
    assert got == want


FLL = ["full_attention", "linear_attention", "linear_attention"]
# (architecture, fused expert tensors, layer_types): Qwen3.5-MoE in both layer orders, Qwen3-Next (its fused
# in_proj_qkvz / in_proj_ba split at load, then cut per rank) in both expert layouts
HYBRID_CASES = {"qwen3_5-LLLF": ("qwen3_5_moe_text", False, None), "qwen3_5-FLL": ("qwen3_5_moe_text", False, FLL),
                "qwen3_next-per_expert": ("qwen3_next", False, None), "qwen3_next-fused": ("qwen3_next", True, None)}


def hybrid_checkpoint(tiny_checkpoint, case: str) -> Path:
    arch, fused, types = HYBRID_CASES[case]
    extra = {} if types is None else {"num_hidden_layers": len(types), "layer_types": types}
    return tiny_checkpoint(arch, fused_experts=fused, seed=3, **extra)


@slow
@pytest.mark.parametrize(("arch", "mode"), [("qwen2_moe", "static"), ("qwen3_moe", "elastic"), ("mixtral", "fixed")])
def test_async_scheduling_two_ranks_serve_the_tokens_of_one(arch: str, mode: str,
                                                            parity_checkpoints: dict[str, Path]) -> None:
    """Async scheduling: each pass is sent before rank 0 reads the last one's tokens; every rank fills those pending
    rows from its copy of rank 0's sampled tokens (broadcast at the end of each sampling pass). Chunked prefill, and
    elastic and fixed mode's expert tables and loads in the same plans."""
    path = parity_checkpoints[arch]
    extra = {"elastic": {"adjuster": "paper", "expert_offload_limit": 5}, "fixed": {"resident_experts": 4}}
    kwargs = {"device": "cpu", "gpu_memory_budget": "64MiB", "max_num_batched_tokens": 48, "offload_mode": mode,
              **extra.get(mode, {})}
    one = LLM(str(path), **kwargs)
    want = run_greedy(one, prompts(), STEPS)
    one.shutdown()
    two = LLM(str(path), tensor_parallel_size=2, async_scheduling=True, **kwargs)
    try:
        assert two.engine.async_scheduling and two.engine.runner.share_sampled_tokens is not None
        got = run_greedy(two, prompts(), STEPS)
        assert_no_rank_holds_a_page(two)
    finally:
        two.shutdown()
    assert got == want


@slow
@pytest.mark.parametrize("case", ["qwen3_5-LLLF", "qwen3_next-per_expert"])
def test_async_scheduling_two_ranks_serve_a_hybrid_model_as_one(case: str, tiny_checkpoint) -> None:
    path = hybrid_checkpoint(tiny_checkpoint, case)
    want, got = serve_both(path, offload_mode="static", max_num_batched_tokens=16, async_scheduling=True)
    assert got == want


@slow
@pytest.mark.parametrize("case", list(HYBRID_CASES))
def test_two_ranks_serve_a_hybrid_model_as_one(case: str, tiny_checkpoint) -> None:
    """Static mode with chunked prefill: each rank's ssm and conv pages hold its DeltaNet heads."""
    path = hybrid_checkpoint(tiny_checkpoint, case)
    want, got = serve_both(path, offload_mode="static", max_num_batched_tokens=16)
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


@slow
@pytest.mark.parametrize("arch,tier", [("qwen2_moe", "off"), ("mixtral", "off"), ("qwen3_moe", "on")])
def test_fixed_mode_with_copies_loads_each_ranks_slice_into_its_own_buffers(arch: str, tier: str,
                                                                          parity_checkpoints: dict[str, Path]) -> None:
    """Copy access on two ranks: every rank's provider reads the same routing, decides the same loads and copies its
    slice of each routed offloaded expert into its own load buffers (or, with the host tier on, computes its slice
    on the host); chunked prefills; tokens equal one rank's and transformers'; no page held afterwards."""
    path = parity_checkpoints[arch]
    kwargs = dict(offload_mode="fixed", offload_access="copy", resident_experts=2, cpu_expert_compute=tier,
                  max_num_batched_tokens=16, device="cpu", gpu_memory_budget="64MiB")
    one = LLM(str(path), **kwargs)
    want = run_greedy(one, prompts(), STEPS)
    loaded_one = one.stats()["expert_bytes_loaded"]
    one.shutdown()
    two = LLM(str(path), tensor_parallel_size=2, **kwargs)
    try:
        got = run_greedy(two, prompts(), STEPS)
        reports = two.engine.pool_reports()
        assert_no_rank_holds_a_page(two)
    finally:
        two.shutdown()
    assert got == want
    assert_greedy_matches(path, prompts(), got, STEPS)
    # the same loads on both ranks, each of its half of every expert
    assert reports[0]["expert_bytes_loaded"] == reports[1]["expert_bytes_loaded"] > 0
    if tier == "off":
        assert 2 * reports[0]["expert_bytes_loaded"] == loaded_one


def tight_pool(path: Path, kv_blocks: int, tp_size: int, requests: int = 0) -> int:
    """A pool (page_pool_memory_bytes) that holds every expert, `kv_blocks` KV blocks and (hybrid models) the state
    pages of `requests` requests, of one rank of `tp_size`."""
    spec = load_model_spec(str(path))
    geo = PageGeometry.for_model(spec, dtype=torch.float32, tp_size=tp_size)
    experts = 3 * spec.num_moe_layers * spec.num_experts * geo.size("expert")
    kv = kv_blocks * len(spec.attention_layer_ids) * geo.size("kv")
    state = requests * len(spec.linear_layer_ids) * (geo.size(SSM) + geo.size(CONV)) if spec.is_hybrid else 0
    return experts + kv + state + geo.huge_size


@slow
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_elastic_mode_with_copies_follows_rank_0s_moves_and_buffers(arch: str,
                                                                   parity_checkpoints: dict[str, Path]) -> None:
    """Copy access on two ranks in elastic mode: rank 0's evictions and grows reach rank 1 as its expert tables, its
    load buffers' pages as the plan's buffer pages, and each rank fills its buffers with its own slices of the
    routed offloaded experts; tokens equal one rank's and transformers' through chunked prefills."""
    path = parity_checkpoints[arch]
    g = torch.Generator().manual_seed(2)
    ps = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in torch.randint(8, 40, (6,), generator=g)]
    one = LLM(str(path), device="cpu", gpu_memory_budget="64MiB", max_num_batched_tokens=64)
    want = run_greedy(one, ps, STEPS)
    one.shutdown()
    two = LLM(str(path), device="cpu", tensor_parallel_size=2, page_pool_memory_bytes=tight_pool(path, 10, 2),
              offload_mode="elastic", offload_access="copy", adjuster="paper", expert_offload_limit=5,
              max_num_batched_tokens=64)
    try:
        got = run_greedy(two, ps, STEPS)
        st = two.stats()
        assert st["expert_evictions"] > 0 and st["expert_grows"] > 0, st
        reports = two.engine.pool_reports()
        assert all(r["expert_bytes_loaded"] > 0 for r in reports), [r["expert_bytes_loaded"] for r in reports]
        assert_no_rank_holds_a_page(two)
    finally:
        two.shutdown()
    assert got == want
    assert_greedy_matches(path, ps, got, STEPS)


def test_a_worker_takes_rank_0s_buffer_pages_and_refills_them_itself(parity_checkpoints: dict[str, Path]) -> None:
    """What a worker does with a plan's buffer pages (engine/tp_workers.py `apply_buffer_pages`), on one engine:
    detached by an empty list, attached again with rank 0's pages (buffer 0's slots, then buffer 1's) in the same
    slots, emptied; the loads that follow refill them and the tokens stay those of an untouched engine."""
    from rimuru.engine.tp_workers import apply_buffer_pages

    path = parity_checkpoints["qwen2_moe"]
    args = dict(device="cpu", page_pool_memory_bytes=tight_pool(path, 10, 1), offload_mode="elastic",
                offload_access="copy", adjuster="paper", expert_offload_limit=5, max_num_batched_tokens=64)
    ps = prompts()
    want = run_greedy(LLM(str(path), **args), ps, STEPS)
    llm = LLM(str(path), **args)
    loader = llm.engine.runtime.loader
    pages = loader.buffer_pages
    assert pages and len(pages) % 6 == 0
    slots = [list(buf.slot_pages) for buf in loader.buffers]
    apply_buffer_pages(llm.engine, [])
    assert loader.buffer_pages == [] and all(not buf.slot_of for buf in loader.buffers)
    apply_buffer_pages(llm.engine, pages)
    assert loader.buffer_pages == pages and [list(buf.slot_pages) for buf in loader.buffers] == slots
    assert run_greedy(llm, ps, STEPS) == want
    assert llm.stats()["expert_bytes_loaded"] > 0


@slow
@pytest.mark.parametrize("case", ["qwen2_moe", "qwen3_next-per_expert", "qwen3_next-fused"])
def test_elastic_mode_moves_the_same_experts_on_both_ranks(case: str, parity_checkpoints: dict[str, Path],
                                                           tiny_checkpoint) -> None:
    """Rank 0's evictions and grows reach rank 1 as its expert tables (from its slice of the host store: per-expert
    and fused checkpoints fill it differently); tokens equal one rank's (static mode) and transformers', with
    chunked prefills on the way. Qwen3-Next's pool holds the experts, two KV blocks and one request's state: the
    other requests' state and KV are what experts are evicted for (16-token chunks), and past the offload limit
    (two per layer) decoding requests are preempted and recompute their state on both ranks."""
    hybrid = case in HYBRID_CASES
    path = hybrid_checkpoint(tiny_checkpoint, case) if hybrid else parity_checkpoints[case]
    pool = tight_pool(path, 2, 2, requests=1) if hybrid else tight_pool(path, 10, 2)
    chunk, limit, steps = (16, 2, 24) if hybrid else (64, 5, 16)
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in torch.randint(8, 40, (6,), generator=g)]
    one = LLM(str(path), device="cpu", gpu_memory_budget="64MiB", max_num_batched_tokens=chunk)
    want = run_greedy(one, ps, steps)
    one.shutdown()
    two = LLM(str(path), device="cpu", tensor_parallel_size=2, page_pool_memory_bytes=pool,
              offload_mode="elastic", adjuster="paper", expert_offload_limit=limit, max_num_batched_tokens=chunk)
    try:
        got = run_greedy(two, ps, steps)
        light = run_greedy(two, ps[:1], steps)
        st = two.stats()
        assert st["expert_evictions"] > 0 and st["expert_grows"] > 0, st
        assert st["preemptions"] > 0 or not hybrid, st
        assert_no_rank_holds_a_page(two)
    finally:
        two.shutdown()
    assert got == want and light == want[:1]
    assert_greedy_matches(path, ps, got, steps)


@slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_two_ranks_compute_the_prompt_logprobs_and_penalties_of_one(async_scheduling: bool,
                                                                   parity_checkpoints: dict[str, Path]) -> None:
    """The LM head over a chunked prefill's prompt rows (more rows than one sampler chunk) joins every rank's
    all-gather; penalties are rank 0's alone. With async scheduling the sampled tokens' broadcast comes after the
    prompt rows' gathers on every rank."""
    path = parity_checkpoints["qwen2_moe"]
    ps = [{"prompt_token_ids": p} for p in random_prompts((45, 9))]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=3,
                             repetition_penalty=1.3),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, frequency_penalty=1.0)]
    kwargs = {"device": "cpu", "gpu_memory_budget": "64MiB", "max_num_batched_tokens": 40}
    want = LLM(str(path), **kwargs).generate(ps, params)
    two = LLM(str(path), tensor_parallel_size=2, async_scheduling=async_scheduling, **kwargs)
    try:
        assert two.engine.async_scheduling == async_scheduling
        got = two.generate(ps, params)
    finally:
        two.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    a, b = got[0].prompt_logprobs, want[0].prompt_logprobs
    assert a is not None and b is not None and len(a) == len(b) == 45 and a[0] is None
    assert got[1].prompt_logprobs is None
    for x, y in zip(a[1:], b[1:], strict=True):
        assert list(x) == list(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


@slow
def test_preempted_requests_recompute_the_same_tokens(parity_checkpoints: dict[str, Path]) -> None:
    path = parity_checkpoints["qwen3_moe"]
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(3, 300, (30,), generator=g).tolist() for _ in range(4)]
    two = LLM(str(path), device="cpu", tensor_parallel_size=2, page_pool_memory_bytes=tight_pool(path, 8, 2),
              offload_mode="static", max_num_batched_tokens=64)
    try:
        got = run_greedy(two, ps, 20)
        assert two.stats()["preemptions"] > 0
        assert_no_rank_holds_a_page(two)
    finally:
        two.shutdown()
    one = LLM(str(path), device="cpu", gpu_memory_budget="64MiB")
    assert run_greedy(one, ps, 20) == got


@slow
def test_each_rank_charges_the_budget_for_the_shards_it_holds(parity_checkpoints: dict[str, Path]) -> None:
    """The budget charges a rank the non-expert tensors it really holds (its shards plus what is replicated), so
    at the same budget two ranks each get a larger pool than one."""
    path = str(parity_checkpoints["qwen2_moe"])
    one = LLM(path, device="cpu", gpu_memory_budget="64MiB")
    full = one.engine.budget_split
    one.shutdown()
    two = LLM(path, device="cpu", gpu_memory_budget="64MiB", tensor_parallel_size=2)
    try:
        split, model = two.engine.budget_split, two.engine.model
        held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        assert split["non_expert_weights"] == held < full["non_expert_weights"]
        assert split["pool"] > full["pool"] - two.engine.geometry.huge_size
    finally:
        two.shutdown()


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
def test_rank_0_aborts_the_groups_when_a_worker_dies_where_collectives_would_block(
        parity_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Under NCCL rank 0 watches its workers and aborts the process groups on a death (a collective blocked on the
    dead peer then returns). Armed here on gloo: the abort runs within seconds of the kill, while rank 0 idles, and
    the engine still fails with the dead rank's WorkerFailed and shuts down cleanly on the aborted groups."""
    monkeypatch.setattr(tp_workers, "device_groups_need_abort", lambda: True)
    llm = LLM(str(parity_checkpoints["qwen2_moe"]), device="cpu", gpu_memory_budget="64MiB", tensor_parallel_size=2)
    try:
        workers = llm.engine.workers
        assert workers.watcher is not None and torch.distributed.is_initialized()
        run_greedy(llm, prompts()[:1], 2)  # a step through the armed group first
        assert not workers.watcher.fired.is_set()
        os.kill(workers.procs[0].pid, signal.SIGKILL)
        assert workers.watcher.fired.wait(timeout=5)
        workers.watcher.stop()  # waits for the abort to finish
        assert not torch.distributed.is_initialized()
        with pytest.raises(WorkerFailed, match=r"rank 1 \(pid \d+\) exited with code -9"):
            run_greedy(llm, prompts(), STEPS)
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for p in workers.procs)


def _rank_0_that_never_joins(config: EngineConfig, worker_pids) -> None:
    """Starts rank 1 as rank 0 does, then never joins the group: the worker waits in the rendezvous (the store it
    connects to is never opened), as it would wait in an NCCL collective on a rank 0 that died."""
    ctx = torch.multiprocessing.get_context("spawn")
    errors = ctx.Queue()  # held here: the worker unpickles it after its start
    worker = ctx.Process(target=tp_workers._worker_main, args=(1, config, free_port(), errors), daemon=True)
    worker.start()
    worker_pids.put(worker.pid)
    time.sleep(120)


@slow
def test_a_worker_ends_when_rank_0_dies_while_it_waits(parity_checkpoints: dict[str, Path]) -> None:
    """A worker watches rank 0 (its parent) from its first line: killed rank 0, the worker ends within seconds,
    where the rendezvous it waits in would hold it for the group's timeout (ten minutes)."""
    config = EngineConfig(model=str(parity_checkpoints["qwen2_moe"]), device="cpu", gpu_memory_budget="64MiB",
                          tensor_parallel_size=2)
    ctx = torch.multiprocessing.get_context("spawn")
    worker_pids = ctx.Queue()
    rank_0 = ctx.Process(target=_rank_0_that_never_joins, args=(config, worker_pids))
    rank_0.start()
    worker = None
    try:
        worker = worker_pids.get(timeout=60)
        time.sleep(3)  # the worker's imports and the watch's start
        assert not process_ended(worker)  # waiting in the rendezvous: nothing else ends it
        os.kill(rank_0.pid, signal.SIGKILL)
        rank_0.join(timeout=5)
        t0 = time.monotonic()
        while not process_ended(worker) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        assert process_ended(worker), "the worker outlived rank 0"
    finally:
        if rank_0.is_alive():
            rank_0.kill()
        rank_0.join(timeout=5)
        if worker is not None and not process_ended(worker):
            os.kill(worker, signal.SIGKILL)


@slow
def test_a_stopped_engine_does_not_abort_its_groups(parity_checkpoints: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers told to exit end on purpose: the watch stops first, so shutdown destroys the groups, never aborts."""
    aborts: list[int] = []
    monkeypatch.setattr(tp_workers, "device_groups_need_abort", lambda: True)
    monkeypatch.setattr(tp_workers, "abort_device_groups", lambda: aborts.append(1))
    llm = LLM(str(parity_checkpoints["qwen2_moe"]), device="cpu", gpu_memory_budget="64MiB", tensor_parallel_size=2)
    workers = llm.engine.workers
    run_greedy(llm, prompts()[:1], 2)
    llm.shutdown()
    assert all(not p.is_alive() for p in workers.procs)
    time.sleep(0.3)
    assert aborts == [] and not workers.watcher.fired.is_set()


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


@slow
def test_rank_0_raising_after_it_sent_a_pass_fails_the_engine_clearly(parity_checkpoints: dict[str, Path],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 raises in a step after it sent the pass's plan, before the pass's collectives: the worker waits in
    them, where the next plan would meet the wrong collective. The step raises one WorkerFailed naming rank 0's
    error within seconds, the worker is ended, and the engine stays failed (no later step pairs with it)."""
    llm = LLM(str(parity_checkpoints["qwen2_moe"]), device="cpu", gpu_memory_budget="64MiB", tensor_parallel_size=2)
    try:
        workers = llm.engine.workers
        runner = llm.engine.runner

        def broken(*args, **kwargs):
            raise ValueError("rank 0 broke after sending the plan")

        monkeypatch.setattr(runner, "device_batch", broken)  # the eager pass, after `peers` sent the plan
        llm.engine.add_request("r", prompts()[0], SamplingParams(max_tokens=4))
        t0 = time.monotonic()
        with pytest.raises(WorkerFailed, match="rank 0 raised with every worker alive: ValueError: rank 0 broke"):
            llm.engine.step()
        assert time.monotonic() - t0 < 10
        assert all(not p.is_alive() for p in workers.procs)
        with pytest.raises(WorkerFailed):  # and stays failed
            llm.engine.step()
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- two GPUs (NCCL)

@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_two_ranks_serve_the_tokens_of_transformers(arch: str, eager: bool,
                                                          parity_checkpoints: dict[str, Path]) -> None:
    """With CUDA graphs (every rank replaying rank 0's choice, the all-reduces captured inside) and eagerly."""
    path = parity_checkpoints[arch]
    llm = LLM(str(path), device="cuda", dtype="float32", gpu_memory_budget="2GiB", tensor_parallel_size=2,
              enforce_eager=eager)
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


@slow
def test_kv_compaction_moves_every_ranks_pages_alike(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's runtime made to wait for two whole mid pages at every step: every step's KV moves travel in the pass
    plan and each rank copies its slice of the pages before the pass. Tokens equal one rank's without compaction."""
    path = tiny_checkpoint()
    ps = [[5, 9, 14, 3, 8, 21, 4, 17, 6, 11, 2, 30, 7, 19, 13, 12] + [40 + i] * (3 + 5 * i) for i in range(6)]
    one = LLM(str(path), device="cpu", gpu_memory_budget="64MiB", max_num_batched_tokens=48)
    want = run_greedy(one, ps, STEPS)
    one.shutdown()
    two = LLM(str(path), tensor_parallel_size=2, device="cpu", gpu_memory_budget="64MiB", max_num_batched_tokens=48)
    try:
        monkeypatch.setattr(two.engine.runtime, "mid_pages_awaited", lambda: 2)
        got = run_greedy(two, ps, STEPS)
        assert two.engine.kv_pages_moved > 0
        assert_no_rank_holds_a_page(two)
    finally:
        two.shutdown()
    assert got == want
