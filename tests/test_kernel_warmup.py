"""The start-up warm-up's passes meet every kernel variant a serving step can launch (engine/kernel_warmup.py).

A variant is fixed by the constexprs the launchers derive from a step's shape (the kernels opt out of specialising
on the rest: tests/test_kernel_variants.py). Here every step shape the scheduler can form within the limits (B
sequences, the longest query q, T tokens) is enumerated, its constexprs computed with the launchers' own functions,
and the warm-up passes' constexprs must include them all."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.engine.kernel_warmup import warmup_passes
from rimuru.kernels.fused_moe import _tile_config
from rimuru.kernels.gated_delta_decode import block_v
from rimuru.kernels.launch import next_pow2
from rimuru.kernels.moe_align import SINGLE_PROGRAM_MAX, chunked_variant
from rimuru.kernels.paged_attention import plan_launch
from rimuru.models.forward_batch import StepLayout
from rimuru.testing.tiny_models import ARCHS, HYBRID_ARCHS, make_tiny_checkpoint

H200_SMS = 132


def _attention_variant(batch: int, max_query: int, heads: tuple[int, int, int], elem_size: int) -> tuple:
    hq, hkv, hd = heads
    plan = plan_launch(batch, hq, hkv, hd, 16, max_query, H200_SMS, elem_size=elem_size)
    return dataclasses.astuple(dataclasses.replace(plan, num_q_tiles=0))  # the grid is not a constexpr


def _moe_variant(tokens: int, experts: int, top_k: int) -> tuple:
    n = tokens * top_k
    cfg = _tile_config(n / experts)
    align = (max(16, next_pow2(n)), 8 if n > 1024 else 4) if n <= SINGLE_PROGRAM_MAX else ("chunked",
                                                                                            chunked_variant(n))
    return cfg, align


# (q heads, KV heads, head dim), experts, top-k, dtype bytes: Qwen1.5-MoE, Qwen3-30B-A3B, Mixtral, OLMoE in fp32
SHAPES = [((16, 16, 128), 60, 4, 2), ((32, 4, 128), 128, 8, 2), ((32, 8, 128), 8, 2, 2), ((16, 16, 128), 64, 8, 4)]


@pytest.mark.parametrize("heads,experts,top_k,elem_size", SHAPES)
@pytest.mark.parametrize("max_num_seqs,max_num_batched_tokens", [(64, 512), (48, 300), (256, 8192)])
def test_the_warmup_passes_meet_every_variant_a_step_can(heads, experts, top_k, elem_size, max_num_seqs,
                                                         max_num_batched_tokens):
    S, T = max_num_seqs, max_num_batched_tokens
    passes = warmup_passes(S, T, experts, top_k)
    assert all(1 <= len(p) <= S and sum(p) <= T and min(p) >= 1 for p in passes)
    warm_attn = {_attention_variant(len(p), max(p), heads, elem_size) for p in passes}
    warm_moe = {_moe_variant(sum(p), experts, top_k) for p in passes}
    # every step: B sequences whose longest query is q, B - 1 others of at least one token, so q + B - 1 <= T
    step_batches = range(1, min(S, T) + 1) if S * T <= 1 << 17 else [*range(1, 300), S]
    for b in step_batches:
        for q in sorted({*range(1, 40), *(1 << i for i in range(13)), T - b + 1}):
            if 1 <= q <= T - b + 1:
                assert _attention_variant(b, q, heads, elem_size) in warm_attn, (b, q)
    for tokens in range(1, T + 1):
        assert _moe_variant(tokens, experts, top_k) in warm_moe, tokens


@pytest.mark.parametrize("num_v_heads,dk,dv", [(32, 128, 128), (64, 128, 128), (2, 16, 32)])
def test_the_warmup_decodes_meet_every_deltanet_decode_tile(num_v_heads, dk, dv):
    passes = warmup_passes(256, 4096, 128, 8)
    warm = {block_v(len(p), num_v_heads, dk, dv, H200_SMS) for p in passes if max(p) == 1}
    assert {block_v(b, num_v_heads, dk, dv, H200_SMS) for b in range(1, 257)} <= warm


def test_the_passes_are_few_and_distinct():
    passes = warmup_passes(256, 4096, 128, 8)
    assert len(passes) == len({tuple(p) for p in passes}) <= 80
    assert [1] in passes and [1] * 256 in passes and [4096] in passes


def test_mixed_passes_put_decodes_first_as_the_scheduler_does():
    """A hybrid model's prefill rows start after the step's decode rows (StepLayout): a chunk after an odd number of
    decodes, as serving meets it, and not only chunks at row 0."""
    passes = warmup_passes(256, 4096, 128, 8)
    mixed = [StepLayout.of(p) for p in passes if len(p) > 1 and max(p) > 1]
    assert mixed and all(layout.num_decodes == layout.num_seqs - 1 for layout in mixed)
    assert {layout.num_decodes % 2 for layout in mixed} == {1}
    assert any(len(p) == 1 and p[0] > 1 for p in passes)  # and chunks with no decode before them


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# a cold Triton cache compiles ~50 variants an architecture: two dense ones (GQA top-8, Mixtral's top-2) eager, one
# with graphs (steps above a 64-token cap run eagerly), and the hybrid eager
@pytest.mark.parametrize("arch,eager", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True),
                                        (HYBRID_ARCHS[0], True)])
def test_serving_after_the_warmup_builds_no_kernel_variant(arch: str, eager: bool, tmp_path: Path) -> None:
    """Prompts of many lengths in waves of 1, 3 and 14 (decode batches of every size, chunks short and long, steps
    above the largest graph): no step builds a Triton kernel variant, with every variant the process had built
    before the engine started forgotten (what the warm-up missed would otherwise hide behind an earlier test's)."""
    from rimuru.kernels import kernel_builds
    from rimuru.testing.kernel_variants import forget_built_variants

    if arch in HYBRID_ARCHS:
        pytest.importorskip("fla")
    path = make_tiny_checkpoint(arch, tmp_path / arch, seed=3)
    assert forget_built_variants() > 0
    llm = LLM(str(path), device="cuda", dtype="bfloat16", gpu_memory_budget="1GiB", enforce_eager=eager,
              max_num_seqs=24, max_num_batched_tokens=200, max_cudagraph_capture_size=None if eager else 64)
    assert kernel_builds.install()
    built_at_start = kernel_builds.by_kernel()
    g = torch.Generator().manual_seed(11)
    lengths = [1, 2, 3, 5, 17, 40, 77, 150, 199, 9, 33, 64, 65, 120]
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in lengths]
    params = [SamplingParams(max_tokens=3 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(len(lengths))]
    for wave in (1, 3, len(lengths)):
        llm.generate(prompts[:wave], params[:wave])
    assert llm.stats()["kv_pages_used"] == 0
    built_serving = {name: n - built_at_start.get(name, 0) for name, n in kernel_builds.by_kernel().items()
                     if n > built_at_start.get(name, 0)}
    assert llm.engine.kernel_variants_built == 0, f"variants built while serving, per kernel: {built_serving}"


@pytest.mark.parametrize("arch", [*ARCHS, *HYBRID_ARCHS])
@pytest.mark.parametrize("mode", ["static", "elastic"])
def test_every_warmup_pass_runs_over_the_scratch_pool(arch: str, mode: str, tmp_path: Path) -> None:
    """What a GPU start-up runs before the pool exists, on the CPU: each warm-up pass (decodes, single prompts, a
    short chunk beside decodes) over the one-huge-page scratch pool, in the mode's MoE variant, gives finite logits
    for each of its prompts."""
    from rimuru.config import EngineConfig
    from rimuru.engine.workspace_profile import _engine_provider, _run_prompts, _ScratchPool
    from rimuru.memory.geometry import PageGeometry
    from rimuru.model_spec import ModelSpec
    from rimuru.models.loader import init_dummy_weights
    from rimuru.models.registry import build_model

    path = make_tiny_checkpoint(arch, tmp_path / arch, seed=4)
    spec = ModelSpec.from_pretrained(path)
    cpu = torch.device("cpu")
    scratch = _ScratchPool(spec, PageGeometry.for_model(spec, dtype=torch.float32), torch.float32, cpu,
                           spec.num_key_value_heads, 16)
    model = build_model(spec, torch.float32, "cpu", scratch.kv_view, scratch.provider)
    init_dummy_weights(model, seed=0)
    scratch.pool.buffer.zero_()
    if scratch.state is not None:
        model.bind_state_cache(scratch.state)
    model.attach_experts(_engine_provider(scratch, mode, EngineConfig(model=str(path))))
    passes = warmup_passes(8, 48, spec.num_experts, spec.num_experts_per_tok)
    with torch.inference_mode():
        for lens in passes:
            logits = _run_prompts(model, spec, lens, 16, cpu)
            assert logits.shape == (len(lens), spec.vocab_size) and bool(torch.isfinite(logits).all()), lens
