"""Which Triton kernel variant a launch would build, found on any machine (no GPU, nothing compiled or run).

Triton keys a kernel's compiled variants on its constexprs, its launch options and the specialisation of every
other argument (type; for integers whether == 1 or divisible by 16, for pointers whether 16-byte aligned, unless the
kernel opts out). `recorded_variants` swaps the named kernels' launches for a recorder that computes that key with
Triton's own binder (`create_function_from_signature`, over the kernel's parameters as declared) and runs nothing,
so a test can call a launcher with CPU tensors at two batch shapes and compare the variants they would build.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature


@contextmanager
def recorded_variants(*kernels: JITFunction) -> Iterator[list[tuple[str, str]]]:
    """Within the block, every launch of `kernels` appends (kernel name, variant key) and runs nothing."""
    records: list[tuple[str, str]] = []

    def recorder(kernel: JITFunction) -> Any:
        binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)

        def run(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            _, specialization, options = binder(*args, **kwargs)
            records.append((kernel.fn.__name__, repr((specialization, sorted(options.items())))))

        return run

    for kernel in kernels:
        kernel.run = recorder(kernel)  # an instance attribute: shadows JITFunction.run until deleted
    try:
        yield records
    finally:
        for kernel in kernels:
            del kernel.run


def forget_built_variants() -> int:
    """Drops every rimuru kernel's built variants from memory (Triton's on-disk cache stays), so that a test sees
    every variant a run builds, not only those no earlier test of the process built. Returns the kernels cleared."""
    import importlib
    import pkgutil

    import rimuru.kernels

    cleared = 0
    for info in pkgutil.iter_modules(rimuru.kernels.__path__):
        module = importlib.import_module(f"rimuru.kernels.{info.name}")
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                value.device_caches.clear()
                cleared += 1
    return cleared
