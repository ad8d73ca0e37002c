"""Sort token x top-k assignments by expert and pad each expert's group to the M tile, on the device.

Assignment i = t * k + j (token t, its j-th expert). The output layout, for BLOCK_M = 4:

    sorted_ids:  | e0: 5 9 2 S | e2: 0 7 S S | e3: 1 3 4 8 | e3: 6 S S S | S ... (tail up to max_padded)
    block_end:   [4, 4, 8, 16]       inclusive cumsum of padded group sizes, in rows (e1 has no tokens)

S = n (= T*k) is the padding sentinel. M block b belongs to the expert e with
block_end[e-1] <= b*BLOCK_M < block_end[e] (the GEMM kernels search block_end themselves, so no
per-block expert array is needed); blocks at or past block_end[E-1] are empty. No host sync: the
grid is sized by the bound `max_blocks`, the kernels skip blocks past the real end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rimuru.kernels.launch import next_pow2, warn_once
from rimuru.kernels.triton_import import tl, triton

# Up to this many assignments the whole alignment is one single-program Triton launch (decode and
# small prefill, where launch count dominates); beyond it, a handful of torch ops is cheap relative
# to the GEMMs.
SINGLE_PROGRAM_MAX = 4096
ABOVE_SINGLE_PROGRAM = (f"moe_align: a call with more than {SINGLE_PROGRAM_MAX} (token, expert) assignments is "
                        "aligned with ~10 torch ops instead of the single-program kernel")


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
    if triton is None or n > SINGLE_PROGRAM_MAX:
        if triton is not None:
            warn_once(ABOVE_SINGLE_PROGRAM)
        return moe_align_torch(topk_ids, num_experts, block_m)
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
