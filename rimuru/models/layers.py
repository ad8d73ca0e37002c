"""Small layers every architecture shares: RMSNorm, merged projections and the SiLU-gated MLP.

On CUDA tensors their elementwise work is one Triton launch each (rimuru/kernels/rmsnorm.py,
activation.py), with the same numerics as the torch code the CPU runs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rimuru.distributed.parallel_state import SINGLE, TensorParallel
from rimuru.kernels.activation import silu_and_mul
from rimuru.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from rimuru.models.parallel_linear import RowParallelLinear, Shard, rank_shard


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back before the weight (as HF does).

    zero_centred=True is the Qwen3.5 / Qwen3-Next form x / rms(x) * (1 + weight), all in fp32 and cast
    once at the end (weights stored around 0, initialised to 0). Both forms are one Triton launch on CUDA
    (kernels/rmsnorm.py) and the torch reference elsewhere.
    """

    def __init__(self, size: int, eps: float, zero_centred: bool = False) -> None:
        super().__init__()
        self.zero_centred = zero_centred
        self.weight = nn.Parameter(torch.zeros(size) if zero_centred else torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., size]
        return rms_norm(x, self.weight, self.eps, self.zero_centred)

    def add_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:  # [..., size] each
        """(norm(x + residual), x + residual): the residual add before a norm, fused into it."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.zero_centred)


class MergedLinear(nn.Linear):
    """Several projections of the same input as ONE GEMM (vLLM's packed QKV and gate/up layers).

    weight [sum(sizes), in]: the shards' weights stacked row-wise in `shards` order (bias likewise).
    Checkpoints keep one tensor per shard, named as the shard: the loader copies
    `<parent>.q_proj.weight` into rows [0, Hq*D) of `<parent>.qkv_proj.weight` (models/loader.py).
    `split(y)` returns the shards' outputs as views of the one output [T, sum(sizes)].

    Column-parallel (tensor parallelism): `sizes` are this rank's rows and `cuts[name]` says which rows of the
    checkpoint's shard they are (models/parallel_linear.py); a shard without a cut is whole on every rank.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool,
                 cuts: dict[str, Shard | None] | None = None) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_sizes = list(shards.values())
        offsets = [sum(self.shard_sizes[:i]) for i in range(len(shards))]
        self.shards = {name: (off, size) for (name, size), off in zip(shards.items(), offsets, strict=True)}
        self.cuts: dict[str, Shard | None] = {name: (cuts or {}).get(name) for name in shards}

    def split(self, y: Tensor) -> tuple[Tensor, ...]:
        return y.split(self.shard_sizes, dim=-1)

    def full_rows(self, name: str) -> int:
        """Rows of shard `name` in the checkpoint (all ranks' together)."""
        cut, rows = self.cuts[name], self.shards[name][1]
        return rows if cut is None else rows * cut.chunks

    def local_of_full(self, full: Tensor) -> Tensor:
        """This rank's rows of a full merged tensor [sum(full rows), ...] (dummy weights draw the full one)."""
        parts = full.split([self.full_rows(name) for name in self.shards], dim=0)
        return torch.cat([p if cut is None else cut.take(p) for p, cut in zip(parts, self.cuts.values(),
                                                                             strict=True)])


class GatedMLP(nn.Module):
    """down(SiLU(gate(x)) * up(x)): dense layers and the shared expert; gate and up are one GEMM.

    Tensor-parallel: gate/up column-parallel, down row-parallel; `reduce=False` leaves the partial sum to the
    caller (the shared expert, summed with the routed experts' part in one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE,
                 reduce: bool = True) -> None:
        super().__init__()
        f = tp.part(intermediate_size, "intermediate_size")
        cut = rank_shard(tp, 0)
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": f, "up_proj": f}, bias=False,
                                         cuts={"gate_proj": cut, "up_proj": cut})
        self.down_proj = RowParallelLinear(f, hidden_size, bias=False, tp=tp, reduce=reduce)

    def forward(self, x: Tensor) -> Tensor:  # [T, d]
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))  # [T, f] views each
        return self.down_proj(silu_and_mul(gate, up))  # [T, d]
