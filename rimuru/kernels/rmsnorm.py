"""RMSNorm, alone or fused with the residual add in front of it: one Triton launch per call on CUDA.

Rows: x is [..., N]; every leading index is one row, normalised on its own (hidden rows [T, d], per-head
q/k rows [T, H, D], whole-projection q/k rows [T, H*D]).

    rms_norm(x, w, eps)                    out = w * round(x * rsqrt(mean(x^2) + eps))
    fused_add_rms_norm(x, res, w, eps)     s = round(x + res);  returns (rms_norm(s, w, eps), s)
    ..., zero_centred=True                 out = round(x * rsqrt(mean(x^2) + eps) * (1 + w)), all in fp32 and
                                           rounded once to x.dtype (Qwen3.5's and Qwen3-Next's norms, weights
                                           stored around 0)
    rms_norm_gated(x, z, w, eps)           out = round(round(w * round(x * rsqrt(mean(x^2) + eps))) * silu(z)),
                                           silu in fp32 (a gated DeltaNet head's output norm, w in x.dtype)

Rounding, in the order of layers.RMSNorm (HF's): the sum s is rounded to x.dtype first (torch's
`x + res`); mean and rsqrt in fp32 on the rounded input; the normalised row is rounded to x.dtype; then it
is multiplied by the weight in promote(weight.dtype, x.dtype) (bf16 model: round(w * round(n))). The
fp32 sum of squares is a reduction whose order differs from torch's, so the normalised output may differ
from the reference by one ulp where a value sits next to a rounding boundary; `s` is always bit-exact.

Triton tile: program p normalises rows [p * BLOCK_R, (p + 1) * BLOCK_R) as one [BLOCK_R, BLOCK_N] tile,
BLOCK_N = next_pow2(N) (one row = one tile row: no loop, N up to 16384), BLOCK_R > 1 only for short
rows (per-head norms). The grid depends on the shape only: no host sync, CUDA-graph capturable. CPU
tensors (and dtypes the kernel does not handle) take the torch reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rimuru.kernels.launch import as_rows, next_pow2
from rimuru.kernels.rounding import exp_like_torch, round_to
from rimuru.kernels.triton_import import tl, triton

__all__ = [
    "fused_add_rms_norm",
    "fused_add_rms_norm_reference",
    "fused_add_rms_norm_triton",
    "rms_norm",
    "rms_norm_gated",
    "rms_norm_gated_reference",
    "rms_norm_gated_triton",
    "rms_norm_reference",
    "rms_norm_triton",
]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_N = 16384  # one row per tile row: past this a row would not fit in registers


# ---------------------------------------------------------------------------------------------- torch


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, zero_centred: bool = False) -> Tensor:  # [..., N]
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def rms_norm_gated_reference(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:  # x, z [..., N]
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)  # rounded, as HF's
    return (weight * normed * F.silu(z.float())).to(x.dtype)


def fused_add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                 zero_centred: bool = False) -> tuple[Tensor, Tensor]:
    s = x + residual  # [..., N], rounded to the dtype: the residual stream
    return rms_norm_reference(s, weight, eps, zero_centred), s


# ---------------------------------------------------------------------------------------------- Triton

if triton is not None:

    @triton.jit(do_not_specialize=["num_rows"])  # one compiled variant for every token count
    def _rms_norm_kernel(
        x_ptr,  # [R, N] rows stride_x apart, last dim contiguous
        res_ptr,  # [R, N] rows stride_res apart (HAS_RESIDUAL)
        w_ptr,  # [N]
        out_ptr,  # [R, N] contiguous, promote(weight, x) dtype
        res_out_ptr,  # [R, N] contiguous, x dtype (HAS_RESIDUAL)
        z_ptr,  # [R, N] rows stride_z apart (GATED)
        num_rows,
        stride_x,
        stride_res,
        stride_z,
        eps,
        N: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        ZERO_CENTRED: tl.constexpr,
        GATED: tl.constexpr,
        PRECISE: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [R]
        cols = tl.arange(0, BLOCK_N)  # [BN]
        rows64 = rows.to(tl.int64)
        mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + rows64[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
            x = round_to(x + res.to(tl.float32), x_ptr.dtype.element_ty)
            tl.store(res_out_ptr + rows64[:, None] * N + cols[None, :], x.to(x_ptr.dtype.element_ty), mask=mask)
        mean_sq = tl.sum(x * x, axis=1) * (1.0 / N)  # [R]; padding columns add 0
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)  # [BN]
        if ZERO_CENTRED:  # fp32 throughout, one rounding at the end
            out = round_to(x * tl.rsqrt(mean_sq + eps)[:, None] * (1.0 + w[None, :]), out_ptr.dtype.element_ty)
        elif GATED:  # w * normed rounded to x's dtype (w is in it), then * silu(z) in fp32, rounded once more
            dtype = x_ptr.dtype.element_ty
            normed = round_to(x * tl.rsqrt(mean_sq + eps)[:, None], dtype)  # [R, BN]
            z = tl.load(z_ptr + rows64[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            act = tl.div_rn(z, 1.0 + exp_like_torch(-z, PRECISE))  # F.silu in fp32
            out = round_to(round_to(normed * w[None, :], dtype) * act, out_ptr.dtype.element_ty)
        else:
            normed = round_to(x * tl.rsqrt(mean_sq + eps)[:, None], x_ptr.dtype.element_ty)  # [R, BN]
            out = round_to(normed * w[None, :], out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows64[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, zero_centred: bool = False,
            gate: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    n = x.shape[-1]
    x2 = as_rows(x)  # [R, N]
    r2 = as_rows(residual) if residual is not None else x2
    z2 = as_rows(gate) if gate is not None else x2
    num_rows = x2.shape[0]
    same = zero_centred or gate is not None  # these forms end in x's dtype whatever the weight's
    out_dtype = x.dtype if same else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    if num_rows == 0:
        return out, res_out
    block_n = next_pow2(n)
    block_r = max(1, min(16, 2048 // block_n))
    tile = block_r * block_n
    _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        x2, r2, weight, out, res_out if res_out is not None else out, z2,
        num_rows, x2.stride(0), r2.stride(0), z2.stride(0), eps,
        N=n, BLOCK_N=block_n, BLOCK_R=block_r, HAS_RESIDUAL=residual is not None, ZERO_CENTRED=zero_centred,
        GATED=gate is not None, PRECISE=x.is_cuda,
        num_warps=min(16, max(1, tile // 256)), enable_fp_fusion=False,
    )  # fmt: skip
    return out, res_out


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float, zero_centred: bool = False) -> Tensor:
    """The Triton kernel on any device Triton runs on (CPU tensors under TRITON_INTERPRET=1)."""
    return _launch(x, None, weight, eps, zero_centred)[0]


def fused_add_rms_norm_triton(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                              zero_centred: bool = False) -> tuple[Tensor, Tensor]:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    out, res_out = _launch(x, residual, weight, eps, zero_centred)
    assert res_out is not None
    return out, res_out


def rms_norm_gated_triton(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    if z.shape != x.shape or z.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"gate {tuple(z.shape)} {z.dtype} and weight {weight.dtype} must match x {tuple(x.shape)} "
                         f"{x.dtype}")
    return _launch(x, None, weight, eps, gate=z)[0]


def _kernel_ok(x: Tensor, weight: Tensor) -> bool:
    return (triton is not None and x.is_cuda and x.dtype in _KERNEL_DTYPES and weight.dtype in _KERNEL_DTYPES
            and weight.shape == x.shape[-1:] and weight.is_contiguous() and x.shape[-1] <= _MAX_N)


def rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centred: bool = False) -> Tensor:  # [..., N]
    """RMSNorm over the last dim: the Triton kernel on CUDA tensors, the torch reference elsewhere."""
    if _kernel_ok(x, weight):
        return rms_norm_triton(x, weight, eps, zero_centred)
    return rms_norm_reference(x, weight, eps, zero_centred)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                       zero_centred: bool = False) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual), x + residual), the sum rounded to x.dtype: one kernel on CUDA."""
    if _kernel_ok(x, weight) and residual.dtype == x.dtype and residual.shape == x.shape:
        return fused_add_rms_norm_triton(x, residual, weight, eps, zero_centred)
    return fused_add_rms_norm_reference(x, residual, weight, eps, zero_centred)


def rms_norm_gated(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:  # x, z [..., N]
    """w * RMSNorm(x) * silu(z): one kernel on CUDA (same shapes and dtypes), the torch reference elsewhere."""
    if _kernel_ok(x, weight) and z.shape == x.shape and z.dtype == x.dtype and weight.dtype == x.dtype:
        return rms_norm_gated_triton(x, z, weight, eps)
    return rms_norm_gated_reference(x, z, weight, eps)
