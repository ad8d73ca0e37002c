"""Qwen3-Next against transformers' Qwen3NextForCausalLM, on the CPU in float32, and through the engine.

The model is Qwen3.5-MoE's hybrid; what is its own is the checkpoint (in_proj_qkvz and in_proj_ba fused per key-head
group, split by the loader), the dense layers of mlp_only_layers and the flat config. As in test_qwen3_5_model:
experts, KV and the linear-attention states at shuffled pages of NaN-filled views.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_qwen3_5_model import hf_logits, hf_model

from rimuru import LLM, SamplingParams
from rimuru.model_spec import FULL_ATTENTION, LINEAR_ATTENTION, ModelSpec
from rimuru.testing.paged_model import PagedModel, greedy_decode_together, random_prompts
from rimuru.testing.paged_model import assert_close as check_close
from rimuru.testing.pools import CHUNK, assert_nothing_held, tight_budget
from rimuru.testing.reference import assert_greedy_matches
from rimuru.testing.reference import random_prompts as engine_prompts

pytest.importorskip("transformers")

ARCH = "qwen3_next"
ATOL = 1e-3  # as for Qwen3.5: the chunk form of the delta rule sums in another order than transformers'
PROMPT_LENS = (5, 17, 70, 1)  # inside one page, past one, past a 64-token delta-rule chunk, one token
L, F = LINEAR_ATTENTION, FULL_ATTENTION

def test_spec_of_the_tiny_model(tiny_checkpoint: Callable[..., Path]) -> None:
    spec = ModelSpec.from_pretrained(tiny_checkpoint(ARCH))
    assert spec.layer_types == (L, L, L, F) and spec.attention_layer_ids == (3,)
    assert spec.moe_layers == (True, False, True, True) and spec.intermediate_size == 96  # mlp_only_layers [1]
    assert spec.norm_topk_prob and spec.attn_output_gate and spec.partial_rotary_factor == 0.25
    assert spec.shared_expert_intermediate_size == 48


def test_config_defaults_follow_transformers() -> None:
    # A config.json without layer_types, norm_topk_prob or partial_rotary_factor: Qwen3NextConfig's defaults.
    config = {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "num_experts": 8,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
    spec = ModelSpec.from_hf_config(config)
    assert spec.layer_types == (L, L, L, F) * 2
    assert spec.norm_topk_prob and spec.attn_output_gate and spec.partial_rotary_factor == 0.25
    assert ModelSpec.from_hf_config({**config, "full_attention_interval": 2}).layer_types == (L, F) * 4


def test_fused_projections_split_as_transformers_orders_them(tiny_checkpoint: Callable[..., Path]) -> None:
    # The loaded in_proj_qkv / z / b / a give exactly what fix_query_key_value_ordering makes of the fused outputs.
    ckpt = tiny_checkpoint(ARCH)
    ours = PagedModel(ckpt).model.model.layers[0].linear_attn
    theirs = hf_model(ckpt).model.layers[0].linear_attn
    x = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        q, k, v, z, b, a = theirs.fix_query_key_value_ordering(theirs.in_proj_qkvz(x), theirs.in_proj_ba(x))
        want_qkv = torch.cat([t.reshape(7, -1) for t in (q[0], k[0], v[0])], dim=-1)
        assert torch.equal(ours.in_proj_qkv(x[0]), want_qkv)
        assert torch.equal(ours.in_proj_z(x[0]), z[0].reshape(7, -1))
        assert torch.equal(ours.in_proj_b(x[0]), b[0]) and torch.equal(ours.in_proj_a(x[0]), a[0])


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_prefill_matches_transformers(tiny_checkpoint: Callable[..., Path], fused: bool) -> None:
    ckpt = tiny_checkpoint(ARCH, fused_experts=fused)
    hm = PagedModel(ckpt)
    assert hm.spec.is_hybrid and hm.model.state_cache is not None
    assert len(hm.loaded) == hm.spec.num_moe_layers * hm.spec.num_experts
    seqs = random_prompts(1, hm.spec.vocab_size, PROMPT_LENS)
    for s, (tokens, out) in enumerate(zip(seqs, hm.step(list(enumerate(seqs))), strict=True)):
        assert torch.isfinite(out).all()
        check_close(out, hf_logits(ckpt, tokens), f"prefill seq {s}", ATOL)


def test_full_attention_first_pattern_matches_transformers(tiny_checkpoint: Callable[..., Path]) -> None:
    types = [F, L, L]
    ckpt = tiny_checkpoint(ARCH, num_hidden_layers=len(types), layer_types=types, mlp_only_layers=[2])
    hm = PagedModel(ckpt, seed=1)
    assert hm.spec.layer_types == tuple(types) and hm.spec.moe_layers == (True, True, False)
    seqs = random_prompts(2, hm.spec.vocab_size, PROMPT_LENS)
    for s, (tokens, out) in enumerate(zip(seqs, hm.step(list(enumerate(seqs))), strict=True)):
        check_close(out, hf_logits(ckpt, tokens), f"FLL prefill seq {s}", ATOL)


def test_greedy_decode_matches_generate(tiny_checkpoint: Callable[..., Path]) -> None:
    ckpt = tiny_checkpoint(ARCH, fused_experts=True)
    hm = PagedModel(ckpt, seed=3)
    seqs = random_prompts(4, hm.spec.vocab_size, PROMPT_LENS)[:3]
    steps = 5
    ours = greedy_decode_together(hm, seqs, steps)
    for s, prompt in enumerate(seqs):
        with torch.inference_mode():
            gen = hf_model(ckpt).generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)
        want = gen[0, len(prompt):].tolist()
        assert ours[s] == want, f"seq {s}: greedy tokens {ours[s]} != transformers' {want}"
    assert len({t for toks in ours for t in toks}) > 3, ours  # the tiny weights decode informatively


def test_mtp_weights_are_skipped(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    ckpt = tiny_checkpoint(ARCH)
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["mtp.layers.0.linear_attn.in_proj_qkvz.weight"] = torch.zeros(4, 4)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    seq = random_prompts(5, 300, PROMPT_LENS)[1]
    check_close(PagedModel(tmp_path).step([(0, seq)])[0], hf_logits(ckpt, seq), "with mtp tensors", ATOL)


def test_registered() -> None:
    from rimuru.models.qwen3_next import Qwen3NextForCausalLM
    from rimuru.models.registry import model_class

    assert model_class("qwen3_next") is Qwen3NextForCausalLM


# ------------------------------------------------------------------------------------------------------- engine
STEPS = 12


def greedy(llm: LLM, prompts: list[list[int]], steps: int = STEPS) -> list[list[int]]:
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_engine_static_greedy_matches_transformers(tiny_checkpoint: Callable[..., Path]) -> None:
    ckpt = tiny_checkpoint(ARCH, seed=3)
    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=CHUNK)
    prompts = engine_prompts((5, 17, 40, 70, 1), seed=21)
    got = greedy(llm, prompts)
    assert_greedy_matches(ckpt, prompts, got, STEPS)
    assert len({t for toks in got for t in toks}) > 5, got


def test_engine_fixed_mode_in_a_tight_pool_matches_transformers(tiny_checkpoint: Callable[..., Path]) -> None:
    ckpt = tiny_checkpoint(ARCH, fused_experts=True, seed=3)
    budget = tight_budget(ckpt, requests=2, load_buffer_experts=4, offload_mode="fixed", resident_experts=4,
                          offload_access="copy")
    llm = LLM(str(ckpt), gpu_memory_budget=budget, device="cpu", offload_mode="fixed", resident_experts=4,
              max_num_batched_tokens=CHUNK, offload_access="copy")
    assert llm.engine.runtime.cache.num_resident == 4 * llm.engine.spec.num_moe_layers
    prompts = engine_prompts((19, 6, 28), seed=24)
    got = greedy(llm, prompts)
    assert llm.stats()["expert_bytes_loaded"] > 0
    assert_greedy_matches(ckpt, prompts, got, STEPS)
    assert_nothing_held(llm.engine)


@pytest.mark.parametrize(("fused", "access"), [(False, "copy"), (True, "direct")],
                         ids=["per_expert-copy", "fused-direct"])
def test_engine_elastic_mode_in_a_tight_pool_matches_transformers(tiny_checkpoint: Callable[..., Path], fused: bool,
                                                                   access: str) -> None:
    # Every expert and about one request's state and first chunk: the other requests' state and KV pages are the
    # shortfall the adjuster evicts experts for; past the offload limit (two per layer) decoding requests are
    # preempted and recompute their state; experts grow back once pages are free (finished requests' pages and
    # the state snapshots they left: during the batch or in a light batch after it).
    ckpt = tiny_checkpoint(ARCH, fused_experts=fused, seed=3)
    limit, steps = 2, 40
    budget = tight_budget(ckpt, requests=1, load_buffer_experts=limit if access == "copy" else 0)
    llm = LLM(str(ckpt), gpu_memory_budget=budget, device="cpu", offload_mode="elastic", adjuster="paper",
              expert_offload_limit=limit, max_num_batched_tokens=CHUNK, offload_access=access)
    cache = llm.engine.runtime.cache
    assert cache.num_resident == cache.total_experts
    prompts = engine_prompts((12, 30, 7, 21, 40, 9), seed=23)
    got = greedy(llm, prompts, steps)
    st = llm.stats()
    assert st["expert_evictions"] > 0 and st["preemptions"] > 0 and st["peak_running"] > 1, st
    assert cache.num_resident < cache.total_experts
    assert_nothing_held(llm.engine)
    resident = cache.num_resident
    assert greedy(llm, prompts[:1], steps) == got[:1]
    assert llm.stats()["expert_grows"] > 0 and cache.num_resident >= resident
    assert_nothing_held(llm.engine)
    assert_greedy_matches(ckpt, prompts, got, steps)
    static = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=CHUNK)
    assert greedy(static, prompts, steps) == got  # offloading and preemption never change the tokens
