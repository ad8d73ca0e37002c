"""Host-side helpers shared by the kernels' launchers: tile sizes, and the notice of a slow fallback.

Nothing here needs Triton: the dispatchers call `warn_once` exactly when Triton is missing.
"""

from __future__ import annotations

import functools
import logging

__all__ = ["next_pow2", "warn_once"]


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): Triton's block shapes must be powers of two."""
    return 1 << max(0, (x - 1).bit_length())


@functools.cache  # the cache is the "already said" record: one warning per distinct message per process
def warn_once(message: str) -> None:
    """Log `message` as a warning on the "rimuru" logger, the first time only."""
    logging.getLogger("rimuru").warning(message)
