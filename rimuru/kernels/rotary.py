"""Rotary position embedding kernels (the 'default' rope type: rotate-half over the full head dim).

Per step, the model computes each token's angles once; every attention layer rotates its q and k:

    cos_sin(positions [T], inv_freq [D/2], dtype)
                                        freqs = fp32(positions) x inv_freq    [T, D/2] fp32
                                        cos, sin = cos(freqs), sin(freqs) rounded to dtype, each [T, D/2]
    apply_rotary_qk(q, k, cos, sin)     q [T, Hq, D], k [T, Hkv, D]: each head's pairs (x[i], x[i + D/2])
                                        become (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    rotary_write_kv(q, k, v, cos, sin, kv_cache, slot_mapping)
                                        the same rotation, with the rotated k and v written straight into
                                        their KV cache slots (write_kv's, slots < 0 skipped): returns q rotated

On CUDA each is ONE Triton launch (instead of 6 and 2 x 7 torch kernels, and rotary_write_kv one for the
rotation and the K/V write) that reproduces the torch
expressions bit for bit: fp32 cos/sin (libdevice's cosf/sinf, the functions torch's CUDA kernels compile
to) rounded to the dtype, then the rotation rounded where torch rounds each op:
round(round(x1 * cos) - round(x2 * sin)), round(round(x2 * cos) + round(x1 * sin))
(rimuru/kernels/rounding.py). q and k may have strided tokens and heads (views of a projection); the
head dim must be contiguous. Outputs are new contiguous tensors. Grids depend on shapes only: CUDA-graph
capturable. CPU tensors take the torch code (the reference). The module (frequencies, rope config checks)
is rimuru/models/rotary.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rimuru.kernels.launch import inner_contiguous, next_pow2
from rimuru.kernels.paged_attention import write_kv, write_kv_reference
from rimuru.kernels.rounding import round_to
from rimuru.kernels.triton_import import libdevice, tl, triton

__all__ = [
    "apply_rotary",
    "apply_rotary_qk",
    "apply_rotary_qk_triton",
    "cos_sin",
    "cos_sin_reference",
    "cos_sin_triton",
    "rotary_write_kv",
    "rotary_write_kv_reference",
    "rotary_write_kv_triton",
]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------- torch


def cos_sin_reference(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs (x[i], x[i + D/2]) of every head by the position's angle."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, H, D]


def rotary_write_kv_reference(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor,
                              slot_mapping: Tensor) -> Tensor:
    """q rotated [T, Hq, D]; k rotated and v written into kv_cache [P, 2, block, Hkv, D] at `slot_mapping`."""
    k_rot = apply_rotary(k, cos, sin)
    write_kv_reference(k_rot, v, kv_cache, slot_mapping)
    return apply_rotary(q, cos, sin)


# ---------------------------------------------------------------------------------------------- Triton

if triton is not None:

    @triton.jit(do_not_specialize=["num_tokens"])  # one compiled variant for every token count
    def _cos_sin_kernel(
        pos_ptr,  # [T] integer
        inv_freq_ptr,  # [HALF] fp32
        cos_ptr,  # [T, HALF] contiguous
        sin_ptr,  # [T, HALF] contiguous
        num_tokens,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr,  # D / 2, and the next power of two
        BLOCK_T: tl.constexpr,
        PRECISE: tl.constexpr,
    ):  # fmt: skip
        toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
        offs = tl.arange(0, HALF_PAD)
        mask = (toks < num_tokens)[:, None] & (offs < HALF)[None, :]
        pos = tl.load(pos_ptr + toks, mask=toks < num_tokens, other=0).to(tl.float32)  # [BT]
        freqs = pos[:, None] * tl.load(inv_freq_ptr + offs, mask=offs < HALF, other=0.0)[None, :]  # [BT, HP]
        if PRECISE:  # CUDA: cosf / sinf, as torch's kernels
            c, s = libdevice.cos(freqs), libdevice.sin(freqs)
        else:  # interpreter: numpy's (libdevice has no interpreter implementation)
            c, s = tl.cos(freqs), tl.sin(freqs)
        dtype = cos_ptr.dtype.element_ty
        dst = toks.to(tl.int64)[:, None] * HALF + offs[None, :]
        tl.store(cos_ptr + dst, round_to(c, dtype).to(dtype), mask=mask)
        tl.store(sin_ptr + dst, round_to(s, dtype).to(dtype), mask=mask)

    @triton.jit
    def _cos_sin_row(cos_ptr, sin_ptr, t, stride_c, stride_s, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
        """Token t's cos and sin rows [1, HALF_PAD] in fp32 (0 past HALF)."""
        offs_d = tl.arange(0, HALF_PAD)
        c = tl.load(cos_ptr + t * stride_c + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + t * stride_s + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        return c, s

    @triton.jit
    def _rotate_heads_to(
        x_ptr, dst_ptr, t, stride_t, stride_h, dst_stride_h, c, s,
        H: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    ):  # fmt: skip
        """Token t's H heads of x [T, H, 2 * HALF], rotated and rounded in x's dtype -> head h at
        dst_ptr + h * dst_stride_h (contiguous within a head), cast to dst's dtype; c, s [1, HALF_PAD] fp32."""
        offs_h = tl.arange(0, H_PAD)
        offs_d = tl.arange(0, HALF_PAD)
        mask = (offs_h < H)[:, None] & (offs_d < HALF)[None, :]
        src = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]  # [H_PAD, HALF_PAD]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dtype = x_ptr.dtype.element_ty
        o1 = round_to(round_to(x1 * c, dtype) - round_to(x2 * s, dtype), dtype)
        o2 = round_to(round_to(x2 * c, dtype) + round_to(x1 * s, dtype), dtype)
        dst = dst_ptr + offs_h[:, None] * dst_stride_h + offs_d[None, :]
        out_dtype = dst_ptr.dtype.element_ty
        tl.store(dst, o1.to(out_dtype), mask=mask)
        tl.store(dst + HALF, o2.to(out_dtype), mask=mask)

    @triton.jit
    def _rotate_heads(
        x_ptr, out_ptr, t, stride_t, stride_h, c, s,
        H: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    ):  # fmt: skip
        """Token t's H heads of x [T, H, 2 * HALF] -> out (contiguous, x's dtype); c, s [1, HALF_PAD] fp32."""
        _rotate_heads_to(x_ptr, out_ptr + t * (H * 2 * HALF), t, stride_t, stride_h, 2 * HALF, c, s,
                         H, H_PAD, HALF, HALF_PAD)

    @triton.jit
    def _rotary_qk_kernel(
        q_ptr,  # [T, HQ, 2 * HALF] strided tokens / heads
        k_ptr,  # [T, HK, 2 * HALF]
        cos_ptr,  # [T, HALF] rows stride_c apart
        sin_ptr,  # [T, HALF] rows stride_s apart
        q_out_ptr,  # [T, HQ, 2 * HALF] contiguous
        k_out_ptr,  # [T, HK, 2 * HALF] contiguous
        stride_qt, stride_qh,
        stride_kt, stride_kh,
        stride_c,
        stride_s,
        HQ: tl.constexpr, HQ_PAD: tl.constexpr,  # each count with the next power of two
        HK: tl.constexpr, HK_PAD: tl.constexpr,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        c, s = _cos_sin_row(cos_ptr, sin_ptr, t, stride_c, stride_s, HALF, HALF_PAD)
        _rotate_heads(q_ptr, q_out_ptr, t, stride_qt, stride_qh, c, s, HQ, HQ_PAD, HALF, HALF_PAD)
        _rotate_heads(k_ptr, k_out_ptr, t, stride_kt, stride_kh, c, s, HK, HK_PAD, HALF, HALF_PAD)


if triton is not None:

    @triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])  # a layer's row of [L, T]: any alignment
    def _rotary_write_kv_kernel(
        q_ptr,  # [T, HQ, 2 * HALF] strided tokens / heads
        k_ptr,  # [T, HK, 2 * HALF]
        v_ptr,  # [T, HK, 2 * HALF]
        cos_ptr,  # [T, HALF] rows stride_c apart
        sin_ptr,  # [T, HALF] rows stride_s apart
        q_out_ptr,  # [T, HQ, 2 * HALF] contiguous
        kv_ptr,  # [P, 2, BLOCK_SIZE, HK, 2 * HALF]
        slot_mapping_ptr,  # [T] integer; < 0: not written
        stride_qt, stride_qh,
        stride_kt, stride_kh,
        stride_vt, stride_vh,
        stride_c,
        stride_s,
        stride_kv_page, stride_kv_kind, stride_kv_slot, stride_kv_head,
        HQ: tl.constexpr, HQ_PAD: tl.constexpr,
        HK: tl.constexpr, HK_PAD: tl.constexpr,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        c, s = _cos_sin_row(cos_ptr, sin_ptr, t, stride_c, stride_s, HALF, HALF_PAD)
        _rotate_heads(q_ptr, q_out_ptr, t, stride_qt, stride_qh, c, s, HQ, HQ_PAD, HALF, HALF_PAD)
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        if slot >= 0:  # write_kv's slot: page slot // BLOCK_SIZE, offset slot % BLOCK_SIZE
            dst = kv_ptr + (slot // BLOCK_SIZE) * stride_kv_page + (slot % BLOCK_SIZE) * stride_kv_slot
            _rotate_heads_to(k_ptr, dst, t, stride_kt, stride_kh, stride_kv_head, c, s, HK, HK_PAD, HALF, HALF_PAD)
            offs_h = tl.arange(0, HK_PAD)
            offs_v = tl.arange(0, 2 * HALF_PAD)
            mask = (offs_h < HK)[:, None] & (offs_v < 2 * HALF)[None, :]
            v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :], mask=mask)
            tl.store(dst + stride_kv_kind + offs_h[:, None] * stride_kv_head + offs_v[None, :],
                     v.to(kv_ptr.dtype.element_ty), mask=mask)


