"""Page-table-aware fused MoE: experts read straight from scattered mid pages of the pool.

Weight layout (docs/architecture.md, Memory). `expert_view` is the pool seen as `[num_mid_pages, f*d]`;
`expert_table[e] = (p1, p3, p2)` names where expert e's three matrices are:

    p >= 0    page p of expert_view (the pool)
    p == -1   nowhere: the expert must not be routed to, unless the call passes `skip_absent` (the host tier
              computes it, experts/host_tier.py): it then contributes zeros
    p <= -2   row -2 - p of `host_rows`, the layer's home copy in pinned host memory ([3E, f*d]: row 3e + j is
              matrix j of expert e, `host_row_code`). The kernel reads it over PCIe, with no copy: under CUDA's
              unified addressing a pinned host allocation is reachable from a kernel at its host address.

    page p1 (W1, gate): [f, d] row-major    page p3 (W3, up): [f, d] row-major
    page p2 (W2, down): [d, f] row-major

The gate/up GEMM is one [2f]-column GEMM whose column n reads page p1 (n < f) or p3 (n >= f):
    addr_e(n, t) = base + page_e(n) * f * d + (n mod f) * d + t
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rimuru.kernels.launch import next_pow2
from rimuru.kernels.moe_align import MoeAlignment, moe_align
from rimuru.kernels.triton_import import tl, triton


def _check_args(hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor, intermediate_size: int) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, d], got shape {tuple(hidden.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
            f"[T={hidden.shape[0]}, k]"
        )
    if intermediate_size <= 0:
        raise ValueError(f"intermediate_size must be positive, got {intermediate_size}")


def host_row_code(expert: int, matrix: int) -> int:
    """The table entry naming matrix `matrix` (0 W1, 1 W3, 2 W2) of `expert` in the layer's host rows."""
    return -2 - (3 * expert + matrix)


def _check_host_rows(host_rows: Tensor | None, expert_view: Tensor, hidden: Tensor) -> None:
    if host_rows is None:
        return
    if host_rows.dim() != 2 or host_rows.shape[1] != expert_view.shape[1] or not host_rows.is_contiguous():
        raise ValueError(f"host_rows must be a contiguous [3E, f*d = {expert_view.shape[1]}] tensor, got "
                         f"{tuple(host_rows.shape)}")
    if host_rows.dtype != expert_view.dtype:
        raise ValueError(f"host_rows are {host_rows.dtype}, the pool's expert pages {expert_view.dtype}")
    if hidden.is_cuda and not (host_rows.is_cuda or host_rows.is_pinned()):
        raise ValueError("host_rows read by a GPU kernel must be in pinned host memory (or on the device)")


def fused_moe_reference(
    hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor, expert_view: Tensor, expert_table: Tensor,
    intermediate_size: int, host_rows: Tensor | None = None, skip_absent: bool = False,
) -> Tensor:  # fmt: skip
    """Plain-torch paged MoE: loops over experts that received tokens, accumulates in fp32 (fp64 for fp64).

    out[t] = sum_j topk_weights[t, j] * W2_e(SiLU(W1_e h_t) * W3_e h_t),  e = topk_ids[t, j].

    Table entries as in the module docstring: pages of `expert_view`, or (entries <= -2, with `host_rows`) rows of
    the layer's host store. A routed expert without pages (a -1 in its table row) is an error, unless
    `skip_absent`: then it contributes zeros, as in the Triton kernel (the host computes such experts:
    experts/host_tier.py).
    """
    _check_args(hidden, topk_weights, topk_ids, intermediate_size)
    T, d = hidden.shape
    f = intermediate_size
    k = topk_ids.shape[1]
    if expert_view.shape[1] != f * d:
        raise ValueError(f"expert_view rows hold {expert_view.shape[1]} elements, expected f*d = {f * d}")
    _check_host_rows(host_rows, expert_view, hidden)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    out = torch.zeros(T, d, dtype=acc, device=hidden.device)  # [T, d]
    flat_ids = topk_ids.reshape(-1).long()  # [T*k]
    flat_w = topk_weights.reshape(-1).to(acc)  # [T*k]
    token_of = torch.arange(T, device=hidden.device).repeat_interleave(k)  # [T*k]
    table = expert_table.cpu()
    for e in torch.unique(flat_ids).tolist():
        if not 0 <= e < table.shape[0]:
            raise ValueError(f"routed expert {e} is outside the expert table (E = {table.shape[0]})")
        pages = [int(p) for p in table[e]]
        on_host = host_rows is not None and max(pages) <= -2
        if min(pages) < 0 and not on_host:
            if skip_absent and -1 in pages:
                continue  # the host tier computes it (experts/host_tier.py)
            raise ValueError(f"expert {e} is routed to but not resident: pages {tuple(pages)}")
        rows = [host_rows[-2 - p] for p in pages] if on_host else [expert_view[p] for p in pages]
        w1 = rows[0].view(f, d).to(device=hidden.device, dtype=acc)  # [f, d]
        w3 = rows[1].view(f, d).to(device=hidden.device, dtype=acc)  # [f, d]
        w2 = rows[2].view(d, f).to(device=hidden.device, dtype=acc)  # [d, f]
        sel = flat_ids == e
        rows = token_of[sel]  # [n_e]
        h = hidden[rows].to(acc)  # [n_e, d]
        act = torch.nn.functional.silu(h @ w1.T) * (h @ w3.T)  # [n_e, f]
        out.index_add_(0, rows, (act @ w2.T) * flat_w[sel, None])  # [n_e, d]
    return out.to(hidden.dtype)


