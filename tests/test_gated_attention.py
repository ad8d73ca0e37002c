"""Rimuru's gated attention against transformers' Qwen3.5-MoE attention layer (CPU, float32).

Both attend over plain contiguous K/V of one sequence (no cache), and ours once more over paged KV at
shuffled pages of a NaN-filled cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from rimuru.models.forward_batch import ForwardBatch
from rimuru.models.gated_attention import GatedAttention
from rimuru.models.rotary import RotaryEmbedding

transformers = pytest.importorskip("transformers")
from transformers import Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf  # noqa: E402

ATOL = 1e-4
HIDDEN, HQ, HKV, D = 32, 4, 2, 16
BLOCK = 4


def tiny_config() -> Qwen3_5MoeTextConfig:
    cfg = Qwen3_5MoeTextConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        vocab_size=64, layer_types=["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


def make_pair() -> tuple[hf.Qwen3_5MoeAttention, GatedAttention, hf.Qwen3_5MoeTextRotaryEmbedding, RotaryEmbedding]:
    torch.manual_seed(0)
    cfg = tiny_config()
    ref = hf.Qwen3_5MoeAttention(cfg, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours = GatedAttention(HIDDEN, HQ, HKV, D, attn_idx=0, eps=cfg.rms_norm_eps).eval()
    with torch.no_grad():  # what the loader does: the checkpoint's projections are shards of qkv_proj
        ours.qkv_proj.weight.copy_(torch.cat([ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight]))
        ours.o_proj.weight.copy_(ref.o_proj.weight)
        ours.q_norm.weight.copy_(ref.q_norm.weight)
        ours.k_norm.weight.copy_(ref.k_norm.weight)
    rope = RotaryEmbedding.from_factor(D, 1e7, 0.25)
    return ref, ours, hf.Qwen3_5MoeTextRotaryEmbedding(cfg), rope


def reference(ref: hf.Qwen3_5MoeAttention, ref_rope: hf.Qwen3_5MoeTextRotaryEmbedding, x: Tensor) -> Tensor:
    T = x.shape[0]
    cos, sin = ref_rope(x, torch.arange(T)[None, None].expand(3, 1, T))
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]  # additive causal mask
    return ref(x[None], position_embeddings=(cos, sin), attention_mask=mask)[0][0]  # [T, hidden]


@torch.no_grad()
def test_contiguous_kv_matches_reference() -> None:
    ref, ours, ref_rope, rope = make_pair()
    x = torch.randn(13, HIDDEN)
    cos, sin = rope.cos_sin(torch.arange(13), torch.float32)
    q, k, v, gate = ours.project(x, cos, sin)
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(HQ // HKV, 1).transpose(0, 1),
        v.repeat_interleave(HQ // HKV, 1).transpose(0, 1), is_causal=True, scale=ours.scale,
    ).transpose(0, 1)  # [T, Hq, D]
    torch.testing.assert_close(ours.gate_output(attn, gate), reference(ref, ref_rope, x), atol=ATOL, rtol=0)


@torch.no_grad()
def test_paged_forward_matches_reference() -> None:
    ref, ours, ref_rope, rope = make_pair()
    T = 11
    x = torch.randn(T, HIDDEN)
    n_blocks = -(-T // BLOCK)
    pages = torch.randperm(8)[:n_blocks]
    kv_cache = torch.full((8, 2, BLOCK, HKV, D), float("nan"))
    positions = torch.arange(T)
    slots = pages[positions // BLOCK] * BLOCK + positions % BLOCK
    batch = ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.long), positions=positions,
        query_start_loc=torch.tensor([0, T], dtype=torch.int32), seq_lens=torch.tensor([T], dtype=torch.int32),
        block_tables=pages.int()[None, None], slot_mapping=slots[None], logits_indices=torch.tensor([T - 1]),
        max_query_len=T, max_seq_len=T,
    )  # fmt: skip
    cos, sin = rope.cos_sin(positions, torch.float32)
    out = ours(x, cos, sin, kv_cache, batch)
    torch.testing.assert_close(out, reference(ref, ref_rope, x), atol=ATOL, rtol=0)
