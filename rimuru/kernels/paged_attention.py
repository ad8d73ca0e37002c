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

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rimuru.kernels.launch import next_pow2, warn_once
from rimuru.kernels.triton_import import tl, triton

__all__ = [
    "LaunchPlan",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_triton",
    "plan_launch",
    "q_tile_starts",
    "tile_map_block_q",
    "write_kv",
    "write_kv_reference",
    "write_kv_triton",
]


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
    page_ids = block_row[:num_blocks].long()  # [nb]
    # A clear error instead of a device-side assert in the gather (a sequence longer than its pages).
    in_pool = num_blocks == 0 or 0 <= int(page_ids.min()) <= int(page_ids.max()) < kv_cache.shape[0]
    if num_blocks > block_row.shape[0] or not in_pool:
        raise ValueError(
            f"seq_len {seq_len} needs {num_blocks} pages; its block table row holds {page_ids.tolist()} "
            f"for a pool of {kv_cache.shape[0]} pages"
        )
    pages = kv_cache[page_ids]  # [nb, 2, bs, Hkv, D]
    k = pages[:, 0].flatten(0, 1)[:seq_len]  # [S, Hkv, D]
    v = pages[:, 1].flatten(0, 1)[:seq_len]
    return k, v


def paged_attention_reference(
    q: Tensor, kv_cache: Tensor, block_table: Tensor, query_start_loc: Tensor, seq_lens: Tensor, scale: float,
    max_query_len: int, max_seq_len: int,
) -> Tensor:  # fmt: skip
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
# Triton kernels.
#
# Attention program (q_tile, b, kv_head * NUM_SPLITS + split) computes, for sequence b, query
# tokens [q_tile * BLOCK_Q, (q_tile + 1) * BLOCK_Q) of that sequence and ALL the query heads of one
# KV head group, packed as the rows of one tile so each K/V tile is read once per group:
#
#     tile row r  ->  token q_tile * BLOCK_Q + r // GROUP,  query head kv_head * GROUP + r % GROUP
#     BLOCK_M = next_pow2(max(16, BLOCK_Q * GROUP))   (rows past BLOCK_Q * GROUP are padding)
#
# It walks the KV tiles [0, kv_end) of the context (kv_end = last valid row's position + 1: tiles
# past the causal frontier are never loaded) with an online softmax in the log2 domain. A KV tile
# of BLOCK_N positions spans BLOCK_N / BLOCK_SIZE whole pages, looked up once per tile.
#
# Split-K (flash-decoding): when there are few programs (decode of one or a few sequences), the
# KV tiles of each (q_tile, b, kv_head) are cut into NUM_SPLITS contiguous ranges; each split
# writes its normalised partial output and log2-sum-exp, and a second kernel merges them. The
# grid depends only on (max_query_len, B, heads), never on sequence lengths: no host sync, and a
# launch can be captured in a CUDA graph.
# ----------------------------------------------------------------------------------------------

