"""Host-side helpers shared by the kernels' launchers: row views, tile sizes, and the notice of a slow fallback.

Nothing here needs Triton: the dispatchers call `warn_once` exactly when Triton is missing.
"""

from __future__ import annotations

import functools
import logging

from torch import Tensor

__all__ = ["as_rows", "inner_contiguous", "next_pow2", "warn_once"]


def as_rows(t: Tensor) -> Tensor:
    """[..., N] as [R, N] with a contiguous last dim (a view whenever the layout allows)."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t.reshape(-1, t.shape[-1])


def inner_contiguous(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Each tensor as is when its last dim is contiguous (strided rows and heads are fine), else a contiguous copy."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): Triton's block shapes must be powers of two."""
    return 1 << max(0, (x - 1).bit_length())


@functools.cache  # the cache is the "already said" record: one warning per distinct message per process
def warn_once(message: str) -> None:
    """Log `message` as a warning on the "rimuru" logger, the first time only."""
    logging.getLogger("rimuru").warning(message)
