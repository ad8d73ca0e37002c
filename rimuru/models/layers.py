"""Small layers every architecture shares: RMSNorm and the SiLU-gated MLP.

On CUDA tensors their elementwise work is one Triton launch each (rimuru/kernels/rmsnorm.py,
activation.py), with the same numerics as the torch code the CPU runs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rimuru.kernels.activation import silu_and_mul
from rimuru.kernels.rmsnorm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back before the weight (as HF does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., size]
        return rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:  # [..., size] each
        """(norm(x + residual), x + residual): the residual add before a norm, fused into it."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(SiLU(gate(x)) * up(x)): dense layers and the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [T, d]
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))  # [T, d]
