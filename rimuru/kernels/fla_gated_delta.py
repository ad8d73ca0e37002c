"""The chunk form of the gated delta rule on the GPU through flash-linear-attention (fla-core), when installed.

fla's `chunk_gated_delta_rule` runs a varlen batch packed as one sequence of T tokens (`cu_seqlens`), with one
initial state per sequence in and the final states out:

    q, k   [1, T, H, dk]  model dtype (bf16 / fp16), raw: l2-normalised inside the kernel (use_qk_l2norm_in_kernel)
    v      [1, T, H, dv]  model dtype
    g      [1, T, H]      fp32, log decay (<= 0)
    beta   [1, T, H]      model dtype
    state  [N, H, dk, dv] fp32 in and out: the same layout as our ssm pages (models/gated_deltanet.py)

It replaces the torch chunk loop of GatedDeltaNet.forward (one Python step per 64-token chunk and layer, ~4
launches each) for prefill on a GPU. It is used only where it applies: a CUDA tensor in bf16 or fp16 (fla's kernels
refuse fp32) and fla importable. fla is never imported on the CPU (its presence also makes transformers swap in
GPU-only kernels there). Without it the torch form runs, and the engine says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache

import torch
from torch import Tensor

logger = logging.getLogger("rimuru")


@cache
def _fla_chunk() -> Callable[..., tuple[Tensor, Tensor]] | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        logger.warning("flash-linear-attention (fla-core) is not installed: gated DeltaNet prefill runs the torch "
                       "chunk form on the GPU, one Python step per 64-token chunk and layer (pip install fla-core)")
        return None
    return chunk_gated_delta_rule


# Triton specialises a kernel's pointer arguments on 16-byte alignment: each pattern is a variant of its own, built
# at its first launch. A prefill's rows follow the step's decode rows (models/state_cache.py), so a slice such as
# beta [T, Hv] (model dtype), which fla hands its kernels as it is, starts d * Hv * 2 bytes into the step's tensor:
# with few value heads per rank (Hv * 2 not a multiple of 16) an odd decode count d meets a variant that start-up
# never built, and that step waits for a compile. Aligned, contiguous inputs make one variant serve every step.
ALIGNMENT_BYTES = 16


def _aligned(t: Tensor) -> Tensor:
    """t itself when contiguous and 16-byte aligned, else a contiguous copy (fresh allocations are aligned)."""
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def fla_chunk_applies(x: Tensor) -> bool:
    """Whether the prefill of hidden states `x` takes fla's kernel: CUDA, bf16 or fp16, fla importable."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _fla_chunk() is not None


def fla_chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                               cu_seqlens: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Packed varlen prefill. q, k [T, H, dk] raw (normalised in the kernel), v [T, H, dv], beta [T, H] in the model
    dtype; g [T, H] fp32; state [N, H, dk, dv] fp32 (each sequence's initial state, zeros for a fresh one);
    cu_seqlens [N+1], or None for one sequence of all T rows (fla's fixed-length path: no chunk indices derived on
    the host, so a CUDA graph can hold it). Returns o [T, H, dv] in the model dtype and the final states [N, H, dk,
    dv] fp32."""
    chunk = _fla_chunk()
    if chunk is None:
        raise RuntimeError("fla_chunk_gated_delta_rule needs fla-core (check fla_chunk_applies first)")
    q, k, v, g, beta = (_aligned(t) for t in (q, k, v, g.float(), beta))
    o, final = chunk(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                     initial_state=state.float().contiguous(), output_final_state=True,
                     cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(), use_qk_l2norm_in_kernel=True)
    return o[0], final.float()