def fused_moe(
    hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor, expert_view: Tensor, expert_table: Tensor,
    intermediate_size: int, host_rows: Tensor | None = None, skip_absent: bool = False,
) -> Tensor:  # fmt: skip
    """Paged fused MoE: the Triton kernel on CUDA tensors, the torch reference on the CPU. `host_rows`: the
    layer's host rows that entries <= -2 name. `skip_absent`: routed experts without pages (-1) contribute zeros
    (what the Triton kernel always does; the reference refuses them otherwise)."""
    if hidden.is_cuda:
        return fused_moe_triton(hidden, topk_weights, topk_ids, expert_view, expert_table, intermediate_size,
                                host_rows)
    return fused_moe_reference(hidden, topk_weights, topk_ids, expert_view, expert_table, intermediate_size,
                               host_rows, skip_absent=skip_absent)


def fused_moe_triton(
    hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor, expert_view: Tensor, expert_table: Tensor,
    intermediate_size: int, host_rows: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """The paged Triton kernels on any device Triton runs on (CPU tensors under TRITON_INTERPRET=1).

    Caller guarantees every routed expert has all three pages (>= 0), or all three host rows (<= -2, with
    `host_rows`); the kernels do not sync to check (an expert with a -1 entry contributes zeros instead of reading
    out of bounds). No host sync and no
    data-dependent host branch: a call can be captured in a CUDA graph and replayed with new contents of
    hidden / topk_weights / topk_ids / expert_table / expert_view (same shapes).
    """
    _check_args(hidden, topk_weights, topk_ids, intermediate_size)
    d = hidden.shape[1]
    if expert_view.shape[1] != intermediate_size * d or not expert_view.is_contiguous():
        raise ValueError(f"expert_view must be a contiguous [pages, f*d = {intermediate_size * d}] tensor")
    _check_host_rows(host_rows, expert_view, hidden)
    table = expert_table
    if table.device != hidden.device or table.dtype not in (torch.int32, torch.int64) or not table.is_contiguous():
        table = table.to(device=hidden.device, dtype=torch.int32).contiguous()  # the kernels read int32 or int64
    return _run(hidden, topk_weights, topk_ids, expert_view, expert_view, table, table.shape[0], intermediate_size,
                paged=True, host_rows=host_rows)  # fmt: skip


def fused_moe_contiguous(hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """The same kernels on contiguous weights: w13 [E, 2f, d] (gate rows, then up rows), w2 [E, d, f]."""
    E, two_f, d = w13.shape
    f = two_f // 2
    _check_args(hidden, topk_weights, topk_ids, f)
    if w2.shape != (E, d, f) or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError(f"need contiguous w13 [E, 2f, d] and w2 [E, d, f], got {tuple(w13.shape)}, {tuple(w2.shape)}")
    return _run(hidden, topk_weights, topk_ids, w13, w2, w2, E, f, paged=False)  # table unread when not paged


@dataclass(frozen=True)
class _TileConfig:
    block_m: int
    block_n: int  # down GEMM N tile
    block_n_gate_up: int  # gate/up N tile: the program holds a gate AND an up accumulator of this width
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


# the tile tiers' upper bounds in routed rows per expert (assignments / experts), smallest tier first
TILE_TIER_BOUNDS = (16, 48, 192)


def _tile_config(rows_per_expert: float) -> _TileConfig:
    # Few rows per expert (decode): the GEMMs stream weights, so use the smallest M tile and narrow N
    # tiles for enough programs to fill the SMs. Many rows: square-ish tiles for tensor-core reuse.
    if rows_per_expert <= TILE_TIER_BOUNDS[0]:
        return _TileConfig(16, 32, 32, 128, 4, 4)
    if rows_per_expert <= TILE_TIER_BOUNDS[1]:
        return _TileConfig(32, 64, 64, 128, 4, 4)
    if rows_per_expert <= TILE_TIER_BOUNDS[2]:
        return _TileConfig(64, 128, 64, 64, 4, 4)
    return _TileConfig(128, 128, 64, 64, 8, 3)


def variant_change_points(num_experts: int, top_k: int, max_tokens: int) -> list[int]:
    """The token counts <= max_tokens at which a MoE launch's kernel variants change (1 included): its tile tier
    (rows per expert crossing a TILE_TIER_BOUNDS entry) or the alignment's (the single-program kernel's width, the
    next power of two of tokens x top_k, up to moe_align.SINGLE_PROGRAM_MAX assignments; past it the chunked
    path's power-of-two chunk count: both change where tokens x top_k passes a power of two). A launch of T tokens
    builds the variants of the largest change point <= T (engine/kernel_warmup.py runs one pass at each)."""
    points = {1}
    points.update(bound * num_experts // top_k + 1 for bound in TILE_TIER_BOUNDS)
    width = 16  # the alignment's variant (its BLOCK_N, then its chunk count's power of two) changes past each power
    # of two of the assignments
    while width < max_tokens * top_k:
        points.add(width // top_k + 1)
        width *= 2
    return sorted(p for p in points if p <= max_tokens)


def _run(
    hidden: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    table: Tensor,
    num_experts: int,
    f: int,
    paged: bool,
    host_rows: Tensor | None = None,
) -> Tensor:
    # Per call: 1 alignment launch (<= SINGLE_PROGRAM_MAX assignments; ~10 torch ops above), the two
    # GEMM launches, and for k > 1 one torch.sum; everything else is host arithmetic on shapes. The
    # ids, router weights and table are read in their own dtypes, so no cast launches.
    if triton is None:
        raise RuntimeError("the fused MoE kernel needs Triton (pip install triton)")
    T, d = hidden.shape
    k = topk_ids.shape[1]
    E = num_experts
    n = T * k
    out = torch.empty(T, d, dtype=hidden.dtype, device=hidden.device)
    if T == 0:
        return out
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()  # rows may be strided, elements within a row may not
    weights = topk_weights.reshape(-1)  # [n], a view when [T, k] is contiguous
    cfg = _tile_config(n / E)
    align: MoeAlignment = moe_align(topk_ids, E, cfg.block_m)
    inter = torch.empty(align.max_blocks * cfg.block_m, f, dtype=hidden.dtype, device=hidden.device)
    # One output row per assignment; with k == 1 that is already [T, d].
    per_assign = out if k == 1 else torch.empty(n, d, dtype=hidden.dtype, device=hidden.device)
    block_e = next_pow2(E)
    common = dict(
        PAGED=paged, HOST=host_rows is not None, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_E=block_e,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    grid1 = (align.max_blocks * triton.cdiv(f, cfg.block_n_gate_up),)
    host = w_gate_up if host_rows is None else host_rows  # unread without host rows
    _gate_up_kernel[grid1](
        hidden, w_gate_up, host, table, align.sorted_ids, align.block_end, inter,
        n, k, E, align.max_blocks, hidden.stride(0), F=f, D=d, BLOCK_N=cfg.block_n_gate_up, **common,
    )  # fmt: skip
    grid2 = (align.max_blocks * triton.cdiv(d, cfg.block_n),)
    _down_kernel[grid2](
        inter, w_down, host, table, align.sorted_ids, align.block_end, weights, per_assign,
        n, E, align.max_blocks, F=f, D=d, BLOCK_N=cfg.block_n, **common,
    )  # fmt: skip
    if k > 1:
        # Deterministic top-k sum in a fixed order (atomics in the down kernel would not be for k > 2).
        torch.sum(per_assign.view(T, k, d), dim=1, out=out)
    return out


if triton is not None:

    @triton.jit
    def _block_coords(num_pid_m, block_end_ptr, num_experts, N: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
        """This program's (M block, N block) of an [M, N] output, and the M block's expert (E past the end)."""
        # Grouped ordering: GROUP_M consecutive M blocks (mostly one expert) sweep N together, so an
        # expert's weight tiles are reused from L2 across its M blocks.
        pid = tl.program_id(0)
        width = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_m = (pid // width) * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        # Expert of this M block: number of experts whose padded group ends at or before its first row.
        e = tl.arange(0, BLOCK_E)
        ends = tl.load(block_end_ptr + e, mask=e < num_experts, other=2147483647)  # [BLOCK_E]
        expert = tl.sum((ends <= pid_m * BLOCK_M).to(tl.int32), axis=0)  # == E past the real end
        return pid_m, pid_n, expert

    @triton.jit
    def _expert_bases(table_ptr, expert, F: tl.constexpr, D: tl.constexpr, PAGED: tl.constexpr,
                      HOST: tl.constexpr):
        """Where expert's W1, W3 and W2 start (element offsets into w_ptr, or into h_ptr when on_host), whether
        all three can be read, and whether they are read from the host rows.

        PAGED: the entries table[expert] = (p1, p3, p2), pages of expert_view or (HOST) codes <= -2 of host rows;
        else w13 [E, 2f, d] (W1 rows, then W3's) and w2 [E, d, f]. An unreadable expert's W2 offset is clamped
        to row 0, in bounds."""
        on_host = False
        if PAGED:
            p_gate = tl.load(table_ptr + expert * 3)
            p_up = tl.load(table_ptr + expert * 3 + 1)
            p_down = tl.load(table_ptr + expert * 3 + 2)
            readable = (p_gate >= 0) & (p_up >= 0) & (p_down >= 0)
            if HOST:
                on_host = (p_gate <= -2) & (p_up <= -2) & (p_down <= -2)
                readable = readable | on_host
                p_gate = tl.where(on_host, -2 - p_gate, p_gate)
                p_up = tl.where(on_host, -2 - p_up, p_up)
                p_down = tl.where(on_host, -2 - p_down, p_down)
            gate_base = p_gate.to(tl.int64) * F * D
            up_base = p_up.to(tl.int64) * F * D
            down_base = tl.maximum(p_down, 0).to(tl.int64) * F * D
        else:
            readable = True
            gate_base = expert.to(tl.int64) * 2 * F * D
            up_base = gate_base + F * D
            down_base = expert.to(tl.int64) * D * F
        return gate_base, up_base, down_base, readable, on_host

    @triton.jit
    def _block_tile(sorted_ptr, pid_m, pid_n, n, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The block's sorted positions, their assignment ids and which are real (not padding); its output
        columns and which are inside N."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(sorted_ptr + offs_m)  # [BLOCK_M]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        return offs_m, rows, rows < n, offs_n, offs_n < N

    # The per-step counts (assignments, M blocks) are not specialised on (== 1, divisible by 16), nor the layer's
    # row of the [L, E, 3] expert tables on alignment: a new batch shape compiles no new variant mid-serving; the
    # variants are the tile configurations' constexprs alone.
    @triton.jit(do_not_specialize=["n", "num_pid_m"], do_not_specialize_on_alignment=["table_ptr"])
    def _gate_up_kernel(
        a_ptr,  # hidden [T, d], row stride stride_a
        w_ptr,  # PAGED: expert_view [pages, f*d]; else w13 [E, 2f, d]
        h_ptr,  # HOST: the layer's host rows [3E, f*d] (pinned host memory, read over PCIe)
        table_ptr,  # [E, 3] int32/int64 pages (W1, W3, W2), PAGED only
        sorted_ptr,  # [max_blocks*BLOCK_M] int32 assignment ids (n = padding)
        block_end_ptr,  # [E] int32
        out_ptr,  # [max_blocks*BLOCK_M, f]: SiLU(gate) * up, row = sorted position
        n, top_k, num_experts, num_pid_m, stride_a,
        F: tl.constexpr,  # intermediate size; a model constant, constexpr so the K loops specialise
        D: tl.constexpr,  # hidden size
        PAGED: tl.constexpr, HOST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        # A program computes gate columns [n0, n0+BLOCK_N) and the SAME up columns, so SiLU(g)*u is
        # fused in registers. Column c of the [2f]-wide GEMM reads page p1 (c < f) or p3 (c >= f):
        #   addr(c, t) = base + page(c)*f*d + (c mod f)*d + t, page looked up once per program.
        pid_m, pid_n, expert = _block_coords(num_pid_m, block_end_ptr, num_experts, F,
                                             BLOCK_M, BLOCK_N, BLOCK_E, GROUP_M)
        if expert >= num_experts:
            return
        gate_base, up_base, _, readable, on_host = _expert_bases(table_ptr, expert, F, D, PAGED, HOST)
        if not readable:
            return  # never routed to by contract; its rows stay unwritten
        src = w_ptr
        if HOST:
            if on_host:
                src = h_ptr
        # offs_n: the column inside W1/W3 (c mod f)
        offs_m, rows, row_ok, offs_n, n_ok = _block_tile(sorted_ptr, pid_m, pid_n, n, F, BLOCK_M, BLOCK_N)
        tok = (rows // top_k).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + tok[:, None] * stride_a + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        # B tiles are [BLOCK_K, BLOCK_N] views of row-major [f, d] pages (row c, contiguous along t).
        g_ptrs = src + gate_base + offs_n[None, :] * D + offs_k[:, None]
        u_ptrs = src + up_base + offs_n[None, :] * D + offs_k[:, None]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k_ok = offs_k < D - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        act = acc_g * tl.sigmoid(acc_g) * acc_u  # SiLU(gate) * up, fp32
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * F + offs_n[None, :]
        tl.store(o_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["n", "num_pid_m"], do_not_specialize_on_alignment=["table_ptr"])
    def _down_kernel(
        a_ptr,  # [max_blocks*BLOCK_M, f] intermediate, row = sorted position
        w_ptr,  # PAGED: expert_view [pages, f*d]; else w2 [E, d, f]
        h_ptr,  # HOST: the layer's host rows [3E, f*d]
        table_ptr,  # [E, 3] int32/int64
        sorted_ptr,  # [max_blocks*BLOCK_M] int32
        block_end_ptr,  # [E] int32
        weight_ptr,  # [n] router weights, per assignment (any float dtype, used in fp32)
        out_ptr,  # [n, d]: weighted expert output, row = assignment id
        n, num_experts, num_pid_m,
        F: tl.constexpr,
        D: tl.constexpr,
        PAGED: tl.constexpr, HOST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n, expert = _block_coords(num_pid_m, block_end_ptr, num_experts, D,
                                             BLOCK_M, BLOCK_N, BLOCK_E, GROUP_M)
        if expert >= num_experts:
            return
        _, _, base, readable, on_host = _expert_bases(table_ptr, expert, F, D, PAGED, HOST)
        src = w_ptr
        if HOST:
            if on_host:
                src = h_ptr
        # offs_n: the output column = row of W2 [d, f]
        offs_m, rows, row_ok, offs_n, n_ok = _block_tile(sorted_ptr, pid_m, pid_n, n, D, BLOCK_M, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * F + offs_k[None, :]
        b_ptrs = src + base + offs_n[None, :] * F + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if readable:
            for k0 in range(0, F, BLOCK_K):
                k_ok = offs_k < F - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                acc = tl.dot(a, b, acc)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
        w = tl.load(weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)  # [BLOCK_M]
        acc = acc * w[:, None]
        o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * D + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
