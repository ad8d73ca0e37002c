"""Paged attention: reference vs contiguous causal SDPA, Triton kernel vs reference.

CPU: the reference is checked against per-sequence contiguous attention (float64 SDPA with an
explicit causal mask). The Triton kernel runs under TRITON_INTERPRET=1 in a subprocess (Triton
reads that variable when a kernel is decorated, i.e. at import). GPU tests (`-m gpu`) compare the
kernel with the reference in bf16/fp16/fp32 over many random shapes.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from rimuru.kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    write_kv,
    write_kv_reference,
)

REPO = Path(__file__).resolve().parents[1]
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@dataclass
class Case:
    q: Tensor  # [T, Hq, D]
    kv_cache: Tensor  # [P, 2, bs, Hkv, D]
    block_table: Tensor  # [B, max_blocks] int32
    query_start_loc: Tensor  # [B + 1] int32
    seq_lens: Tensor  # [B] int32
    scale: float
    max_query_len: int
    max_seq_len: int
    keys: list[Tensor]  # per sequence [S, Hkv, D]: the contiguous truth
    values: list[Tensor]

    def args(self) -> tuple:
        return (
            self.q, self.kv_cache, self.block_table, self.query_start_loc, self.seq_lens,
            self.scale, self.max_query_len, self.max_seq_len,
        )  # fmt: skip


def make_case(
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    spare_pages: int = 5,
    num_pages: int | None = None,
    max_blocks: int | None = None,
) -> Case:
    """Sequences with q_lens[b] new tokens at the end of seq_lens[b] context, on shuffled pages.
    `num_pages` / `max_blocks` fix the pool and block-table shapes (cases that refill one graph's buffers)."""
    assert all(0 <= ql <= sl for ql, sl in zip(q_lens, seq_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_pages = sum(blocks) + spare_pages if num_pages is None else num_pages
    assert num_pages >= sum(blocks)
    # Every page starts as noise: a kernel that reads the wrong page or slot is caught.
    kv_cache = torch.randn(num_pages, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_pages, generator=gen)
    max_blocks = max(blocks + [1]) + 2 if max_blocks is None else max_blocks
    assert max_blocks >= max(blocks + [1])
    # Unused block-table entries point far outside the pool: reading one would fault.
    block_table = torch.full((len(seq_lens), max_blocks), num_pages + 10_000, dtype=torch.int32)
    keys, values, used = [], [], 0
    for b, s in enumerate(seq_lens):
        block_table[b, : blocks[b]] = perm[used : used + blocks[b]].int()
        used += blocks[b]
        k = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)  # [S, Hkv, D]
        v = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(s)
        slots = block_table[b, pos // block_size].long() * block_size + pos % block_size  # [S]
        write_kv_reference(k, v, kv_cache, slots)
        keys.append(k)
        values.append(v)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    q = torch.randn(int(qsl[-1]), num_q_heads, head_dim, generator=gen).to(dtype)  # [T, Hq, D]
    return Case(
        q=q.to(device), kv_cache=kv_cache.to(device), block_table=block_table.to(device),
        query_start_loc=qsl.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        scale=head_dim**-0.5, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        keys=keys, values=values,
    )  # fmt: skip


def contiguous_attention(case: Case) -> Tensor:
    """Per-sequence causal SDPA on contiguous K/V in float64, with an explicit mask."""
    q = case.q.cpu().double()
    out = torch.zeros_like(q)
    qsl = case.query_start_loc.tolist()
    group = q.shape[1] // case.keys[0].shape[1] if case.keys else 1
    for b, s in enumerate(case.seq_lens.tolist()):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        k = case.keys[b].double().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, S, D]
        v = case.values[b].double().repeat_interleave(group, 1).transpose(0, 1)
        q_pos = torch.arange(s - (end - start), s)  # [L]
        mask = torch.arange(s)[None, :] <= q_pos[:, None]  # [L, S]
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k, v, attn_mask=mask, scale=case.scale)
        out[start:end] = o.transpose(0, 1)  # [L, Hq, D]
    return out


def rel_err(out: Tensor, ref: Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def random_batch(rng: random.Random, max_batch: int, max_ctx: int, max_chunk: int) -> tuple[list, list]:
    """A mixed batch: decodes (q_len 1), first prefill chunks and later chunks over earlier context."""
    q_lens, seq_lens = [], []
    for _ in range(rng.randint(1, max_batch)):
        kind = rng.choice(["decode", "prefill", "chunk"])
        ctx = rng.randint(1, max_ctx)
        if kind == "decode":
            q_lens.append(1)
            seq_lens.append(ctx)
        elif kind == "prefill":
            q = rng.randint(1, max_chunk)
            q_lens.append(q)
            seq_lens.append(q)
        else:
            q = rng.randint(1, max_chunk)
            q_lens.append(q)
            seq_lens.append(ctx + q)
    return q_lens, seq_lens


# ---------------------------------------------------------------------------------------------
# The reference against contiguous attention (CPU).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", range(3))
def test_reference_matches_contiguous_mixed(group: int, seed: int) -> None:
    rng = random.Random(seed * 10 + group)
    q_lens, seq_lens = random_batch(rng, max_batch=6, max_ctx=80, max_chunk=40)
    num_kv_heads = rng.choice([1, 2])
    case = make_case(q_lens, seq_lens, num_kv_heads * group, num_kv_heads, rng.choice([16, 32, 40]), seed=seed)
    out = paged_attention_reference(*case.args())
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    torch.testing.assert_close(out.double(), contiguous_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 31, 32, 33])
def test_reference_block_boundaries(length: int) -> None:
    # Whole-prompt prefill, decode at that length, and a 3-token chunk ending there.
    q_lens = [length, 1, min(3, length)]
    case = make_case(q_lens, [length] * 3, 4, 2, 32, seed=length)
    torch.testing.assert_close(paged_attention(*case.args()).double(), contiguous_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reference_other_block_sizes(block_size: int) -> None:
    case = make_case([5, 1, 33], [40, 17, 33], 8, 2, 64, block_size=block_size, seed=block_size)
    torch.testing.assert_close(paged_attention(*case.args()).double(), contiguous_attention(case), atol=1e-5, rtol=1e-5)


def test_reference_bf16_returns_q_dtype() -> None:
    case = make_case([7, 1], [20, 33], 4, 4, 64, dtype=torch.bfloat16, seed=3)
    out = paged_attention_reference(*case.args())
    assert out.dtype == torch.bfloat16
    assert rel_err(out, contiguous_attention(case)) < 1e-2


def test_reference_empty_sequence_in_batch() -> None:
    # A sequence with no query rows this step (q_len 0) contributes nothing and breaks nothing.
    case = make_case([3, 0, 1], [10, 5, 20], 2, 1, 16, seed=4)
    torch.testing.assert_close(paged_attention(*case.args()).double(), contiguous_attention(case), atol=1e-5, rtol=1e-5)


def test_write_kv_round_trip_and_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    num_pages, bs, hkv, d = 6, 16, 2, 8
    kv_cache = torch.randn(num_pages, 2, bs, hkv, d, generator=gen)
    before = kv_cache.clone()
    k = torch.randn(10, hkv, d, generator=gen)  # [T, Hkv, D]
    v = torch.randn(10, hkv, d, generator=gen)
    slots = torch.tensor([5 * bs + 3, -1, 0, 2 * bs + 15, -1, 3 * bs, 1, 4 * bs + 7, -1, 17], dtype=torch.int64)
    write_kv(k, v, kv_cache, slots)
    written = torch.zeros(num_pages, bs, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        page, off = divmod(slot, bs)
        written[page, off] = True
        torch.testing.assert_close(kv_cache[page, 0, off], k[t], atol=0, rtol=0)
        torch.testing.assert_close(kv_cache[page, 1, off], v[t], atol=0, rtol=0)
    # Padding rows and every other slot are untouched.
    untouched = ~written  # [P, bs]
    torch.testing.assert_close(kv_cache.transpose(1, 2)[untouched], before.transpose(1, 2)[untouched], atol=0, rtol=0)


def test_write_kv_casts_to_cache_dtype() -> None:
    kv_cache = torch.zeros(2, 2, 16, 1, 4, dtype=torch.bfloat16)
    k = torch.randn(3, 1, 4)
    write_kv(k, k * 2, kv_cache, torch.tensor([0, 17, -1]))
    assert torch.equal(kv_cache[1, 1, 1], (k[1] * 2).bfloat16())


# ---------------------------------------------------------------------------------------------
# The Triton kernel under the interpreter (CPU, float32), in a subprocess.
# ---------------------------------------------------------------------------------------------

INTERPRET_CASES = [
    # q_lens, seq_lens, Hq, Hkv, D, block_size, num_splits (None: the plan's choice)
    ([1, 1, 1], [15, 16, 33], 4, 1, 16, 16, None),  # decode, split path, GQA 4
    ([20, 1, 3], [20, 31, 40], 2, 2, 32, 16, None),  # mixed, no split, MHA
    ([5, 1], [37, 70], 8, 1, 16, 16, 4),  # forced split with q_len > 1, GQA 8
    ([17], [49], 2, 1, 40, 8, None),  # head_dim 40 (padded to 64), block 8, chunk over context
    ([2, 0, 1], [2, 9, 17], 2, 2, 16, 32, 2),  # empty sequence, block 32
]


TILE_MAP_CASES = [
    # q_lens, seq_lens, Hq, Hkv: one prefill chunk longer than a q tile among decodes; GQA; all decode
    ([1, 300, 1, 5], [40, 310, 1, 5], 2, 2),
    ([3, 1, 140], [70, 17, 150], 8, 2),
    ([1, 1, 1], [33, 2, 64], 4, 4),
]


def check_tile_map_case(case: Case, pad_tokens: int, pad_seqs: int, tol: float) -> None:
    """The tile-mapped launch on `case` grown by `pad_tokens` query rows and `pad_seqs` empty sequences (as a
    mixed-step CUDA graph pads a batch): real rows equal the reference, padding rows come out 0."""
    from rimuru.kernels.paged_attention import paged_attention_triton, q_tile_starts, tile_map_block_q

    T, hq, d = case.q.shape
    B = case.seq_lens.shape[0]
    hkv = case.kv_cache.shape[3]
    dev = case.q.device
    q = torch.cat([case.q, torch.randn(pad_tokens, hq, d, device=dev).to(case.q.dtype)])
    qsl = torch.cat([case.query_start_loc, case.query_start_loc[-1:].repeat(pad_seqs)])
    seq_lens = torch.cat([case.seq_lens, torch.zeros(pad_seqs, dtype=torch.int32, device=dev)])
    bt = torch.cat([case.block_table, case.block_table[:1].repeat(pad_seqs, 1)])
    q_lens = (case.query_start_loc[1:] - case.query_start_loc[:-1]).tolist()
    tiles = torch.from_numpy(q_tile_starts(q_lens, tile_map_block_q(hq, hkv, q.element_size()), B + pad_seqs))
    out = paged_attention_triton(q, case.kv_cache, bt, qsl, seq_lens, case.scale, T + pad_tokens,
                                 case.max_seq_len, q_tile_start=tiles.to(dev))
    ref = paged_attention_reference(*case.args())
    err = (out[:T].float() - ref.float()).abs().max().item()
    assert err < tol, f"tile map: max abs err {err} (q_lens {q_lens})"
    assert torch.equal(out[T:], torch.zeros_like(out[T:])), "padding rows must come out 0"


def _patch_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a scalar into an int with int(array of shape (1,)), which
    NumPy >= 2.4 refuses; `range(lo, hi)` over runtime bounds then fails. Use .item() instead."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope) -> None:  # noqa: ANN001 - Triton internals
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def run_interpreter_cases() -> None:
    _patch_interpreter_for_numpy_2_4()
    from rimuru.kernels.paged_attention import paged_attention_triton, write_kv_triton

    for i, (q_lens, seq_lens, hq, hkv, d, bs, splits) in enumerate(INTERPRET_CASES):
        case = make_case(q_lens, seq_lens, hq, hkv, d, block_size=bs, seed=i)
        ref = paged_attention_reference(*case.args())
        out = torch.full_like(case.q, float("nan"))
        paged_attention_triton(*case.args(), num_splits=splits, out=out)
        err = (out - ref).abs().max().item()
        assert err < 1e-4, f"case {i}: max abs err {err}"
    rng = random.Random(0)
    for i, group in enumerate([1, 2, 4, 8, 3]):  # random mixed batches, forced and planned splits
        q_lens, seq_lens = random_batch(rng, max_batch=3, max_ctx=50, max_chunk=20)
        case = make_case(q_lens, seq_lens, group, 1, rng.choice([16, 32]), seed=100 + i)
        for splits in (None, 4) if i % 2 else (1,):
            out = torch.full_like(case.q, float("nan"))
            paged_attention_triton(*case.args(), num_splits=splits, out=out)
            err = (out - paged_attention_reference(*case.args())).abs().max().item()
            assert err < 1e-4, f"random case {i} (group {group}, splits {splits}): max abs err {err}"
    # The tile-mapped launch (CUDA graphs of mixed steps): padded tokens and empty padded sequences.
    for i, (q_lens, seq_lens, hq, hkv) in enumerate(TILE_MAP_CASES):
        check_tile_map_case(make_case(q_lens, seq_lens, hq, hkv, 16, seed=200 + i), pad_tokens=7, pad_seqs=3,
                            tol=1e-4)
    # write_kv through the kernel, with padding slots and a strided k (a slice of a wider tensor).
    kv_a = torch.randn(4, 2, 16, 3, 24)
    kv_b = kv_a.clone()
    kv = torch.randn(6, 2, 3, 24)  # [T, 2, Hkv, D]
    slots = torch.tensor([3, -1, 63, 16, -1, 40])
    write_kv_reference(kv[:, 0], kv[:, 1], kv_a, slots)
    write_kv_triton(kv[:, 0], kv[:, 1], kv_b, slots)
    assert torch.equal(kv_a, kv_b)
    print("interpreter cases passed")


def test_triton_kernel_under_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "interpreter cases passed" in proc.stdout


# ---------------------------------------------------------------------------------------------
# The Triton kernel on the GPU.
# ---------------------------------------------------------------------------------------------

GPU_DTYPES = [torch.bfloat16, torch.float16]


def check_gpu_case(case: Case, num_splits: int | None = None, tol: float = 1e-2) -> None:
    from rimuru.kernels.paged_attention import paged_attention_triton

    out = torch.full_like(case.q, float("nan"))  # poison: every row must be written
    paged_attention_triton(*case.args(), num_splits=num_splits, out=out)
    ref = paged_attention_reference(*case.args())
    assert not out.isnan().any(), "rows left unwritten or NaN produced"
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.3g}"


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seed", range(4))
def test_gpu_mixed_batches(dtype: torch.dtype, group: int, head_dim: int, seed: int) -> None:
    rng = random.Random(hash((group, head_dim, seed)) & 0xFFFF)
    q_lens, seq_lens = random_batch(rng, max_batch=12, max_ctx=1200, max_chunk=300)
    hkv = rng.choice([1, 2, 4])
    case = make_case(q_lens, seq_lens, hkv * group, hkv, head_dim, dtype=dtype, device="cuda", seed=seed)
    check_gpu_case(case)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 64])
