"""How many Triton kernel variants this process has built: a count the engine reads around start-up and steps.

A Triton kernel is compiled per *variant*: its constexpr values and the specialisation of its other arguments
(integers equal to 1 or divisible by 16, pointers aligned to 16 bytes, unless the kernel opts out). The first launch
of a variant builds it (compiles it, or loads it from Triton's on-disk cache) before it runs: 0.2-3 s of host time
on our machines, taken out of whatever step launched it. The engine therefore builds the variants its steps will
meet at start-up (engine/kernel_warmup.py), the kernels opt out of specialising on per-step integers and index
arrays' alignment, and this count shows what is left: variants built while serving (`kernel_variants_built` in the
engine's stats, each one a stalled step).

The count comes from Triton's `jit_cache_hook`, which Triton calls before building any variant that is not in the
kernel's in-memory cache (fla's kernels and its autotuner's trial configurations included). A hook set before
`install()` keeps being called, and its answer (True: skip the build) is returned. Under TRITON_INTERPRET=1 nothing
is built and nothing is counted.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from rimuru.kernels.triton_import import triton

_lock = threading.Lock()
_count = 0
_by_kernel: collections.Counter[str] = collections.Counter()
_installed = False


def install() -> bool:
    """Starts counting (idempotent). False where Triton, or its runtime hook, is not there."""
    global _installed
    with _lock:
        if _installed:
            return True
        knobs = getattr(triton, "knobs", None) if triton is not None else None
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return False
        previous = runtime.jit_cache_hook

        def count_build(**kwargs: Any) -> bool | None:
            global _count
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
            with _lock:
                _count += 1
                _by_kernel[name.rsplit(".", 1)[-1]] += 1
            return previous(**kwargs) if previous is not None else None

        runtime.jit_cache_hook = count_build
        _installed = True
        return True


def count() -> int:
    """Variants built since `install()`."""
    return _count


def by_kernel() -> dict[str, int]:
    """Variants built since `install()`, per kernel function name."""
    with _lock:
        return dict(_by_kernel)
