"""MoE routing in one launch: fp32 softmax over router logits + bias, top-k, optional renormalisation.

    logits [T, E] (the gate's output dtype)   bias [E] (fp32)
    p = softmax(fp32(logits) + bias)          [T, E] fp32, never stored by the kernel
    ids [T, k] int64      the k experts of largest p, in decreasing order
    weights [T, k] fp32   their p, divided by their sum when renormalize

Ties: equal scores go to the lowest expert id first. The kernel ranks experts by z = fp32(logits) + bias,
which orders them exactly as p does (softmax is monotone) without the exp's rounding, so two experts whose
z differ are never tied; torch.topk on p may order such a near-tie either way. The weights are p as the
kernel computes it, within a few fp32 ulps of torch's softmax (different exp and summation order).

Triton program t handles token row t: one [BLOCK_E] tile (E up to 1024), then k rounds of argmax
(each picks the lowest index among the maxima and retires it). Grid (T,): no host sync, CUDA-graph
capturable. CPU tensors take the torch reference (the definition of the function).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rimuru.kernels.launch import next_pow2
from rimuru.kernels.triton_import import tl, triton

__all__ = ["route_topk", "route_topk_reference", "route_topk_triton"]

_MAX_EXPERTS = 1024


def route_topk_reference(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    probs = torch.softmax(logits.float() + bias, dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


if triton is not None:

    @triton.jit
    def _route_topk_kernel(
        logits_ptr,  # [T, E], rows stride_l apart
        bias_ptr,  # [E]
        weights_ptr,  # [T, TOP_K] fp32
        ids_ptr,  # [T, TOP_K] int64
        stride_l,
        E: tl.constexpr,
        BLOCK_E: tl.constexpr,
        TOP_K: tl.constexpr,
        K_PAD: tl.constexpr,
        RENORMALIZE: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        z = tl.load(logits_ptr + t * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
        z = z + tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)  # [BE]
        e = tl.exp(z - tl.max(z, 0))  # padding: exp(-inf) = 0
        p = e / tl.sum(e, 0)  # [BE]
        # Retired (and padding) experts sit at -inf; live ones at >= -FLT_MAX, so a live expert always
        # beats a retired one even when its own z is -inf.
        key = tl.where(valid, tl.maximum(z, -3.4028234663852886e38), float("-inf"))
        offs_k = tl.arange(0, K_PAD)
        w_out = tl.zeros([K_PAD], tl.float32)
        id_out = tl.zeros([K_PAD], tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.argmax(key, 0, tie_break_left=True)
            w = tl.sum(tl.where(offs == best, p, 0.0), 0)
            w_out = tl.where(offs_k == j, w, w_out)
            id_out = tl.where(offs_k == j, best.to(tl.int64), id_out)
            key = tl.where(offs == best, float("-inf"), key)
        if RENORMALIZE:
            w_out = w_out / tl.sum(w_out, 0)  # padding entries are 0
        kmask = offs_k < TOP_K
        tl.store(weights_ptr + t * TOP_K + offs_k, w_out, mask=kmask)
        tl.store(ids_ptr + t * TOP_K + offs_k, id_out, mask=kmask)


def route_topk_triton(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """The Triton kernel on any device Triton runs on (CPU tensors under TRITON_INTERPRET=1)."""
    num_tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {num_experts}]")
    if bias.shape != (num_experts,):
        raise ValueError(f"bias must be [{num_experts}], got {tuple(bias.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = next_pow2(num_experts)
    _route_topk_kernel[(num_tokens,)](
        logits, bias.contiguous(), weights, ids, logits.stride(0),
        E=num_experts, BLOCK_E=block_e, TOP_K=top_k, K_PAD=next_pow2(top_k), RENORMALIZE=renormalize,
        num_warps=1 if block_e <= 256 else 4,
    )  # fmt: skip
    return weights, ids


def route_topk(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """(weights [T, k] fp32, ids [T, k] int64): the Triton kernel on CUDA tensors, the torch reference
    elsewhere."""
    if triton is not None and logits.is_cuda and logits.dim() == 2 and logits.shape[1] <= _MAX_EXPERTS:
        return route_topk_triton(logits, bias, top_k, renormalize)
    return route_topk_reference(logits, bias, top_k, renormalize)