if triton is not None:

    # Per-step integers (counts, the block table's width) are not specialised on (== 1, divisible by 16), nor the
    # index arrays' addresses on alignment (a layer's block-table row of a [L, B, W] table starts wherever l*B*W
    # puts it): every new batch shape would otherwise compile another variant in the middle of an eager step.
    @triton.jit(do_not_specialize=["num_tokens", "num_seqs", "stride_bt_b"],
                do_not_specialize_on_alignment=["block_table_ptr", "query_start_loc_ptr", "seq_lens_ptr",
                                                "q_tile_start_ptr"])
    def _paged_attention_kernel(
        q_ptr,  # [T, Hq, D]
        kv_ptr,  # [P, 2, BLOCK_SIZE, Hkv, D]
        block_table_ptr,  # [B, max_blocks] int32
        query_start_loc_ptr,  # [B + 1] int32
        seq_lens_ptr,  # [B] int32
        out_ptr,  # [T, Hq, D] (NUM_SPLITS == 1)
        part_out_ptr,  # [NUM_SPLITS, T, Hq, D_PAD] fp32 (NUM_SPLITS > 1)
        part_lse_ptr,  # [NUM_SPLITS, T, Hq] fp32, log2 domain
        q_tile_start_ptr,  # [B + 1] int32, TILE_MAP only: first program of each sequence's q tiles
        scale_log2,  # softmax scale * log2(e)
        num_tokens,
        num_seqs,
        stride_q_t,
        stride_q_h,
        stride_kv_page,
        stride_kv_kind,
        stride_kv_slot,
        stride_kv_head,
        stride_bt_b,
        stride_o_t,
        stride_o_h,
        NUM_Q_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        TILE_MAP: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,  # TILE_MAP: binary-search steps, >= bit length of num_seqs
    ):
        if TILE_MAP:
            # Program p of axis 0 is q tile p - q_tile_start[b] of the sequence b with
            # q_tile_start[b] <= p < q_tile_start[b + 1] (binary search; the grid is a bound that
            # depends only on the padded token and sequence counts, so one launch fits any batch).
            pid = tl.program_id(0)
            lo = pid * 0
            hi = lo + num_seqs
            for _ in tl.static_range(SEARCH_STEPS):
                mid = (lo + hi) // 2
                ok = tl.load(q_tile_start_ptr + mid) <= pid
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
            b = lo
            q_tile = pid - tl.load(q_tile_start_ptr + b)
        else:
            # Longest causal rows first: later q tiles see more context, so launch them first.
            q_tile = tl.num_programs(0) - 1 - tl.program_id(0)
            b = tl.program_id(1)
        kv_head = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS

        q_start = tl.load(query_start_loc_ptr + b)
        q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
        if q_tile * BLOCK_Q >= q_len:  # the grid is sized for max_query_len
            return
        seq_len = tl.load(seq_lens_ptr + b)
        first_pos = seq_len - q_len  # absolute position of the sequence's query token 0

        rows = tl.arange(0, BLOCK_M)
        tok = q_tile * BLOCK_Q + rows // GROUP  # [BLOCK_M] token within the sequence
        head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
        row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
        q_pos = first_pos + tok  # [BLOCK_M]
        offs_d = tl.arange(0, D_PAD)
        d_valid = offs_d < HEAD_DIM

        q_offs = (q_start + tok)[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)  # [M, D_PAD]

        # KV range of this q tile, then this split's share of its tiles.
        last_tok = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
        kv_end = first_pos + last_tok + 1
        num_kv_tiles = tl.cdiv(kv_end, BLOCK_N)
        tiles_per_split = tl.cdiv(num_kv_tiles, NUM_SPLITS)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_kv_tiles)

        offs_n = tl.arange(0, BLOCK_N)
        bt_row = block_table_ptr + b * stride_bt_b
        kv_head_ptr = kv_ptr + kv_head * stride_kv_head

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for tile in range(tile_lo, tile_hi):
            start_n = tile * BLOCK_N
            k_pos = start_n + offs_n  # [N]
            # The page of every position (BLOCK_N // BLOCK_SIZE distinct block-table entries, cached). No
            # reshape: it would hide the offsets' divisibility from Triton, which then loads K/V 2 bytes at a
            # time instead of 16 (128 scalar loads per tile in the PTX, ~35 % of HBM bandwidth).
            pages = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_pos < kv_end, other=0)
            slot_offs = pages.to(tl.int64) * stride_kv_page + (k_pos % BLOCK_SIZE) * stride_kv_slot  # [N]
            kv_mask = (k_pos < kv_end)[:, None] & d_valid[None, :]
            kv_offs = slot_offs[:, None] + offs_d[None, :]  # [N, D_PAD]
            k = tl.load(kv_head_ptr + kv_offs, mask=kv_mask, other=0.0)  # [N, D_PAD]
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N]
            qk = tl.where(k_pos[None, :] <= q_pos[:, None], qk, float("-inf"))  # causal (and < kv_end)

            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row may see no key yet in this split (its first tiles are in its future): keep it
            # at m = -inf without producing NaN from (-inf) - (-inf).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)  # [M]
            p = tl.exp2(qk - m_safe[:, None])  # [M, N]
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(kv_head_ptr + stride_kv_kind + kv_offs, mask=kv_mask, other=0.0)  # [N, D_PAD]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        token = q_start + tok  # [M] row of q / out
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            o_offs = token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :]
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
        else:
            # Partial of an empty split: out 0, lse -inf (weight 0 in the merge).
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_i), float("-inf"))  # [M]
            row = (split * num_tokens + token).to(tl.int64) * NUM_Q_HEADS + head  # [M]
            tl.store(part_out_ptr + row[:, None] * D_PAD + offs_d[None, :], out, mask=row_valid[:, None])
            tl.store(part_lse_ptr + row, lse, mask=row_valid)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _merge_splits_kernel(
        part_out_ptr,  # [NUM_SPLITS, T, Hq, D_PAD] fp32
        part_lse_ptr,  # [NUM_SPLITS, T, Hq] fp32
        out_ptr,  # [T, Hq, D]
        num_tokens,
        stride_o_t,
        stride_o_h,
        NUM_Q_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        token = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, D_PAD)
        row = (splits * num_tokens + token).to(tl.int64) * NUM_Q_HEADS + head  # [S]
        lse = tl.load(part_lse_ptr + row)  # [S]
        lse_max = tl.max(lse, 0)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # padding rows: all splits empty
        w = tl.exp2(lse - lse_max)  # [S]
        part = tl.load(part_out_ptr + row[:, None] * D_PAD + offs_d[None, :])  # [S, D_PAD]
        out = tl.sum(part * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)  # [D_PAD]
        tl.store(
            out_ptr + token * stride_o_t + head * stride_o_h + offs_d,
            out.to(out_ptr.dtype.element_ty),
            mask=offs_d < HEAD_DIM,
        )

    @triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])  # a layer's row of [L, T]: any alignment
    def _write_kv_kernel(
        k_ptr,  # [T, Hkv, D]
        v_ptr,  # [T, Hkv, D]
        kv_ptr,  # [P, 2, BLOCK_SIZE, Hkv, D]
        slot_mapping_ptr,  # [T] int64
        stride_k_t,
        stride_k_h,
        stride_v_t,
        stride_v_h,
        stride_kv_page,
        stride_kv_kind,
        stride_kv_slot,
        stride_kv_head,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        H_PAD: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        if slot < 0:  # padding token
            return
        offs_h = tl.arange(0, H_PAD)
        offs_d = tl.arange(0, D_PAD)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        dst = kv_ptr + (slot // BLOCK_SIZE) * stride_kv_page + (slot % BLOCK_SIZE) * stride_kv_slot
        dst_offs = offs_h[:, None] * stride_kv_head + offs_d[None, :]  # [H_PAD, D_PAD]
        k = tl.load(k_ptr + t * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
        tl.store(dst + dst_offs, k.to(kv_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_kv_kind + dst_offs, v.to(kv_ptr.dtype.element_ty), mask=mask)


def _check_inner_contiguous(name: str, t: Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last (head_dim) dimension, got strides {t.stride()}")


def write_kv_triton(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    for name, t in (("k", k), ("v", v), ("kv_cache", kv_cache)):
        _check_inner_contiguous(name, t)
    _write_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        H_PAD=next_pow2(num_kv_heads), D_PAD=next_pow2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
    )  # fmt: skip


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter runs: any small number exercises the split path


@dataclass(frozen=True)
class LaunchPlan:
    block_q: int  # query tokens per tile
    block_m: int  # tile rows: block_q tokens x GROUP heads, padded to a power of two >= 16
    block_n: int  # KV positions per tile (whole pages)
    d_pad: int  # head_dim padded to a power of two
    num_splits: int  # flash-decoding splits of the KV range (1: no merge kernel)
    num_q_tiles: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=1024)
def plan_launch(
    batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    max_query_len: int, num_sms: int, elem_size: int = 2,
) -> LaunchPlan:  # fmt: skip
    """Tile sizes and split count. Depends only on shapes and host ints known without a sync, so a
    launch can be captured in a CUDA graph; cached, since a serving loop repeats a few shapes."""
    group = num_q_heads // num_kv_heads
    # Pack ~128 rows (tokens x grouped heads) per prefill tile (64 in fp32, for shared memory);
    # decode uses one token per tile.
    target_rows = 128 if elem_size <= 2 else 64
    block_q = max(1, min(next_pow2(max_query_len), max(1, target_rows // group)))
    block_m = next_pow2(max(16, block_q * group))
    d_pad = next_pow2(max(16, head_dim))
    block_n = 64 if d_pad <= 128 and elem_size <= 2 else 32
    if block_m * d_pad > 128 * 128:
        block_n = 32
    block_n = max(block_n, block_size)  # a KV tile holds whole pages
    num_q_tiles = -(-max_query_len // block_q)
    programs = num_q_tiles * batch * num_kv_heads
    num_splits = 1
    if max_query_len <= 16 and programs < 2 * num_sms:
        # Flash-decoding: enough splits to fill the GPU ~twice; empty splits exit at once.
        num_splits = min(32, next_pow2(-(-2 * num_sms // programs)))
    return LaunchPlan(
        block_q=block_q, block_m=block_m, block_n=block_n, d_pad=d_pad, num_splits=num_splits,
        num_q_tiles=num_q_tiles, num_warps=8 if block_m * d_pad >= 128 * 128 else 4,
        num_stages=2 if num_splits > 1 or elem_size > 2 else 3,
    )  # fmt: skip


_LOG2_E = math.log2(math.e)

# The tile-mapped launch plans as for a long query: the largest q tile (block_q = 128 // GROUP tokens).
TILE_MAP_QUERY_LEN = 1 << 16


def tile_map_block_q(num_q_heads: int, num_kv_heads: int, elem_size: int) -> int:
    """Query tokens per q tile of the tile-mapped launch (what `q_tile_starts` must be computed with)."""
    return plan_launch(1, num_q_heads, num_kv_heads, 128, 16, TILE_MAP_QUERY_LEN, 1, elem_size=elem_size).block_q


def q_tile_starts(query_lens: Sequence[int] | np.ndarray, block_q: int, num_seqs: int) -> np.ndarray:
    """[num_seqs + 1] int32: the first program of each sequence's q tiles in the tile-mapped launch
    (exclusive prefix sum of cdiv(q_len, block_q)); sequences past len(query_lens) are empty."""
    lens = np.asarray(query_lens, dtype=np.int64)
    out = np.empty(num_seqs + 1, dtype=np.int32)
    out[0] = 0
    tiles = np.cumsum(-(-lens // block_q))
    out[1 : len(lens) + 1] = tiles
    out[len(lens) + 1 :] = tiles[-1] if len(lens) else 0
    return out


def paged_attention_triton(
    q: Tensor, kv_cache: Tensor, block_table: Tensor, query_start_loc: Tensor, seq_lens: Tensor, scale: float,
    max_query_len: int, max_seq_len: int,
    num_splits: int | None = None,
    out: Tensor | None = None,
    q_tile_start: Tensor | None = None,
    plan_override: dict[str, int] | None = None,
) -> Tensor:  # fmt: skip
    """The Triton path of paged_attention; `num_splits` overrides the plan, `out` receives rows.

    With `q_tile_start` [B + 1] int32 (`q_tile_starts`), the grid is a bound fixed by (T, B) alone and each
    program finds its (sequence, q tile) on the device: one launch serves any mix of prefill chunks and
    decodes of at most T tokens and B sequences, so a CUDA graph captured for (T, B) replays every such
    step. Sequences may have q_len 0 (padding). Rows not covered by any sequence come out 0."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, kv_head_dim = kv_cache.shape
    batch = seq_lens.shape[0]
    if num_q_heads % num_kv_heads or kv_head_dim != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not match kv_cache {tuple(kv_cache.shape)}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    _check_inner_contiguous("q", q)
    _check_inner_contiguous("kv_cache", kv_cache)
    tile_map = q_tile_start is not None
    if out is None:
        out = torch.zeros_like(q) if tile_map else torch.empty_like(q)
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    plan = plan_launch(
        batch, num_q_heads, num_kv_heads, head_dim, block_size,
        TILE_MAP_QUERY_LEN if tile_map else max_query_len, _num_sms(q.device), elem_size=q.element_size(),
    )  # fmt: skip
    if plan_override:  # tuning sweeps (benchmarks/tune_paged_attention.py): block_n, num_warps, num_stages, ...
        plan = dataclasses.replace(plan, **plan_override)
    splits = plan.num_splits if num_splits is None else num_splits  # tests force the split path
    if tile_map:
        if splits != 1:
            raise ValueError("the tile-mapped launch has no split-K path")
        if q_tile_start.shape[0] != batch + 1:
            raise ValueError(f"q_tile_start has {q_tile_start.shape[0]} entries for {batch} sequences")
    d_pad = plan.d_pad
    if splits > 1:
        part_out = torch.empty(splits, num_tokens, num_q_heads, d_pad, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(splits, num_tokens, num_q_heads, device=q.device, dtype=torch.float32)
    else:
        part_out = part_lse = out  # unused
    if tile_map:
        grid = (-(-num_tokens // plan.block_q) + batch, 1, num_kv_heads)  # >= sum of cdiv(q_len_b, block_q)
    else:
        grid = (plan.num_q_tiles, batch, num_kv_heads * splits)
    _paged_attention_kernel[grid](
        q, kv_cache, block_table, query_start_loc, seq_lens, out, part_out, part_lse,
        q_tile_start if tile_map else seq_lens, scale * _LOG2_E, num_tokens, batch,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0), out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_q_heads, GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        BLOCK_SIZE=block_size, NUM_SPLITS=splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        TILE_MAP=tile_map, SEARCH_STEPS=batch.bit_length() if tile_map else 0,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            part_out, part_lse, out, num_tokens, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=splits,
        )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# Public entry points: Triton on CUDA tensors, the reference elsewhere.
# ----------------------------------------------------------------------------------------------

NO_TRITON_ON_CUDA = ("paged attention: Triton is not installed, so CUDA tensors take the torch reference (a loop "
                     "over sequences with host syncs in every layer: far slower)")


def write_kv(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """k, v [T, Hkv, D]; slot_mapping [T] int64 (slot < 0: skip). Writes kv_cache in place."""
    if kv_cache.is_cuda and triton is not None:
        write_kv_triton(k, v, kv_cache, slot_mapping)
        return
    if kv_cache.is_cuda:
        warn_once(NO_TRITON_ON_CUDA)
    write_kv_reference(k, v, kv_cache, slot_mapping)


def paged_attention(
    q: Tensor, kv_cache: Tensor, block_table: Tensor, query_start_loc: Tensor, seq_lens: Tensor, scale: float,
    max_query_len: int, max_seq_len: int,
    q_tile_start: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """q [T, Hq, D] -> [T, Hq, D] in q's dtype. See the module docstring for the batch layout.
    `q_tile_start` (CUDA graphs of mixed steps) selects the tile-mapped launch; the reference ignores it."""
    if q.is_cuda and triton is not None:
        return paged_attention_triton(q, kv_cache, block_table, query_start_loc, seq_lens, scale, max_query_len,
                                      max_seq_len, q_tile_start=q_tile_start)
    if q.is_cuda:
        warn_once(NO_TRITON_ON_CUDA)
    return paged_attention_reference(q, kv_cache, block_table, query_start_loc, seq_lens, scale, max_query_len,
                                     max_seq_len)