def cos_sin_triton(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The Triton kernel on any device Triton runs on (CPU tensors under TRITON_INTERPRET=1)."""
    num_tokens, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(num_tokens, half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if num_tokens:
        block_t = 16
        _cos_sin_kernel[(triton.cdiv(num_tokens, block_t),)](
            positions.contiguous(), inv_freq.contiguous(), cos, sin, num_tokens,
            HALF=half, HALF_PAD=next_pow2(half), BLOCK_T=block_t, PRECISE=positions.is_cuda,
            num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return cos, sin


def apply_rotary_qk_triton(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    if k.shape != (num_tokens, num_kv_heads, head_dim) or cos.shape != (num_tokens, half) or sin.shape != cos.shape:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, "
                         f"sin {tuple(sin.shape)}")
    q, k, cos, sin = inner_contiguous(q, k, cos, sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        _rotary_qk_kernel[(num_tokens,)](
            q, k, cos, sin, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            HQ=num_q_heads, HQ_PAD=next_pow2(num_q_heads), HK=num_kv_heads, HK_PAD=next_pow2(num_kv_heads),
            HALF=half, HALF_PAD=next_pow2(half), num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return q_out, k_out


def rotary_write_kv_triton(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor,
                           slot_mapping: Tensor) -> Tensor:
    """The Triton kernel on any device Triton runs on (CPU tensors under TRITON_INTERPRET=1)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape or cos.shape != (num_tokens, half) \
            or sin.shape != cos.shape or kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cos "
                         f"{tuple(cos.shape)}, sin {tuple(sin.shape)}, kv_cache {tuple(kv_cache.shape)}")
    q, k, v, cos, sin = inner_contiguous(q, k, v, cos, sin)
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must have a contiguous head dim, got strides {kv_cache.stride()}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens:
        _rotary_write_kv_kernel[(num_tokens,)](
            q, k, v, cos, sin, q_out, kv_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            HQ=num_q_heads, HQ_PAD=next_pow2(num_q_heads), HK=num_kv_heads, HK_PAD=next_pow2(num_kv_heads),
            HALF=half, HALF_PAD=next_pow2(half), BLOCK_SIZE=kv_cache.shape[2], num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return q_out


# ---------------------------------------------------------------------------------------------- dispatch


def cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of every (position, frequency), each [T, D/2]: one Triton launch on CUDA, the torch
    reference elsewhere."""
    if triton is not None and positions.is_cuda and dtype in _KERNEL_DTYPES:
        return cos_sin_triton(positions, inv_freq, dtype)
    return cos_sin_reference(positions, inv_freq, dtype)


def apply_rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """apply_rotary to q [T, Hq, D] and k [T, Hkv, D]: one Triton launch on CUDA, the torch code elsewhere."""
    kernel_ok = q.dtype in _KERNEL_DTYPES and q.dtype == k.dtype == cos.dtype == sin.dtype
    if triton is not None and q.is_cuda and kernel_ok and q.shape[-1] % 2 == 0:
        return apply_rotary_qk_triton(q, k, cos, sin)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def rotary_write_kv(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor,
                    slot_mapping: Tensor) -> Tensor:
    """q [T, Hq, D] rotated, with k [T, Hkv, D] rotated and v written into their slots of kv_cache
    [P, 2, block, Hkv, D] (slot_mapping [T], < 0: skipped): one Triton launch on CUDA (apply_rotary_qk, then
    write_kv, in one), the torch reference elsewhere."""
    kernel_ok = q.dtype in _KERNEL_DTYPES and q.dtype == k.dtype == v.dtype == cos.dtype == sin.dtype
    if triton is not None and q.is_cuda and kv_cache.is_cuda and kernel_ok and q.shape[-1] % 2 == 0:
        return rotary_write_kv_triton(q, k, v, cos, sin, kv_cache, slot_mapping)
    if q.is_cuda:  # dtypes the kernel does not take: the two launches
        q, k = apply_rotary_qk(q, k, cos, sin)
        write_kv(k, v, kv_cache, slot_mapping)
        return q
    return rotary_write_kv_reference(q, k, v, cos, sin, kv_cache, slot_mapping)
