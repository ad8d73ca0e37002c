"""Sort token x top-k assignments by expert and pad each expert's group to the M tile, on the device.

Assignment i = t * k + j (token t, its j-th expert). The output layout, for BLOCK_M = 4:

    sorted_ids:  | e0: 5 9 2 S | e2: 0 7 S S | e3: 1 3 4 8 | e3: 6 S S S | S ... (tail up to max_padded)
    block_end:   [4, 4, 8, 16]       inclusive cumsum of padded group sizes, in rows (e1 has no tokens)

S = n (= T*k) is the padding sentinel. M block b belongs to the expert e with
block_end[e-1] <= b*BLOCK_M < block_end[e] (the GEMM kernels search block_end themselves, so no
per-block expert array is needed); blocks at or past block_end[E-1] are empty. No host sync: the
grid is sized by the bound `max_blocks`, the kernels skip blocks past the real end.

Two Triton paths give the same layout as the stable sort of `moe_align_torch` (within an expert, assignments in
index order). Up to SINGLE_PROGRAM_MAX assignments one program sorts them all (decode and small prefill, where the
launch count dominates). Beyond it three launches over chunks of CHUNK assignments:

    count    program c: the histogram of chunk c's experts             -> counts [C, BLOCK_E]
    scan     one program: per expert the total, its padded start (block_end), and for every chunk where its
             assignments of each expert start; fills sorted_ids with the sentinel S
    scatter  program c: sorts chunk c's (expert, index) keys and writes each assignment at its chunk's start for
             its expert plus its rank among the chunk's assignments of that expert

The torch ops are the path without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rimuru.kernels.launch import next_pow2
from rimuru.kernels.triton_import import tl, triton

# Up to this many assignments the whole alignment is one single-program Triton launch (decode and
# small prefill, where launch count dominates); beyond it, the three chunked launches.
SINGLE_PROGRAM_MAX = 4096
CHUNK = 1024  # assignments per program of the chunked path


@dataclass(frozen=True)
class MoeAlignment:
    sorted_ids: Tensor  # [max_blocks * block_m] int32: assignment index, or n (padding)
    block_end: Tensor  # [E] int32: inclusive cumsum of padded group sizes
    max_blocks: int  # host-side bound on the number of M blocks (grid size)
    block_m: int


def max_blocks_bound(num_assignments: int, num_experts: int, block_m: int) -> int:
    # sum_e ceil(c_e / BM) <= ceil(n / BM) + (number of non-empty experts)
    return triton_cdiv(num_assignments, block_m) + min(num_experts, num_assignments)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def moe_align_torch(topk_ids: Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    flat = topk_ids.reshape(-1).to(torch.int64)  # [n]
    n = flat.numel()
    dev = flat.device
    max_blocks = max_blocks_bound(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.index_add_(0, flat, torch.ones_like(flat))  # [E]; bincount would sync on CUDA
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    block_end = torch.cumsum(padded, 0)  # [E]
    # Rank of each sorted assignment inside its expert group, then its padded position.
    order = torch.argsort(flat, stable=True)  # [n]
    sorted_e = flat[order]  # [n]
    start = torch.cumsum(counts, 0) - counts  # [E] unpadded group starts
    pos = (block_end - padded)[sorted_e] + torch.arange(n, device=dev) - start[sorted_e]  # [n]
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    return MoeAlignment(sorted_ids, block_end.to(torch.int32), max_blocks, block_m)


if triton is not None:

    @triton.jit(do_not_specialize=["n", "max_padded"])  # per-step counts: no variant per batch shape
    def _moe_align_single_kernel(
        ids_ptr,  # [n] expert of each assignment, any integer dtype (topk's int64 needs no cast launch)
        sorted_ptr,  # [max_padded] int32 out
        block_end_ptr,  # [E] int32 out
        delta_ptr,  # [BLOCK_E] int32 scratch: padded start - unpadded start, per expert
        n,
        num_experts,
        max_padded,
        BLOCK_N: tl.constexpr,  # >= n, power of two
        BLOCK_E: tl.constexpr,  # >= E + 1 (bin E collects the masked lanes)
        BLOCK_M: tl.constexpr,
        FILL: tl.constexpr,
        FILL_BOUND: tl.constexpr,  # >= max_padded; constexpr loop bounds (also run in the interpreter)
    ):
        offs = tl.arange(0, BLOCK_N)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=num_experts).to(tl.int32)  # [BLOCK_N]
        e = tl.arange(0, BLOCK_E)
        counts = tl.histogram(ids, BLOCK_E)  # [BLOCK_E]
        counts = tl.where(e < num_experts, counts, 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        end = tl.cumsum(padded, 0)
        start = tl.cumsum(counts, 0) - counts
        tl.store(block_end_ptr + e, end, mask=e < num_experts)
        tl.store(delta_ptr + e, end - padded - start)
        for i in range(0, FILL_BOUND, FILL):
            idx = i + tl.arange(0, FILL)
            tl.store(sorted_ptr + idx, tl.zeros([FILL], tl.int32) + n, mask=idx < max_padded)
        tl.debug_barrier()  # the deltas and the sentinel fill must land before the scatter
        # Sorting (expert, index) keys gives each assignment its rank in expert order.
        keys = tl.sort(ids * BLOCK_N + offs)  # [BLOCK_N]
        e_sorted = keys // BLOCK_N
        i_sorted = keys % BLOCK_N
        delta = tl.load(delta_ptr + e_sorted, mask=e_sorted < num_experts, other=0)
        tl.store(sorted_ptr + offs + delta, i_sorted, mask=e_sorted < num_experts)


def moe_align(topk_ids: Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Device-side alignment; no host sync, so it can be captured in a CUDA graph."""
    n = topk_ids.numel()
    if triton is None:
        return moe_align_torch(topk_ids, num_experts, block_m)
    if n > SINGLE_PROGRAM_MAX:
        return _moe_align_chunked(topk_ids, num_experts, block_m)
    max_blocks = max_blocks_bound(n, num_experts, block_m)
    max_padded = max_blocks * block_m
    block_e = next_pow2(num_experts + 1)
    # One allocation for the three int32 outputs/scratch (each torch.empty costs host time per call):
    #   buf = | sorted_ids [max_padded] | block_end [E] | delta [BLOCK_E] |
    buf = torch.empty(max_padded + num_experts + block_e, dtype=torch.int32, device=topk_ids.device)
    sorted_ids = buf[:max_padded]
    block_end = buf[max_padded : max_padded + num_experts]
    delta = buf[max_padded + num_experts :]
    block_n = max(16, next_pow2(n))
    fill = 1024
    # A bound on max_padded that depends only on the constexprs, so the fill loop stays constexpr.
    fill_bound = triton.cdiv(max_blocks_bound(block_n, num_experts, block_m) * block_m, fill) * fill
    _moe_align_single_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, block_end, delta, n, num_experts, max_padded,
        BLOCK_N=block_n, BLOCK_E=block_e, BLOCK_M=block_m, FILL=fill, FILL_BOUND=fill_bound,
        num_warps=8 if n > 1024 else 4,
    )  # fmt: skip
    return MoeAlignment(sorted_ids, block_end, max_blocks, block_m)


