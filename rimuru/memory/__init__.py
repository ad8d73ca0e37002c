"""The unified page pool: geometry (page sizes, id arithmetic), allocator (three levels), pool (typed views)."""

from rimuru.memory.allocator import (
    AllocatorError,
    AllocatorStats,
    DoubleFreeError,
    PageAllocator,
    WrongKindError,
)
from rimuru.memory.geometry import PageGeometry
from rimuru.memory.pool import PagePool

__all__ = [
    "AllocatorError",
    "AllocatorStats",
    "DoubleFreeError",
    "PageAllocator",
    "PageGeometry",
    "PagePool",
    "WrongKindError",
]
