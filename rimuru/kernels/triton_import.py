"""Triton's names for the kernels/ modules, or None where Triton is not installed.

The CPU build of torch comes without Triton, and every kernels/ module must import without it: each takes
`triton`, `tl` and `libdevice` from here and sends its calls to the torch reference when `triton is None`.
Import the names, not this module: a `@triton.jit` body looks `tl` and `libdevice` up among its own
module's globals, and tests patch a module's `triton` to None to force its torch path.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    libdevice = None

__all__ = ["libdevice", "tl", "triton"]
