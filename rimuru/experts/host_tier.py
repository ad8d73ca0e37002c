"""The host tier of the offload provider: routed experts the step computes on the host instead of copying.

Per MoE layer whose routing the provider read (offload_provider.py):

    provider.table(l, ids)        choose(): of the routed experts neither resident nor prefetched, those the host
                                  computes (expert_tiers.py); they are not loaded, their table rows stay -1
    provider.host_experts(...)    start(): the routing of those experts and their tokens' hidden rows go
                                  device -> host                                            -> HostExpertJob
    fused_moe(..., skip_absent)   the GPU's kernel over the resident (and copied) experts is queued; the -1 rows
                                  contribute zeros
    job.join(out)                 the host computes its experts (the GPU runs the kernel meanwhile), the result
                                  goes host -> device and is added to the kernel's output

On a GPU (the one place with device-specific code, `_GpuTransfer`; tested on a GPU only, tests marked `gpu`):

    compute stream:  router -> [ids, weights D2H] ... [rows H2D, gather, hidden D2H] -> fused_moe -> [result H2D]
                     -> index_add                                              (all queued in this order)
    host:            sync(ids)  --------------------- sync(hidden) -> host matmuls -> queue H2D -> go on
                                                                     ^ overlaps the GPU's fused_moe

Staging tensors come from torch's caching pinned allocator, which keeps a block until the copies queued from it
are done, so no buffer is rewritten under a copy in flight. On the CPU device every tensor is a host tensor already
and the host part is exact: the same matmuls as the kernel's reference, added to its output.

The CUDA graphs of an offloading mode cut the pass at each layer's table decision (engine/piecewise_graphs.py), and
with a host tier also right after each layer's MoE kernel: the replay starts the job at the decision and joins it
(`join_into`, into the kernel's static output) at that second cut, so the tier runs in graph replays as in eager
passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from rimuru.experts.expert_tiers import TierCosts, choose_host_experts
from rimuru.experts.host_compute import HostAssignments, HostExpertCompute
from rimuru.experts.host_profile import HostProfile


@dataclass
class HostTierCounters:
    layers: int = 0  # MoE layer calls with host work
    experts: int = 0  # (layer, expert) computations on the host = experts not copied
    tokens: int = 0  # expert-token assignments computed on the host
    bytes_not_copied: int = 0  # expert bytes those computations kept off PCIe
    compute_s: float = 0.0  # host seconds in start() and join(): transfers, syncs, matmuls


class HostExpertJob:
    """One layer's host work, started; `join` adds it to the kernel's output."""

    def __init__(self, tier: HostExpertTier, layer: int, rows: Tensor, work: HostAssignments, hidden: Tensor,
                 transfer: _GpuTransfer | None) -> None:
        self.tier = tier
        self.layer = layer
        self.rows = rows  # [m] int64 host: batch rows of the tokens the host computes for
        self.work = work  # rows index the m gathered tokens
        self.hidden = hidden  # [m, d] host (on a GPU: pinned, filled by the copy `transfer` waits for)
        self.transfer = transfer

    def join(self, out: Tensor) -> Tensor:
        """`out` [T, d] (the kernel's output on the device) plus the host-computed experts' outputs."""
        return self._add(out, in_place=False)

    def join_into(self, out: Tensor) -> None:
        """The same, added into `out` itself (a CUDA graph's static output, which the next piece reads)."""
        self._add(out, in_place=True)

    def _add(self, out: Tensor, in_place: bool) -> Tensor:
        t0 = time.perf_counter()
        if self.transfer is not None:
            self.transfer.wait_hidden()
        part = self.tier.compute.compute(self.layer, self.hidden, self.work)  # [m, d] float32
        if self.transfer is not None:
            result = self.transfer.add_to(out, part, in_place)
        elif in_place:
            result = out.index_add_(0, self.rows, part.to(out.dtype))
        else:
            result = out.index_add(0, self.rows, part.to(out.dtype))
        self.tier.counters.compute_s += time.perf_counter() - t0
        return result


class HostExpertTier:
    def __init__(self, compute: HostExpertCompute, costs: TierCosts, mode: str,
                 profile: HostProfile | None = None) -> None:
        """`mode`: on (every candidate on the host) | auto (the cost rule); `profile`: what start-up measured."""
        if mode not in ("on", "auto"):
            raise ValueError(f"the host tier runs in mode on or auto, got {mode!r}")
        self.compute = compute
        self.costs = costs
        self.mode = mode
        self.profile = profile
        self.counters = HostTierCounters()

    def choose(self, candidates: list[int], routed_tokens: Tensor | dict[int, int]) -> list[int]:
        """Of `candidates` (routed, not resident, not prefetched), the experts the host computes; `routed_tokens`:
        tokens routed to each expert of the layer ([E] host tensor, or expert -> tokens)."""
        pairs = [(e, int(routed_tokens[e])) for e in candidates]
        return choose_host_experts(pairs, self.costs, self.mode)

    def start(self, layer: int, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              experts: list[int]) -> HostExpertJob:
        """Sends the routed rows of `experts` to the host (hidden [T, d], routing [T, k], on the model's device)."""
        t0 = time.perf_counter()
        transfer = _GpuTransfer(hidden.device) if hidden.is_cuda else None
        if transfer is not None:
            ids, weights = transfer.routing_to_host(topk_ids, topk_weights)
        else:
            ids, weights = topk_ids, topk_weights
        picked = HostAssignments.select(ids, weights, torch.tensor(experts, dtype=torch.int64))
        rows, local = torch.unique(picked.rows, return_inverse=True)  # [m] batch rows, [n] -> index into rows
        work = HostAssignments(rows=local, experts=picked.experts, weights=picked.weights)
        gathered = transfer.rows_to_host(hidden, rows) if transfer is not None else hidden[rows]
        c = self.counters
        c.layers += 1
        c.experts += len(experts)
        c.tokens += work.num_assignments
        c.bytes_not_copied += len(experts) * self.compute.store.expert_bytes
        c.compute_s += time.perf_counter() - t0
        return HostExpertJob(self, layer, rows, work, gathered, transfer)

    def stats(self) -> dict[str, float]:
        c = self.counters
        return {"cpu_expert_tokens": c.tokens, "cpu_experts_computed": c.experts,
                "cpu_expert_bytes_not_copied": c.bytes_not_copied, "cpu_expert_compute_s": c.compute_s}


def no_tier_stats() -> dict[str, float]:
    """The host tier's counters where an offloading mode runs without it."""
    return {"cpu_expert_tokens": 0, "cpu_experts_computed": 0, "cpu_expert_bytes_not_copied": 0,
            "cpu_expert_compute_s": 0.0}


# ---------------------------------------------------------------------------------------------------------------
# GPU only (needs CUDA; exercised by the tests marked `gpu`): the transfers of one layer's host work, queued on the
# current (compute) stream so that they are ordered with the router before them and the kernel after them.


class _GpuTransfer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.current_stream(device)
        self._hidden_ready: torch.cuda.Event | None = None
        self._rows_dev: Tensor | None = None

    def routing_to_host(self, topk_ids: Tensor, topk_weights: Tensor) -> tuple[Tensor, Tensor]:
        """The layer's routing [T, k] on the host: a small copy and one sync (the router has run by then)."""
        ids = torch.empty(topk_ids.shape, dtype=topk_ids.dtype, pin_memory=True)
        weights = torch.empty(topk_weights.shape, dtype=topk_weights.dtype, pin_memory=True)
        ids.copy_(topk_ids, non_blocking=True)
        weights.copy_(topk_weights, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.stream)
        done.synchronize()
        return ids, weights

    def rows_to_host(self, hidden: Tensor, rows: Tensor) -> Tensor:
        """Queues the gather of `rows` [m] of hidden [T, d] and its copy into pinned host memory; the returned
        tensor is valid after wait_hidden()."""
        rows_pinned = rows.pin_memory()
        self._rows_dev = rows_pinned.to(self.device, non_blocking=True)  # [m]
        staged = torch.empty((rows.shape[0], hidden.shape[1]), dtype=hidden.dtype, pin_memory=True)  # [m, d]
        staged.copy_(hidden.index_select(0, self._rows_dev), non_blocking=True)
        self._hidden_ready = torch.cuda.Event()
        self._hidden_ready.record(self.stream)
        return staged

    def wait_hidden(self) -> None:
        """The host waits for the hidden rows only; the kernel queued after their copy keeps running."""
        assert self._hidden_ready is not None
        self._hidden_ready.synchronize()

    def add_to(self, out: Tensor, part: Tensor, in_place: bool = False) -> Tensor:
        """out [T, d] + the host part [m, d] at the gathered rows (into `out` itself when `in_place`), queued after
        the kernel that wrote `out`."""
        assert self._rows_dev is not None
        staged = part.to(out.dtype).pin_memory()  # [m, d], kept by the caching allocator until the copy is done
        on_device = staged.to(self.device, non_blocking=True)
        if in_place:
            return out.index_add_(0, self._rows_dev, on_device)
        return out.index_add(0, self._rows_dev, on_device)


def measure_layer_fixed_s(device: torch.device, hidden_size: int, dtype: torch.dtype, tokens: int = 16,
                          reps: int = 5) -> float:
    """What one layer's host work costs beyond its matmuls on this GPU: the routing and `tokens` hidden rows
    device -> host with their two syncs and the result host -> device, best of `reps` (0 on the CPU)."""
    if device.type != "cuda":
        return 0.0
    hidden = torch.zeros(tokens, hidden_size, dtype=dtype, device=device)
    ids = torch.zeros(tokens, 8, dtype=torch.int64, device=device)
    weights = torch.zeros(tokens, 8, dtype=torch.float32, device=device)
    rows = torch.arange(tokens)
    best = float("inf")
    for _ in range(reps + 1):  # the first one warms the pinned allocator up
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        transfer = _GpuTransfer(device)
        transfer.routing_to_host(ids, weights)
        staged = transfer.rows_to_host(hidden, rows)
        transfer.wait_hidden()
        transfer.add_to(hidden, staged.float())
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best
