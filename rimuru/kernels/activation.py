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

import torch
import torch.nn.functional as F
from torch import Tensor

from rimuru.kernels.rounding import round_to
from rimuru.kernels.triton_import import libdevice, tl, triton

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
    def _exp(x, PRECISE: tl.constexpr):
        if PRECISE:  # CUDA: expf, as torch's kernels
            return libdevice.exp(x)
        else:  # interpreter: numpy's exp (libdevice has no interpreter implementation)
            return tl.exp(x)

    @triton.jit
    def _silu_and_mul_kernel(
        gate_ptr,  # [R, N] rows stride_g apart
        up_ptr,  # [R, N] rows stride_u apart
        out_ptr,  # [R, N] contiguous
        n_cols,
        stride_g,
        stride_u,
        BLOCK_N: tl.constexpr,
        PRECISE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        act = round_to(tl.div_rn(g, 1.0 + _exp(-g, PRECISE)), dtype)  # F.silu
        out = round_to(act * u, dtype)
        tl.store(out_ptr + row * n_cols + cols, out.to(dtype), mask=mask)

    @triton.jit
    def _sigmoid_mul_add_kernel(
        gate_ptr,  # [R] (a [R, 1] column), entries stride_gl apart
        shared_ptr,  # [R, N] rows stride_s apart
        routed_ptr,  # [R, N] rows stride_r apart
        out_ptr,  # [R, N] contiguous
        n_cols,
        stride_gl,
        stride_s,
        stride_r,
        BLOCK_N: tl.constexpr,
        PRECISE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        dtype = out_ptr.dtype.element_ty
        g = tl.load(gate_ptr + row * stride_gl).to(tl.float32)
        scale = round_to(tl.div_rn(1.0, 1.0 + _exp(-g, PRECISE)), dtype)  # torch.sigmoid
        shared = tl.load(shared_ptr + row * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
        routed = tl.load(routed_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        out = round_to(routed + round_to(scale * shared, dtype), dtype)
        tl.store(out_ptr + row * n_cols + cols, out.to(dtype), mask=mask)


def _rows(t: Tensor) -> Tensor:
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t.reshape(-1, t.shape[-1])  # [R, N]


def _grid(rows: int, cols: int) -> tuple[int, int]:
    return rows, triton.cdiv(cols, _BLOCK_N)


def silu_and_mul_triton(gate: Tensor, up: Tensor) -> Tensor:
    """The Triton kernel on any device Triton runs on (CPU tensors under TRITON_INTERPRET=1)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    g2, u2 = _rows(gate), _rows(up)  # [R, N]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        _silu_and_mul_kernel[_grid(*g2.shape)](
            g2, u2, out, g2.shape[1], g2.stride(0), u2.stride(0),
            BLOCK_N=_BLOCK_N, PRECISE=gate.is_cuda, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def sigmoid_mul_add_triton(gate_logit: Tensor, shared: Tensor, routed: Tensor) -> Tensor:
    if shared.shape != routed.shape or gate_logit.shape != (*shared.shape[:-1], 1):
        raise ValueError(f"gate_logit {tuple(gate_logit.shape)} must be shared {tuple(shared.shape)} with a last "
                         f"dim of 1, routed {tuple(routed.shape)} the same as shared")
    if not gate_logit.dtype == shared.dtype == routed.dtype:
        raise ValueError(f"dtypes differ: {gate_logit.dtype}, {shared.dtype}, {routed.dtype}")
    s2, r2 = _rows(shared), _rows(routed)  # [R, N]
    g1 = gate_logit.reshape(-1)  # [R]
    out = torch.empty(shared.shape, dtype=shared.dtype, device=shared.device)
    if out.numel():
        _sigmoid_mul_add_kernel[_grid(*s2.shape)](
            g1, s2, r2, out, s2.shape[1], g1.stride(0), s2.stride(0), r2.stride(0),
            BLOCK_N=_BLOCK_N, PRECISE=shared.is_cuda, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out


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
