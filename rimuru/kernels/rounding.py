"""Rounding fp32 values the way torch rounds each op's result, inside Triton kernels.

A chain of torch ops on bf16 tensors rounds after EVERY op (each op computes in fp32 and stores bf16,
round to nearest even). A fused kernel that wants the same bits computes in fp32 and calls
`round_to(v, DTYPE)` wherever torch would have stored a tensor:

    torch:   y = x1 * c - x2 * s                       (bf16: three roundings)
    kernel:  y = round_to(round_to(x1 * c, BF16) - round_to(x2 * s, BF16), BF16)

`round_to` returns fp32 holding a value that DTYPE represents exactly, so the final `.to(DTYPE)` of a
store is exact. bf16 is rounded with integer arithmetic (add 0x7FFF plus the lowest kept bit, clear the
low 16 bits: IEEE round-to-nearest-even) instead of `.to(tl.bfloat16)`: the Triton interpreter's
fp32 -> bf16 cast truncates, and the CPU tests check bits through the interpreter. On the GPU the two
agree (cvt.rn.bf16.f32 is also round-to-nearest-even). NaN stays NaN. (The interpreter also stores bf16
subnormals wrongly, whatever the rounding: its tests keep values normal.)

Kernels that emulate a rounding order are launched with `enable_fp_fusion=False` on the GPU: otherwise
`a * b - c` in fp32 may compile to one FMA (one rounding), which torch's separate ops never do.
"""

from __future__ import annotations

from rimuru.kernels.triton_import import libdevice, tl, triton

__all__ = ["exp_like_torch", "round_to"]

if triton is not None:

    @triton.jit
    def round_to(x, DTYPE: tl.constexpr):
        """fp32 x rounded to DTYPE (fp32, bf16 or fp16), returned as fp32."""
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        elif DTYPE == tl.float16:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    @triton.jit
    def exp_like_torch(x, PRECISE: tl.constexpr):
        """exp of fp32 x as torch's CUDA kernels compute it (libdevice's expf) where PRECISE; under the
        interpreter (PRECISE False) numpy's exp, since libdevice has no interpreter implementation."""
        if PRECISE:
            return libdevice.exp(x)
        else:
            return tl.exp(x)
else:  # the names import without Triton too; nothing calls them there
    round_to = None
    exp_like_torch = None
