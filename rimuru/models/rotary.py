"""Rotary position embedding (the 'default' rope type: rotate-half over the full head dim)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def check_rope_config(hf_config: dict[str, Any]) -> None:
    """Refuse rope variants we do not implement instead of silently computing something else."""
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"rope type {rope_type!r} is not supported (only 'default')")
    factor = hf_config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise NotImplementedError(f"partial_rotary_factor={factor} is not supported")


class RotaryEmbedding(nn.Module):
    # The frequencies are not a buffer: casting the model to bf16 must not round them, and a model
    # built on the meta device must still get real ones. They are made on first use per device.
    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self._inv_freq: Tensor | None = None

    def inv_freq(self, device: torch.device) -> Tensor:  # [D/2] fp32
        if self._inv_freq is None or self._inv_freq.device != device:
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
            self._inv_freq = 1.0 / (self.theta**exponents)
        return self._inv_freq

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of every (position, frequency), fp32 math then cast: each [T, D/2]."""
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]  # [T, D/2]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs (x[i], x[i + D/2]) of every head by the position's angle."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, H, D]