@pytest.mark.parametrize("shape", [(16, 16, 128), (32, 4, 128), (8, 1, 64)])
def test_gpu_decode(dtype: torch.dtype, batch: int, shape: tuple[int, int, int]) -> None:
    rng = random.Random(batch)
    seq_lens = [rng.choice([1, 15, 16, 17, rng.randint(1, 3000)]) for _ in range(batch)]
    hq, hkv, d = shape
    case = make_case([1] * batch, seq_lens, hq, hkv, d, dtype=dtype, device="cuda", seed=batch)
    check_gpu_case(case)  # the plan's split count
    check_gpu_case(case, num_splits=1)
    check_gpu_case(case, num_splits=8)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("length", [15, 16, 17, 31, 32, 33, 127, 128, 129, 1000])
def test_gpu_block_boundaries(dtype: torch.dtype, length: int) -> None:
    case = make_case([length, 1, min(length, 5)], [length] * 3, 8, 2, 128, dtype=dtype, device="cuda", seed=length)
    check_gpu_case(case)


@gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [16, 32, 40, 80, 96, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_head_dims_and_block_sizes(head_dim: int, block_size: int) -> None:
    case = make_case(
        [1, 40, 200], [300, 40, 500], 8, 2, head_dim, block_size=block_size, dtype=torch.bfloat16, device="cuda"
    )
    check_gpu_case(case)
    check_gpu_case(make_case([1, 1], [700, 3], 8, 2, head_dim, block_size=block_size, dtype=torch.bfloat16,
                             device="cuda"))  # fmt: skip


@gpu
@needs_cuda
def test_gpu_float32_and_long_prefill() -> None:
    case = make_case([1, 64], [900, 2000], 4, 4, 128, dtype=torch.float32, device="cuda")
    check_gpu_case(case, tol=1e-4)
    case = make_case([4096, 1], [4096, 4096], 32, 4, 128, dtype=torch.bfloat16, device="cuda")
    check_gpu_case(case)


@gpu
@needs_cuda
def test_gpu_strided_q_and_dispatch() -> None:
    # q as a slice of a fused qkv projection: non-contiguous rows, contiguous head_dim.
    case = make_case([9, 1], [30, 50], 8, 2, 64, dtype=torch.bfloat16, device="cuda")
    qkv = torch.randn(case.q.shape[0], 12 * 64, dtype=torch.bfloat16, device="cuda")
    qkv[:, : 8 * 64] = case.q.flatten(1)
    case.q = qkv[:, : 8 * 64].view(-1, 8, 64)
    out = paged_attention(*case.args())  # public entry point: Triton on CUDA
    assert rel_err(out, paged_attention_reference(*case.args())) < 1e-2


@gpu
@needs_cuda
def test_gpu_write_kv_matches_reference() -> None:
    kv_a = torch.randn(20, 2, 16, 4, 128, device="cuda", dtype=torch.bfloat16)
    kv_b = kv_a.clone()
    kv = torch.randn(50, 2, 4, 128, device="cuda")  # fp32 input, bf16 cache
    slots = torch.randperm(320, device="cuda")[:50]
    slots[::7] = -1
    write_kv_reference(kv[:, 0], kv[:, 1], kv_a, slots)
    write_kv(kv[:, 0], kv[:, 1], kv_b, slots)
    assert torch.equal(kv_a, kv_b)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case_idx", range(len(TILE_MAP_CASES)))
def test_gpu_tile_map(dtype: torch.dtype, case_idx: int) -> None:
    q_lens, seq_lens, hq, hkv = TILE_MAP_CASES[case_idx]
    check_tile_map_case(make_case(q_lens, seq_lens, hq, hkv, 128, dtype=dtype, device="cuda", seed=case_idx),
                        pad_tokens=37, pad_seqs=5, tol=2e-2)


def test_q_tile_starts() -> None:
    from rimuru.kernels.paged_attention import q_tile_starts

    assert q_tile_starts([1, 300, 128, 129], 128, 6).tolist() == [0, 1, 4, 5, 7, 7, 7]
    assert q_tile_starts([], 16, 2).tolist() == [0, 0, 0]


@gpu
@needs_cuda
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_cuda_graph_replay_with_new_lengths(q_len: int) -> None:
    # A decode step as the engine captures it: write this step's K/V through the slot mapping, then
    # attend. Grids depend only on shapes and host ints, so one capture serves any lengths and pages
    # that fit the static buffers. Every case below has the same buffer shapes (pool, block table
    # width) and each sequence owns enough pages for its length: refilling the buffers and replaying
    # must equal contiguous attention on the new contents. (A sequence grown past its pages would
    # make the block table point outside the pool, and the reference's gather assert on the device.)
    B, hq, hkv, d, bs = 4, 16, 4, 128, 16
    shapes = dict(num_pages=100, max_blocks=30, dtype=torch.bfloat16, device="cuda")
    lengths = [[100, 200, 300, 400], [17, 400, 4, 250], [16, 33, 479, 5]]
    cases = [make_case([q_len] * B, sl, hq, hkv, d, block_size=bs, seed=i, **shapes) for i, sl in enumerate(lengths)]
    static = make_case([q_len] * B, lengths[0], hq, hkv, d, block_size=bs, seed=0, **shapes)  # the graph's buffers
    k_new = torch.empty(B * q_len, hkv, d, dtype=torch.bfloat16, device="cuda")  # [T, Hkv, D]
    v_new = torch.empty_like(k_new)
    slot_mapping = torch.empty(B * q_len, dtype=torch.int64, device="cuda")  # [T]

    def load(case: Case) -> None:
        """Copy a case into the static buffers; its last q_len positions are written by the graph."""
        static.q.copy_(case.q)
        static.block_table.copy_(case.block_table)
        static.seq_lens.copy_(case.seq_lens)
        static.query_start_loc.copy_(case.query_start_loc)
        static.kv_cache.copy_(case.kv_cache)
        rows, slots = [], []
        for b, s in enumerate(case.seq_lens.tolist()):
            pos = torch.arange(s - q_len, s)  # [L] this step's positions
            slots.append(case.block_table[b, pos // bs].cpu().long() * bs + pos % bs)
            rows.append((case.keys[b][s - q_len :], case.values[b][s - q_len :]))
        slot_mapping.copy_(torch.cat(slots))
        k_new.copy_(torch.cat([k for k, _ in rows]))
        v_new.copy_(torch.cat([v for _, v in rows]))
        # Poison this step's slots in the pool: only the captured write_kv can restore them.
        static.kv_cache[slot_mapping // bs, :, slot_mapping % bs] = float("nan")  # [T, 2, Hkv, D]

    def step() -> Tensor:
        write_kv(k_new, v_new, static.kv_cache, slot_mapping)
        return paged_attention(*static.args())

    load(static)
    stream = torch.cuda.Stream()  # compile and warm up outside the graph, on a side stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()  # [T, Hq, D], a static output
    for case in (*cases[1:], cases[0]):
        load(case)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any(), "rows left unwritten, or the K/V write did not replay"
        ref = contiguous_attention(case)
        assert rel_err(out, ref) < 1e-2, case.seq_lens.tolist()
        assert rel_err(paged_attention_reference(*static.args()), ref) < 1e-2


if __name__ == "__main__":
    run_interpreter_cases()


@gpu
@needs_cuda
def test_gpu_without_triton_warns_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # CUDA tensors without Triton fall back to the slow reference: said once per process, not per layer.
    import rimuru.kernels.paged_attention as pa
    from rimuru.kernels.launch import warn_once

    monkeypatch.setattr(pa, "triton", None)
    warn_once.cache_clear()
    case = make_case([3, 1], [20, 9], 4, 2, 64, device="cuda")
    k = torch.randn(4, 2, 64, device="cuda")
    slots = torch.arange(4, device="cuda")
    with caplog.at_level(logging.WARNING, logger="rimuru"):
        for _ in range(2):
            write_kv(k, k, case.kv_cache.clone(), slots)
            out = paged_attention(*case.args())
    assert [r.getMessage() for r in caplog.records] == [pa.NO_TRITON_ON_CUDA]
    assert torch.equal(out, paged_attention_reference(*case.args()))
