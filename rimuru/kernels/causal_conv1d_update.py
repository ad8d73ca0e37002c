"""One decode step of the depthwise causal conv + SiLU of a gated DeltaNet layer, the conv state in its pool page.

    x           [B, C]                   this token's pre-conv input (in_proj_qkv's output), model dtype
    conv        [n_pages, C, K-1]        the pool's conv view (models/state_cache.py): per page the last K-1
                                         inputs of one request, oldest first
    weight      [C, K]                   the depthwise kernel
    conv_pages  [B] int                  page of sequence b; < 0 = a padding row (nothing read or written, y 0)
    has_state   [B] bool                 False = fresh: the K-1 past inputs are SELECTED as zero (garbage pages)

Per sequence and channel, as `causal_conv1d` (models/gated_deltanet.py) does for one token:

    full = [state_0 .. state_{K-2}, x];  y = silu(sum_j weight[:, j] * full[j]);  page <- full[1:]

Returns y [B, C] in x's dtype (the sum and SiLU in fp32). Distinct sequences must have distinct pages.
The kernel's program (b, channel block) reads its K-1 state columns, writes them back shifted by one; the grid
depends on B and C only: no host sync, capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rimuru.kernels.launch import next_pow2, warn_once
from rimuru.kernels.triton_import import tl, triton

__all__ = ["causal_conv1d_update", "causal_conv1d_update_reference", "causal_conv1d_update_triton"]


def _check(x: Tensor, conv: Tensor, weight: Tensor, conv_pages: Tensor, has_state: Tensor) -> tuple[int, int, int]:
    if x.dim() != 2 or conv.dim() != 3 or weight.dim() != 2:
        raise ValueError(f"want x [B, C], conv [pages, C, K-1], weight [C, K]; got {tuple(x.shape)}, "
                         f"{tuple(conv.shape)}, {tuple(weight.shape)}")
    B, C = x.shape
    K = weight.shape[1]
    if weight.shape[0] != C or tuple(conv.shape[1:]) != (C, K - 1) or K < 2:
        raise ValueError(f"x {tuple(x.shape)}, conv {tuple(conv.shape)} and weight {tuple(weight.shape)} do not "
                         "match (conv [pages, C, K-1], weight [C, K], K >= 2)")
    if conv_pages.shape != (B,) or has_state.shape != (B,):
        raise ValueError(f"want conv_pages and has_state [{B}], got {tuple(conv_pages.shape)}, "
                         f"{tuple(has_state.shape)}")
    return B, C, K


def causal_conv1d_update_reference(
    x: Tensor, conv: Tensor, weight: Tensor, conv_pages: Tensor, has_state: Tensor,
) -> Tensor:  # fmt: skip
    """Gather, one step of the layer's `causal_conv1d` restated (kernels/ sits below models/; the tests hold the
    two equal), scatter. Host syncs (boolean indexing): the definition of the function, not a fast path."""
    B, C, K = _check(x, conv, weight, conv_pages, has_state)
    pages = conv_pages.long()
    valid = pages >= 0
    keep = has_state.bool() & valid
    state0 = torch.where(keep[:, None, None], conv[pages.clamp(min=0)],
                         torch.zeros((), dtype=conv.dtype, device=conv.device))  # [B, C, K-1]
    full = torch.cat([state0.to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, K]: times -K+1 .. 0
    y = F.silu(F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=C)[:, :, 0]).to(x.dtype)  # [B, C]
    conv.index_copy_(0, pages[valid], full[valid, :, 1:].to(conv.dtype))
    return torch.where(valid[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))


if triton is not None:

    # a layer's row of the [L, B] state page ids starts wherever l*B puts it: not specialised on alignment
    @triton.jit(do_not_specialize_on_alignment=["pages_ptr", "has_state_ptr"])
    def _causal_conv1d_update_kernel(
        x_ptr,  # [B, C]
        conv_ptr,  # [P, C, K-1], updated in place
        w_ptr,  # [C, K]
        pages_ptr,  # [B] int32 / int64
        has_state_ptr,  # [B] int32
        y_ptr,  # [B, C], contiguous, x's dtype
        stride_x_b,
        stride_c_page, stride_c_ch,
        stride_w_ch,
        C: tl.constexpr,
        K: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = offs < C
        y_row = y_ptr + b.to(tl.int64) * C + offs
        page = tl.load(pages_ptr + b).to(tl.int64)
        if page < 0:  # padding row
            tl.store(y_row, tl.zeros([BLOCK_C], tl.float32).to(y_ptr.dtype.element_ty), mask=mask)
            return
        has = tl.load(has_state_ptr + b) != 0
        state = conv_ptr + page * stride_c_page + offs * stride_c_ch  # [BLOCK_C] column 0 of each channel
        x = tl.load(x_ptr + b * stride_x_b + offs, mask=mask, other=0.0)
        # the conv runs in the weight's dtype, as F.conv1d in causal_conv1d; products summed in fp32
        acc = tl.load(w_ptr + offs * stride_w_ch + (K - 1), mask=mask, other=0.0).to(tl.float32) * \
            x.to(w_ptr.dtype.element_ty).to(tl.float32)
        for j in tl.static_range(K - 1):
            # a fresh sequence's past inputs are selected as zero: the masked load never reads the page
            s = tl.load(state + j, mask=mask & has, other=0.0)  # [BLOCK_C] input at time j - (K - 1)
            w = tl.load(w_ptr + offs * stride_w_ch + j, mask=mask, other=0.0).to(tl.float32)
            acc += w * s.to(w_ptr.dtype.element_ty).to(tl.float32)
            if j > 0:  # shift left by one: column j - 1 was read in the previous iteration
                tl.store(state + (j - 1), s, mask=mask)
        tl.store(state + (K - 2), x.to(conv_ptr.dtype.element_ty), mask=mask)
        acc = acc.to(w_ptr.dtype.element_ty).to(tl.float32)  # the conv's output rounds to its dtype, as F.conv1d's
        y = acc / (1.0 + tl.exp(-acc))  # SiLU
        tl.store(y_row, y.to(y_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update_triton(
    x: Tensor, conv: Tensor, weight: Tensor, conv_pages: Tensor, has_state: Tensor,
) -> Tensor:  # fmt: skip
    """The Triton kernel on any device Triton runs on (CPU tensors under TRITON_INTERPRET=1). No host sync."""
    B, C, K = _check(x, conv, weight, conv_pages, has_state)
    y = torch.empty(B, C, dtype=x.dtype, device=x.device)
    if B == 0:
        return y
    for name, t in (("x", x), ("conv", conv), ("weight", weight)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    pages = conv_pages if conv_pages.is_contiguous() else conv_pages.contiguous()
    block_c = min(next_pow2(C), 1024)
    _causal_conv1d_update_kernel[(B, -(-C // block_c))](
        x, conv, weight, pages, has_state.to(torch.int32), y,
        x.stride(0), conv.stride(0), conv.stride(1), weight.stride(0),
        C=C, K=K, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    return y


NO_TRITON_ON_CUDA = ("causal conv1d update: Triton is not installed, so CUDA tensors take the torch reference "
                     "(gather, conv, scatter, with host syncs in every layer)")


def causal_conv1d_update(x: Tensor, conv: Tensor, weight: Tensor, conv_pages: Tensor, has_state: Tensor) -> Tensor:
    """One decode token per sequence, the conv state shifted in its page: Triton on CUDA, the reference elsewhere."""
    if conv.is_cuda and triton is not None:
        return causal_conv1d_update_triton(x, conv, weight, conv_pages, has_state)
    if conv.is_cuda:
        warn_once(NO_TRITON_ON_CUDA)
    return causal_conv1d_update_reference(x, conv, weight, conv_pages, has_state)

