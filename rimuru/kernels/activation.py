"""The elementwise tails of the dense MLP and of the shared expert, one launch each on CUDA.

    silu_and_mul(gate, up)               [T, F] x2 -> [T, F]     silu(gate) * up        (GatedMLP)
    sigmoid_mul_add(g, shared, routed)   [T, 1], [T, d] x2 -> [T, d]
                                         routed + sigmoid(g) * shared                  (SharedExpertMoE)

Both reproduce the torch expressions bit for bit: fp32 math on the inputs, rounded to the dtype where
torch stores an intermediate tensor (rimuru/kernels/rounding.py):

    silu_and_mul:     round(round(g / (1 + exp(-g))) * up)
    sigmoid_mul_add:  round(routed + round(round(1 / (1 + exp(-g))) * shared))

exp is libdevice's expf and the divisions are IEEE (div.rn), the functions torch's CUDA kernels compile
to; the interpreter (CPU tests) uses numpy's. Layout: rows may be strided, the last dim must be
contiguous (it is taken contiguous otherwise); outputs are contiguous. Program (row, column block) of
BLOCK_N elements: the grid depends on the shape only, CUDA-graph capturable. CPU tensors and mixed
dtypes take the torch reference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rimuru.kernels.launch import as_rows
from rimuru.kernels.rounding import exp_like_torch, round_to
from rimuru.kernels.triton_import import tl, triton

__all__ = [
    "sigmoid_mul_add",
    "sigmoid_mul_add_reference",
    "sigmoid_mul_add_triton",
    "silu_and_mul",
    "silu_and_mul_reference",
    "silu_and_mul_triton",
]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_N = 1024


def silu_and_mul_reference(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def sigmoid_mul_add_reference(gate_logit: Tensor, shared: Tensor, routed: Tensor) -> Tensor:
    return routed + torch.sigmoid(gate_logit) * shared


if triton is not None:

    @triton.jit
    def _row_block(n_cols, BLOCK_N: tl.constexpr):
        """Program (row, column block): its row (int64), its BLOCK_N columns and which of them exist."""
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return tl.program_id(0).to(tl.int64), cols, cols < n_cols

    @triton.jit
    def _load_row(ptr, row, stride, cols, mask):
        """Columns `cols` of row `row` of a [R, N] tensor whose rows are `stride` apart, in fp32."""
        return tl.load(ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _silu_and_mul_kernel(
        out_ptr,  # [R, N] contiguous
        n_cols,
        gate_ptr, stride_g,  # [R, N], rows stride_g apart
        up_ptr, stride_u,  # [R, N], rows stride_u apart
        BLOCK_N: tl.constexpr, PRECISE: tl.constexpr,
    ):  # fmt: skip
        row, cols, mask = _row_block(n_cols, BLOCK_N)
        g = _load_row(gate_ptr, row, stride_g, cols, mask)
        u = _load_row(up_ptr, row, stride_u, cols, mask)
        dtype = out_ptr.dtype.element_ty
        act = round_to(tl.div_rn(g, 1.0 + exp_like_torch(-g, PRECISE)), dtype)  # F.silu
        out = round_to(act * u, dtype)
        tl.store(out_ptr + row * n_cols + cols, out.to(dtype), mask=mask)

    @triton.jit
    def _sigmoid_mul_add_kernel(
        out_ptr,  # [R, N] contiguous
        n_cols,
        gate_ptr, stride_gl,  # [R] (a [R, 1] column), entries stride_gl apart
        shared_ptr, stride_s,  # [R, N], rows stride_s apart
        routed_ptr, stride_r,  # [R, N], rows stride_r apart
        BLOCK_N: tl.constexpr, PRECISE: tl.constexpr,
    ):  # fmt: skip
        row, cols, mask = _row_block(n_cols, BLOCK_N)
        dtype = out_ptr.dtype.element_ty
        g = tl.load(gate_ptr + row * stride_gl).to(tl.float32)
        scale = round_to(tl.div_rn(1.0, 1.0 + exp_like_torch(-g, PRECISE)), dtype)  # torch.sigmoid
        shared = _load_row(shared_ptr, row, stride_s, cols, mask)
        routed = _load_row(routed_ptr, row, stride_r, cols, mask)
        out = round_to(routed + round_to(scale * shared, dtype), dtype)
        tl.store(out_ptr + row * n_cols + cols, out.to(dtype), mask=mask)


def _launch(kernel: Any, like: Tensor, *inputs: Tensor) -> Tensor:
    """kernel(out, N, then each input and its row stride), one program per (row, BLOCK_N columns) of like's
    [R, N] rows; out is a new contiguous tensor of like's shape and dtype."""
    out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    n_cols = like.shape[-1]
    if out.numel():
        kernel[(out.numel() // n_cols, triton.cdiv(n_cols, _BLOCK_N))](
            out, n_cols, *(a for t in inputs for a in (t, t.stride(0))),
            BLOCK_N=_BLOCK_N, PRECISE=like.is_cuda, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def silu_and_mul_triton(gate: Tensor, up: Tensor) -> Tensor:
    """The Triton kernel on any device Triton runs on (CPU tensors under TRITON_INTERPRET=1)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    return _launch(_silu_and_mul_kernel, gate, as_rows(gate), as_rows(up))  # [R, N] each


def sigmoid_mul_add_triton(gate_logit: Tensor, shared: Tensor, routed: Tensor) -> Tensor:
    if shared.shape != routed.shape or gate_logit.shape != (*shared.shape[:-1], 1):
        raise ValueError(f"gate_logit {tuple(gate_logit.shape)} must be shared {tuple(shared.shape)} with a last "
                         f"dim of 1, routed {tuple(routed.shape)} the same as shared")
    if not gate_logit.dtype == shared.dtype == routed.dtype:
        raise ValueError(f"dtypes differ: {gate_logit.dtype}, {shared.dtype}, {routed.dtype}")
    # gate_logit [R], shared and routed [R, N]
    return _launch(_sigmoid_mul_add_kernel, shared, gate_logit.reshape(-1), as_rows(shared), as_rows(routed))


def silu_and_mul(gate: Tensor, up: Tensor) -> Tensor:  # [..., F] x2
    """silu(gate) * up: the Triton kernel on CUDA tensors, the torch reference elsewhere."""
    if triton is not None and gate.is_cuda and gate.dtype in _KERNEL_DTYPES and gate.dtype == up.dtype \
            and gate.shape == up.shape:
        return silu_and_mul_triton(gate, up)
    return silu_and_mul_reference(gate, up)


def sigmoid_mul_add(gate_logit: Tensor, shared: Tensor, routed: Tensor) -> Tensor:  # [..., 1], [..., d] x2
    """routed + sigmoid(gate_logit) * shared: the Triton kernel on CUDA tensors, the torch reference elsewhere."""
    same = shared.dtype in _KERNEL_DTYPES and gate_logit.dtype == shared.dtype == routed.dtype
    shapes = shared.shape == routed.shape and gate_logit.shape == (*shared.shape[:-1], 1)
    if triton is not None and shared.is_cuda and same and shapes:
        return sigmoid_mul_add_triton(gate_logit, shared, routed)
    return sigmoid_mul_add_reference(gate_logit, shared, routed)
