"""One decode step of the gated delta rule, the recurrent state read from and written to its pool page in place.

    ssm        [n_pages, Hv, dk, dv] fp32   the pool's ssm view (models/state_cache.py); page p = one request's
                                            state of one linear-attention layer
    ssm_pages  [B] int                      page of sequence b; < 0 = a padding row (reads nothing, writes
                                            nothing, its output row is 0)
    has_state  [B] bool                     False = the sequence starts fresh: its state is SELECTED as zero
                                            (the page's bytes are garbage, NaN included; never multiplied by 0)
    q, k       [B, Hk, dk]                  normalised (q also scaled by dk^-0.5), any float dtype; or raw, with
                                            qk_scale given: then both are l2-normalised here (eps 1e-6 inside the
                                            root, as the layer's l2_normalize) and q scaled by qk_scale
    v          [B, Hv, dv]
    g, beta    [B, Hv]                      log decay (<= 0) and update strength of this token

Value head h reads key head h // (Hv / Hk). Per (b, h), exactly as `recurrent_gated_delta_rule` does for one
token (models/gated_deltanet.py):

    S = exp(g) S;  delta = beta (v - S^T k);  S += k delta^T;  o = S^T q;  page <- S

Returns o [B, Hv, dv] fp32. The state pages of distinct sequences must differ (each program updates its own
page in place).

Kernel: program (b * Hv + h, j) holds the [dk, BLOCK_V] column tile j of S in registers: the columns of S are
independent in every step (S^T k, the rank-1 update and S^T q all reduce over dk only), so a tile is read once
and written once, and each program moves 2 * dk * BLOCK_V * 4 bytes of state (the whole cost of the step).
The grid depends only on B and the shapes: no host sync, so a launch can be captured in a CUDA graph and
replayed with new page ids, flags and inputs.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from rimuru.kernels.launch import next_pow2, warn_once
from rimuru.kernels.triton_import import tl, triton

__all__ = ["gated_delta_decode", "gated_delta_decode_reference", "gated_delta_decode_triton"]


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm: Tensor, ssm_pages: Tensor,
           has_state: Tensor) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or ssm.dim() != 4:
        raise ValueError(f"want q, k [B, Hk, dk], v [B, Hv, dv], ssm [pages, Hv, dk, dv]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, ssm {tuple(ssm.shape)}")
    B, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    if v.shape[0] != B or tuple(ssm.shape[1:]) != (Hv, dk, dv) or Hv % Hk:
        raise ValueError(f"q {tuple(q.shape)}, v {tuple(v.shape)} and ssm {tuple(ssm.shape)} do not match "
                         "(ssm [pages, Hv, dk, dv], Hv a multiple of Hk)")
    if g.shape != (B, Hv) or beta.shape != (B, Hv) or ssm_pages.shape != (B,) or has_state.shape != (B,):
        raise ValueError(f"want g, beta [B, Hv] = [{B}, {Hv}], ssm_pages and has_state [{B}]; got g "
                         f"{tuple(g.shape)}, beta {tuple(beta.shape)}, ssm_pages {tuple(ssm_pages.shape)}, "
                         f"has_state {tuple(has_state.shape)}")
    if ssm.dtype != torch.float32:
        raise ValueError(f"the recurrent state is float32, got {ssm.dtype}")
    return B, Hk, Hv, dk, dv, ssm.shape[0]


# ----------------------------------------------------------------------------------------------
# Plain-torch reference: gather, one step of the recurrence in the order of the layer's own
# `recurrent_gated_delta_rule` (kernels/ sits below models/, so the math is restated here; the tests hold
# the two equal), scatter. Host syncs (boolean indexing): the definition of the function, not a fast path.
# ----------------------------------------------------------------------------------------------


L2_EPS = 1e-6  # the layer's l2_normalize: x / sqrt(sum(x^2) + eps)


def _l2_normalize(x: Tensor) -> Tensor:  # [..., D] fp32
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def gated_delta_decode_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm: Tensor, ssm_pages: Tensor, has_state: Tensor,
    qk_scale: float | None = None,
) -> Tensor:  # fmt: skip
    B, Hk, Hv, dk, dv, _ = _check(q, k, v, g, beta, ssm, ssm_pages, has_state)
    if qk_scale is not None:  # raw q and k, normalised in the order of the layer's torch path
        q, k = _l2_normalize(q.float()) * qk_scale, _l2_normalize(k.float())
    pages = ssm_pages.long()
    valid = pages >= 0  # [B]
    keep = has_state.bool() & valid
    zero = torch.zeros((), dtype=torch.float32, device=ssm.device)
    state = torch.where(keep[:, None, None, None], ssm[pages.clamp(min=0)], zero)  # [B, Hv, dk, dv]
    group = Hv // Hk
    qh = q.float().repeat_interleave(group, dim=1)  # [B, Hv, dk]
    kh = k.float().repeat_interleave(group, dim=1)
    state = state * g.float().exp()[..., None, None]  # decayed
    predicted = (kh[..., None] * state).sum(-2)  # [B, Hv, dv] = S^T k
    delta = beta.float()[..., None] * (v.float() - predicted)  # [B, Hv, dv]
    state = state + kh[..., None] * delta[..., None, :]  # rank-1 update k delta^T
    o = (qh[..., None] * state).sum(-2)  # [B, Hv, dv] = S^T q
    ssm.index_copy_(0, pages[valid], state[valid])
    return torch.where(valid[:, None, None], o, zero)


# ----------------------------------------------------------------------------------------------
# Triton kernel.
# ----------------------------------------------------------------------------------------------

if triton is not None:

    # a layer's row of the [L, B] state page ids starts wherever l*B puts it: not specialised on alignment
    @triton.jit(do_not_specialize_on_alignment=["pages_ptr", "has_state_ptr"])
    def _gated_delta_decode_kernel(
        q_ptr,  # [B, Hk, dk]
        k_ptr,  # [B, Hk, dk]
        v_ptr,  # [B, Hv, dv]
        g_ptr,  # [B, Hv]
        beta_ptr,  # [B, Hv]
        ssm_ptr,  # [P, Hv, dk, dv] fp32, updated in place
        pages_ptr,  # [B] int32 / int64
        has_state_ptr,  # [B] int32
        o_ptr,  # [B, Hv, dv] fp32, contiguous
        stride_q_b, stride_q_h,
        stride_k_b, stride_k_h,
        stride_v_b, stride_v_h,
        stride_g_b, stride_g_h, stride_beta_b, stride_beta_h,
        stride_s_page, stride_s_head, stride_s_k,
        qk_scale,
        NUM_V_HEADS: tl.constexpr,
        GROUP: tl.constexpr,  # Hv // Hk
        DK: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_K: tl.constexpr,  # next_pow2(DK): the whole key dim in one tile
        BLOCK_V: tl.constexpr,
        NORMALIZE_QK: tl.constexpr,  # q, k raw: l2-normalised here, q scaled by qk_scale
    ):  # fmt: skip
        bh = tl.program_id(0)
        b = bh // NUM_V_HEADS
        h = bh % NUM_V_HEADS
        hk = h // GROUP
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_k = offs_k < DK
        mask_v = offs_v < DV
        o_row = o_ptr + (b * NUM_V_HEADS + h).to(tl.int64) * DV + offs_v

        page = tl.load(pages_ptr + b).to(tl.int64)
        if page < 0:  # padding row: no state read or written, output 0
            tl.store(o_row, tl.zeros([BLOCK_V], tl.float32), mask=mask_v)
            return
        has = tl.load(has_state_ptr + b) != 0

        s_offs = page * stride_s_page + h * stride_s_head + offs_k[:, None] * stride_s_k + offs_v[None, :]
        mask = mask_k[:, None] & mask_v[None, :]
        # A fresh sequence's state is selected as zero: the masked load never reads the page's garbage.
        S = tl.load(ssm_ptr + s_offs, mask=mask & has, other=0.0)  # [BLOCK_K, BLOCK_V] fp32

        q = tl.load(q_ptr + b * stride_q_b + hk * stride_q_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * stride_k_b + hk * stride_k_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if NORMALIZE_QK:  # padding columns are 0: they add nothing to the sums
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * qk_scale
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        v = tl.load(v_ptr + b * stride_v_b + h * stride_v_h + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b * stride_g_b + h * stride_g_h).to(tl.float32)
        beta = tl.load(beta_ptr + b * stride_beta_b + h * stride_beta_h).to(tl.float32)

        S = S * tl.exp(g)  # decay
        predicted = tl.sum(S * k[:, None], 0)  # [BLOCK_V] = S^T k
        delta = beta * (v - predicted)
        S = S + k[:, None] * delta[None, :]  # rank-1 update k delta^T
        o = tl.sum(S * q[:, None], 0)  # [BLOCK_V] = S^T q
        tl.store(ssm_ptr + s_offs, S, mask=mask)
        tl.store(o_row, o, mask=mask_v)


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter runs: small, so the narrow tiles are exercised too


def block_v(batch: int, num_v_heads: int, dk: int, dv: int, num_sms: int) -> int:
    """Value columns per program: 32 (a [128, 32] fp32 tile is 32 registers a thread at 4 warps), 16 when that
    leaves fewer than two programs per SM (small batches), and narrower for a key dim past 256."""
    block_k = next_pow2(dk)
    bv = min(next_pow2(dv), 32, max(4, 8192 // block_k))
    if batch * num_v_heads * -(-dv // bv) < 2 * num_sms:
        bv = min(bv, 16)
    return bv


def gated_delta_decode_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm: Tensor, ssm_pages: Tensor, has_state: Tensor,
    block_v_override: int | None = None, qk_scale: float | None = None,
) -> Tensor:  # fmt: skip
    """The Triton kernel on any device Triton runs on (CPU tensors under TRITON_INTERPRET=1). No host sync."""
    B, Hk, Hv, dk, dv, _ = _check(q, k, v, g, beta, ssm, ssm_pages, has_state)
    o = torch.empty(B, Hv, dv, dtype=torch.float32, device=v.device)
    if B == 0:
        return o
    for name, t in (("q", q), ("k", k), ("v", v), ("ssm", ssm)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    pages = ssm_pages if ssm_pages.is_contiguous() else ssm_pages.contiguous()
    flags = has_state.to(torch.int32)
    bv = block_v_override or block_v(B, Hv, dk, dv, _num_sms(v.device))
    block_k = next_pow2(dk)
    grid = (B * Hv, -(-dv // bv))
    _gated_delta_decode_kernel[grid](
        q, k, v, g, beta, ssm, pages, flags, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), ssm.stride(0), ssm.stride(1), ssm.stride(2),
        1.0 if qk_scale is None else float(qk_scale),
        NUM_V_HEADS=Hv, GROUP=Hv // Hk, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=bv, NORMALIZE_QK=qk_scale is not None,
        num_warps=4 if block_k * bv >= 2048 else 2,
    )  # fmt: skip
    return o


NO_TRITON_ON_CUDA = ("gated delta decode: Triton is not installed, so CUDA tensors take the torch reference "
                     "(gather, recurrence, scatter, with host syncs in every layer)")


def gated_delta_decode(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm: Tensor, ssm_pages: Tensor, has_state: Tensor,
    qk_scale: float | None = None,
) -> Tensor:  # fmt: skip
    """One decode token per sequence, the state updated in its page: Triton on CUDA, the reference elsewhere.
    `qk_scale`: q and k are raw, normalised inside (above)."""
    if ssm.is_cuda and triton is not None:
        return gated_delta_decode_triton(q, k, v, g, beta, ssm, ssm_pages, has_state, qk_scale=qk_scale)
    if ssm.is_cuda:
        warn_once(NO_TRITON_ON_CUDA)
    return gated_delta_decode_reference(q, k, v, g, beta, ssm, ssm_pages, has_state, qk_scale)
