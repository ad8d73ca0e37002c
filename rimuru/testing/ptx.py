"""Compiles a Triton kernel to PTX for a GPU target on a machine without a GPU, and counts its global loads.

Triton derives how wide a load may be (1 element up to 16 bytes) from what it can prove about the
addresses: contiguity and divisibility, including the launcher's "divisible by 16" specialisation of
pointers and integer arguments. A kernel whose address arithmetic hides that (a reshape of computed
offsets, say) silently falls back to one-element loads; a memory-bound kernel then runs at a fraction of
the bandwidth. tests/test_kernel_ptx.py uses this to pin the load widths of our hot kernels.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

# Integer and pointer arguments the launcher would mark "divisible by 16" get the same hint here.
DIVISIBLE = 16


def compile_ptx(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], divisible: set[str],
                num_warps: int = 4, num_stages: int = 3, capability: int = 90) -> str:
    """kernel: a @triton.jit function; signature: argument -> Triton type ("*bf16", "i32", "fp32");
    constexprs: constexpr argument -> value; divisible: arguments specialised as multiples of 16."""
    import triton
    from triton.backends.compiler import GPUTarget

    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    names = list(kernel.arg_names)
    missing = [n for n in names if n not in sig]
    if missing:
        raise ValueError(f"no type for arguments {missing}")
    attrs = {(names.index(n),): [["tt.divisibility", DIVISIBLE]] for n in divisible}
    src = triton.compiler.ASTSource(fn=kernel, signature={n: sig[n] for n in names}, constexprs=constexprs,
                                    attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled.asm["ptx"]


def global_load_bytes(ptx: str) -> Counter:
    """Bytes per thread of every global load instruction (ld.global and cp.async), counted: {16: 32, 4: 3}."""
    widths: Counter = Counter()
    for m in re.finditer(r"ld\.global[.a-z0-9:]*?(?:\.v(\d))?\.(?:b|u|s|f)(\d+)\s", ptx):
        widths[int(m.group(1) or 1) * int(m.group(2)) // 8] += 1
    copy = r"cp\.async\.c[ag]\.shared\.global[.a-z0-9:]*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)"
    for m in re.finditer(copy, ptx):
        widths[int(m.group(1), 0)] += 1
    return widths
