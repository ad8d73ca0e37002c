"""Rotary position embedding (the 'default' rope type: rotate-half over the full head dim): the module.

`RotaryEmbedding` owns the frequencies; per step the model computes each token's cos/sin once with it and
every attention layer rotates its q and k with `apply_rotary_qk`. Both computations, their Triton kernels
and torch references are in rimuru/kernels/rotary.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rimuru.kernels.rotary import cos_sin


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
        return cos_sin(positions, self.inv_freq(positions.device), dtype)  # one kernel on CUDA
