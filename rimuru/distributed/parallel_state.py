"""One rank's view of its tensor-parallel group: rank, size and the collectives the sharded layers need.

A `TensorParallel` is made once per process and handed to the model and the engine (no module-level state):

    device group  all_reduce / all_gather of activations   NCCL between GPUs, gloo on the CPU
    cpu group     the step plans rank 0 sends (pickled)    always gloo, so control never queues behind GPU work

With size 1 (`SINGLE`) every collective returns its input untouched and nothing is initialised, so a model built
without tensor parallelism runs exactly the code it ran before.

With `expert_parallel` (vLLM's `--enable-expert-parallel`) the same group holds the routed experts whole instead of
cut along their intermediate dimension: rank r of N holds experts [r E/N, (r+1) E/N) of every MoE layer
(`local_experts`), every rank routes every token, and a token's experts on other ranks contribute zeros to this
rank's partial sum, which the MoE's one all-reduce completes as under tensor parallelism. Attention, dense and
shared-expert MLPs stay tensor-parallel.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# How long a collective waits for a peer that is alive but silent (a dead peer fails at once: its sockets close).
# Start-up sits between collectives while a rank loads its shard, so this is minutes, not seconds.
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # device collectives (None: the default group)
    cpu_group: Any = None  # control messages (gloo)
    expert_parallel: bool = False  # routed experts whole, E/N of them per rank (see the module's note)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size} is not a rank of the group")

    @property
    def is_driver(self) -> bool:
        """Rank 0: the process that schedules, decides and samples."""
        return self.rank == 0

    def part(self, n: int, what: str) -> int:
        """This rank's share of `n` (heads, columns, vocabulary rows), which must divide evenly."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={self.size}")
        return n // self.size

    def expert_part(self, intermediate_size: int) -> int:
        """The intermediate size of this rank's routed-expert pages: whole under expert parallelism, f/N else."""
        return intermediate_size if self.expert_parallel else self.part(intermediate_size, "moe_intermediate_size")

    def local_experts(self, num_experts: int) -> range:
        """The routed experts of each MoE layer this rank holds: all of them (their slices) under tensor
        parallelism, a contiguous E/N of them under expert parallelism."""
        if not self.expert_parallel:
            return range(num_experts)
        n = self.part(num_experts, "num_experts")
        return range(self.rank * n, (self.rank + 1) * n)

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum over ranks, in place (every rank gets the same bits)."""
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: Tensor, dim: int = -1) -> Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: Tensor) -> Tensor:
        """Rank 0's `x` into every rank's `x`, in place, over the device group (stream-ordered on a GPU)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled over the cpu group); other ranks pass nothing."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` in rank order on rank 0 (pickled over the cpu group); None on the other ranks."""
        if self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    def min_int(self, n: int) -> int:
        """The smallest of every rank's `n` (a pool every rank can hold)."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


SINGLE = TensorParallel()


def free_port() -> int:
    """A TCP port on this host no one listens on now (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_tensor_parallel(rank: int, size: int, port: int, device: torch.device,
                         timeout_s: float = DEFAULT_TIMEOUT_S, expert_parallel: bool = False) -> TensorParallel:
    """Joins the group of `size` ranks meeting at 127.0.0.1:`port` (one host). NCCL where the device is a GPU,
    gloo on the CPU; the control group is gloo either way."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one tensor-parallel engine "
                           "per process (shut the other down first)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return TensorParallel(rank=rank, size=size, group=None, cpu_group=cpu_group, expert_parallel=expert_parallel)


def destroy_tensor_parallel(tp: TensorParallel) -> None:
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
