"""Page-table-aware fused MoE: experts read straight from scattered mid pages of the pool.

Weight layout (DESIGN.md §3, §5). `expert_view` is the pool seen as `[num_mid_pages, f*d]`;
`expert_table[e] = (p1, p3, p2)` names expert e's pages, -1 = not resident:

    page p1 (W1, gate): [f, d] row-major    page p3 (W3, up): [f, d] row-major
    page p2 (W2, down): [d, f] row-major

The gate/up GEMM is one [2f]-column GEMM whose column n reads page p1 (n < f) or p3 (n >= f):
    addr_e(n, t) = base + page_e(n) * f * d + (n mod f) * d + t
"""

from __future__ import annotations

import torch
from torch import Tensor


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


def fused_moe_reference(
    hidden: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    expert_view: Tensor,
    expert_table: Tensor,
    intermediate_size: int,
) -> Tensor:
    """Plain-torch paged MoE: loops over experts that received tokens, accumulates in fp32.

    out[t] = sum_j topk_weights[t, j] * W2_e(SiLU(W1_e h_t) * W3_e h_t),  e = topk_ids[t, j].
    """
    _check_args(hidden, topk_weights, topk_ids, intermediate_size)
    T, d = hidden.shape
    f = intermediate_size
    k = topk_ids.shape[1]
    if expert_view.shape[1] != f * d:
        raise ValueError(f"expert_view rows hold {expert_view.shape[1]} elements, expected f*d = {f * d}")
    out = torch.zeros(T, d, dtype=torch.float32, device=hidden.device)  # [T, d]
    flat_ids = topk_ids.reshape(-1).long()  # [T*k]
    flat_w = topk_weights.reshape(-1).float()  # [T*k]
    token_of = torch.arange(T, device=hidden.device).repeat_interleave(k)  # [T*k]
    table = expert_table.cpu()
    for e in torch.unique(flat_ids).tolist():
        if not 0 <= e < table.shape[0]:
            raise ValueError(f"routed expert {e} is outside the expert table (E = {table.shape[0]})")
        p1, p3, p2 = (int(p) for p in table[e])
        if min(p1, p3, p2) < 0:
            raise ValueError(f"expert {e} is routed to but not resident: pages {(p1, p3, p2)}")
        w1 = expert_view[p1].view(f, d).float()  # [f, d]
        w3 = expert_view[p3].view(f, d).float()  # [f, d]
        w2 = expert_view[p2].view(d, f).float()  # [d, f]
        sel = flat_ids == e
        rows = token_of[sel]  # [n_e]
        h = hidden[rows].float()  # [n_e, d]
        act = torch.nn.functional.silu(h @ w1.T) * (h @ w3.T)  # [n_e, f]
        out.index_add_(0, rows, (act @ w2.T) * flat_w[sel, None])  # [n_e, d]
    return out.to(hidden.dtype)


def fused_moe(
    hidden: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    expert_view: Tensor,
    expert_table: Tensor,
    intermediate_size: int,
) -> Tensor:
    """Paged fused MoE: the Triton kernel on CUDA tensors, the torch reference on the CPU."""
    return fused_moe_reference(hidden, topk_weights, topk_ids, expert_view, expert_table, intermediate_size)
