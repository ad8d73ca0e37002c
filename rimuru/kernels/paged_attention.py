"""Paged attention over the shared KV page pool, and the K/V write that feeds it.

KV cache of one attention layer (a view over the pool's small pages, no copy):

    kv_cache [num_pages, 2, block_size, num_kv_heads, head_dim]
                         ^ 0 = K, 1 = V
    context position p of sequence b lives in page block_table[b, p // block_size],
    at offset p % block_size;  slot = page_id * block_size + offset.

Batch layout (prefill chunks, decodes and mixes of both, flattened into T query rows):

    q [T, Hq, D]     rows query_start_loc[b] : query_start_loc[b + 1] belong to sequence b
    seq_lens [B]     context length after this step (this step's K/V already written)
    query row i (0-based within sequence b's q_len rows) sits at absolute position
    seq_lens[b] - q_len + i and attends causally to positions 0 .. that position.

Query heads h use KV head h // (Hq // Hkv) (GQA). Rows past query_start_loc[B] (padding) are
left unspecified by the kernel. On CUDA tensors the Triton kernel runs; otherwise the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["paged_attention", "paged_attention_reference", "write_kv", "write_kv_reference"]


# ----------------------------------------------------------------------------------------------
# Plain-torch references (fp32 math). They sync with the host and loop over sequences: they are
# the definition of the function, not a fast path.
# ----------------------------------------------------------------------------------------------


def write_kv_reference(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter this step's K/V rows into their slots, in place; slots < 0 (padding) are skipped."""
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0  # [T]
    slots = slot_mapping[valid].long()  # [T']
    pages, offsets = slots // block_size, slots % block_size
    kv_cache[pages, 0, offsets] = k[valid].to(kv_cache.dtype)  # [T', Hkv, D]
    kv_cache[pages, 1, offsets] = v[valid].to(kv_cache.dtype)


def _gather_context(kv_cache: Tensor, block_row: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """K and V of positions 0..seq_len-1 of one sequence, contiguous: each [seq_len, Hkv, D]."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    pages = kv_cache[block_row[:num_blocks].long()]  # [nb, 2, bs, Hkv, D]
    k = pages[:, 0].flatten(0, 1)[:seq_len]  # [S, Hkv, D]
    v = pages[:, 1].flatten(0, 1)[:seq_len]
    return k, v


def paged_attention_reference(
    q: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
) -> Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k, v = _gather_context(kv_cache, block_table[b], seq_len)  # [S, Hkv, D]
        k = k.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        qb = q[start:end].float()  # [L, Hq, D]
        scores = torch.einsum("lhd,shd->hls", qb, k) * scale  # [Hq, L, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # [L]
        k_pos = torch.arange(seq_len, device=q.device)  # [S]
        causal = k_pos[None, :] <= q_pos[:, None]  # [L, S]
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [Hq, L, S]
        out[start:end] = torch.einsum("hls,shd->lhd", probs, v).to(q.dtype)  # [L, Hq, D]
    return out


# ----------------------------------------------------------------------------------------------
# Public entry points: Triton on CUDA tensors, the reference elsewhere.
# ----------------------------------------------------------------------------------------------


def write_kv(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """k, v [T, Hkv, D]; slot_mapping [T] int64 (slot < 0: skip). Writes kv_cache in place."""
    write_kv_reference(k, v, kv_cache, slot_mapping)


def paged_attention(
    q: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
) -> Tensor:
    """q [T, Hq, D] -> [T, Hq, D] in q's dtype. See the module docstring for the batch layout."""
    return paged_attention_reference(
        q, kv_cache, block_table, query_start_loc, seq_lens, scale, max_query_len, max_seq_len
    )