def chunked_variant(n: int) -> int:
    """The chunked path's CHUNKS constexpr for n assignments: the next power of two of its chunk count."""
    return next_pow2(triton_cdiv(n, CHUNK))


def _moe_align_chunked(topk_ids: Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    n = topk_ids.numel()
    num_chunks = triton_cdiv(n, CHUNK)
    chunks = chunked_variant(n)
    max_blocks = max_blocks_bound(n, num_experts, block_m)
    max_padded = max_blocks * block_m
    block_e = next_pow2(num_experts + 1)
    # One allocation for the outputs and the two scratch tables (one row per chunk, BLOCK_E wide):
    #   buf = | sorted_ids [max_padded] | block_end [E] | counts [C, BLOCK_E] | where [C, BLOCK_E] |
    table = num_chunks * block_e
    buf = torch.empty(max_padded + num_experts + 2 * table, dtype=torch.int32, device=topk_ids.device)
    sorted_ids = buf[:max_padded]
    block_end = buf[max_padded : max_padded + num_experts]
    counts = buf[max_padded + num_experts : max_padded + num_experts + table]
    where = buf[max_padded + num_experts + table :]
    ids = topk_ids.reshape(-1)
    fill = 1024
    # bounds that depend only on the constexprs, so the scan's loops stay constexpr
    fill_bound = triton.cdiv(max_blocks_bound(chunks * CHUNK, num_experts, block_m) * block_m, fill) * fill
    _moe_align_count_kernel[(num_chunks,)](ids, counts, n, num_experts, CHUNK=CHUNK, BLOCK_E=block_e, num_warps=4)
    _moe_align_scan_kernel[(1,)](
        counts, where, block_end, sorted_ids, num_chunks, n, num_experts, max_padded,
        CHUNKS=chunks, BLOCK_E=block_e, BLOCK_M=block_m, FILL=fill, FILL_BOUND=fill_bound, num_warps=4,
    )  # fmt: skip
    _moe_align_scatter_kernel[(num_chunks,)](ids, where, sorted_ids, n, num_experts, CHUNK=CHUNK, BLOCK_E=block_e,
                                             num_warps=8)
    return MoeAlignment(sorted_ids, block_end, max_blocks, block_m)


if triton is not None:

    @triton.jit(do_not_specialize=["n"])
    def _moe_align_count_kernel(ids_ptr, counts_ptr, n, num_experts, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
        c = tl.program_id(0)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=num_experts).to(tl.int32)
        tl.store(counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(ids, BLOCK_E))

    @triton.jit(do_not_specialize=["num_chunks", "n", "max_padded"])
    def _moe_align_scan_kernel(
        counts_ptr,  # [C, BLOCK_E] int32: chunk c's assignments per expert (bin E: the masked lanes)
        where_ptr,  # [C, BLOCK_E] int32 out: sorted position of chunk c's first assignment of expert e, minus the
        # number of chunk c's assignments of lower experts (the scatter adds each key's position in its chunk)
        block_end_ptr,  # [E] int32 out
        sorted_ptr,  # [max_padded] int32 out: the sentinel n everywhere (the scatter writes the assignments)
        num_chunks, n, num_experts, max_padded,
        CHUNKS: tl.constexpr,  # >= num_chunks, power of two
        BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, FILL: tl.constexpr,
        FILL_BOUND: tl.constexpr,  # >= max_padded
    ):  # fmt: skip
        e = tl.arange(0, BLOCK_E)
        real = e < num_experts
        total = tl.zeros([BLOCK_E], tl.int32)
        for c in range(0, CHUNKS):
            total += tl.load(counts_ptr + c * BLOCK_E + e, mask=(e < BLOCK_E) & (c < num_chunks), other=0)
        total = tl.where(real, total, 0)
        padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        end = tl.cumsum(padded, 0)
        tl.store(block_end_ptr + e, end, mask=real)
        running = end - padded  # expert e's next free sorted position, over the chunks in order
        for c in range(0, CHUNKS):
            live = c < num_chunks
            cnt = tl.load(counts_ptr + c * BLOCK_E + e, mask=(e < BLOCK_E) & live, other=0)
            below = tl.cumsum(cnt, 0) - cnt  # chunk c's assignments of lower experts
            tl.store(where_ptr + c * BLOCK_E + e, running - below, mask=(e < BLOCK_E) & live)
            running += tl.where(real, cnt, 0)
        for i in range(0, FILL_BOUND, FILL):
            idx = i + tl.arange(0, FILL)
            tl.store(sorted_ptr + idx, tl.zeros([FILL], tl.int32) + n, mask=idx < max_padded)

    @triton.jit(do_not_specialize=["n"])
    def _moe_align_scatter_kernel(ids_ptr, where_ptr, sorted_ptr, n, num_experts, CHUNK: tl.constexpr,
                                  BLOCK_E: tl.constexpr):
        c = tl.program_id(0)
        local = tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + c * CHUNK + local, mask=c * CHUNK + local < n, other=num_experts).to(tl.int32)
        keys = tl.sort(ids * CHUNK + local)  # (expert, index) order: position j holds the j-th of the chunk
        e_sorted = keys // CHUNK
        i_sorted = keys % CHUNK
        real = e_sorted < num_experts
        start = tl.load(where_ptr + c * BLOCK_E + e_sorted, mask=real, other=0)
        tl.store(sorted_ptr + start + local, c * CHUNK + i_sorted, mask=real)
