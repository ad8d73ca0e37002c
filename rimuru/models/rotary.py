"""Rotary position embedding (the 'default' rope type: rotate-half): the module.

`RotaryEmbedding` owns the frequencies; per step the model computes each token's cos/sin once with it and
every attention layer rotates its q and k with `apply_rotary_qk` (full rotary) or `rotate_qk` (either).
Both computations, their Triton kernels and torch references are in rimuru/kernels/rotary.py.

Partial rotary (Qwen3.5, Qwen3-Next: `partial_rotary_factor` 0.25) rotates only the first
rotary_dim = head_dim * factor dims of each head, rotate-half within them, with frequencies
theta^(-2i / rotary_dim); the other dims pass through unrotated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rimuru.kernels.rotary import apply_rotary_qk, cos_sin


def partial_rotary_factor(hf_config: dict[str, Any]) -> float:
    """The fraction of each head's dims that rotary rotates (1.0 unless the config says otherwise)."""
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    return float(hf_config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))


def check_rope_config(hf_config: dict[str, Any], allow_partial: bool = False) -> None:
    """Refuse rope variants we do not implement instead of silently computing something else.

    Only an architecture whose attention rotates through `RotaryEmbedding.rotate_qk` may allow partial rotary.
    """
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"rope type {rope_type!r} is not supported (only 'default')")
    factor = partial_rotary_factor(hf_config)
    if factor != 1.0 and not (allow_partial and 0.0 < factor < 1.0):
        raise NotImplementedError(f"partial_rotary_factor={factor} is not supported")


class RotaryEmbedding(nn.Module):
    # The frequencies are not a buffer: casting the model to bf16 must not round them, and a model
    # built on the meta device must still get real ones. They are made on first use per device.
    def __init__(self, head_dim: int, theta: float, rotary_dim: int | None = None) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and in (0, head_dim={head_dim}]")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim  # R: the leading dims of each head that rotate
        self.theta = theta
        self._inv_freq: Tensor | None = None

    @classmethod
    def from_factor(cls, head_dim: int, theta: float, factor: float) -> RotaryEmbedding:
        return cls(head_dim, theta, int(head_dim * factor))  # truncated as transformers does

    def inv_freq(self, device: torch.device) -> Tensor:  # [R/2] fp32
        if self._inv_freq is None or self._inv_freq.device != device:
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
            self._inv_freq = 1.0 / (self.theta**exponents)
        return self._inv_freq

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of every (position, frequency), fp32 math then cast: each [T, R/2]."""
        return cos_sin(positions, self.inv_freq(positions.device), dtype)  # one kernel on CUDA

    def rotate_qk(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate the first R dims of q [T, Hq, D] and k [T, Hkv, D] with this module's cos/sin [T, R/2]."""
        return rotate_qk(q, k, cos, sin)


def rotate_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Partial or full rotary: the first R = 2 * cos.shape[-1] dims of each head rotate, the rest pass."""
    R = 2 * cos.shape[-1]
    if R == q.shape[-1]:
        return apply_rotary_qk(q, k, cos, sin)
    # slices keep the head dim contiguous, which is all the kernel needs of its inputs
    q_rot, k_rot = apply_rotary_qk(q[..., :R], k[..., :R], cos, sin)  # [T, Hq, R], [T, Hkv, R]
    return torch.cat([q_rot, q[..., R:]], dim=-1), torch.cat([k_rot, k[..., R:]], dim=-1)
