"""Routed experts computed on the host, from their home copy in the host store, with PyTorch's CPU matmul.

A cold expert that a step routes a handful of tokens to costs a PCIe copy of its weights (9.4 MB for a
Qwen3-30B-A3B expert in bf16) when the GPU computes it, and only a read of those weights from host memory plus a
few KB of activations each way when the host does. This module is the host half: given one MoE layer's
assignments (token row, expert, router weight) and the tokens' hidden states on the host, it returns each token's
weighted sum over its host-computed experts:

    out[t] = sum over assignments (t, e, w) of  w * W2_e (SiLU(W1_e h_t) * W3_e h_t)        [T_host, d] float32

Weights are read in place from the store (`layers[l][e]` = [3, f*d]: W1 and W3 are adjacent rows, so
`[2, f*d] -> [2f, d]` is one gate/up GEMM over a view, or a matrix-vector product for one token; no copy); the
matmuls run in the store's dtype, where oneDNN uses AVX-512 BF16 / AMX when the CPU has them (host_profile.py
reports which); the combine accumulates in float32, as the paged kernel's reference does.

Threads: a call's experts are spread over the host's T intra-op threads (`torch.get_num_threads()` when the
compute is made; the engine sets it from `--cpu-expert-threads`): w = min(m, T) workers for m experts, each with
T // w threads (the first T % w one more), the experts dealt to them by tokens, largest first, each to the least
loaded. One expert's GEMV split over all T threads reaches a fraction of the host's read bandwidth (a fifth on a
16-core host); several experts at once, a few threads each, read in parallel. Each worker sums its experts into a
float32 buffer of its own; the buffers are added in worker order, so a call's result does not depend on timing.
With one expert (or T = 1) the call runs on the calling thread, as a single GEMV over every thread. Whether the
spread pays is the host's to say: on the 16-core host of the H100 machine two to sixteen experts in one spread call
took 1.25-1.6x their time one after another (host_profile.measure_spread), so a compute made with `spread=False`
runs every call's experts one after another, each over every thread.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional

from rimuru.experts.host_store import HostExpertStore


@dataclass(frozen=True)
class HostAssignments:
    """The assignments of one MoE layer that the host computes, in host tensors (`rows` index the hidden states
    handed with them)."""

    rows: Tensor  # [n] int64: the token's row
    experts: Tensor  # [n] int64: the expert
    weights: Tensor  # [n] float32: its router weight

    def __post_init__(self) -> None:
        n = self.rows.shape[0]
        if self.rows.dim() != 1 or self.experts.shape != (n,) or self.weights.shape != (n,):
            raise ValueError(f"host assignments need rows, experts and weights of one shape [n], got "
                             f"{tuple(self.rows.shape)}, {tuple(self.experts.shape)}, {tuple(self.weights.shape)}")

    @classmethod
    def select(cls, topk_ids: Tensor, topk_weights: Tensor, experts: Tensor) -> HostAssignments:
        """The assignments of routing ids [T, k] / weights [T, k] (host tensors) whose expert is in `experts` [m];
        `rows` are token rows of the routed batch."""
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1).long()  # [T*k]
        picked = torch.nonzero(torch.isin(flat, experts.long())).flatten()  # [n] assignment ids
        return cls(rows=picked // k, experts=flat[picked], weights=topk_weights.reshape(-1)[picked].float())

    @property
    def num_assignments(self) -> int:
        return int(self.rows.shape[0])


class HostExpertCompute:
    def __init__(self, store: HostExpertStore, threads: int | None = None, spread: bool = True) -> None:
        """`threads`: the host threads a call spreads its experts over (default: torch's intra-op threads now);
        `spread`: False computes a call's experts one after another, each over every thread."""
        self.store = store
        self.f, self.d = store.f, store.d
        self.threads = threads if threads is not None else torch.get_num_threads()
        if self.threads < 1:
            raise ValueError(f"host expert compute needs at least one thread, got {self.threads}")
        self.spread = spread
        self._pool: ThreadPoolExecutor | None = None  # made at the first call with several experts

    def worker_threads(self, experts: int) -> list[int]:
        """Threads of each worker of a call with `experts` experts: min(experts, T) workers sharing the T threads
        (one worker of T when the compute does not spread)."""
        w = max(1, min(experts, self.threads)) if self.spread else 1
        base, extra = divmod(self.threads, w)
        return [base + (i < extra) for i in range(w)]

    def expert_output(self, layer: int, expert: int, hidden: Tensor) -> Tensor:
        """One expert on hidden rows [n, d] (store dtype): W2 (SiLU(W1 h) * W3 h), [n, d] in the store dtype."""
        f, d = self.f, self.d
        w = self.store.expert(layer, expert)  # [3, f*d]
        if hidden.shape[0] == 1:  # one token (most of a decode step's host experts): matrix-vector products, which
            # read the weights faster than one-row GEMMs do (benchmarks/bench_host_experts.py)
            gate_up_1 = torch.mv(w[:2].view(2 * f, d), hidden[0])  # [2f]
            return torch.mv(w[2].view(d, f), functional.silu(gate_up_1[:f]) * gate_up_1[f:])[None]  # [1, d]
        gate_up = hidden @ w[:2].view(2 * f, d).T  # [n, 2f]: W1 rows, then W3 rows
        act = functional.silu(gate_up[:, :f]) * gate_up[:, f:]  # [n, f]
        return act @ w[2].view(d, f).T  # [n, d]

    def compute(self, layer: int, hidden: Tensor, assignments: HostAssignments) -> Tensor:
        """The weighted expert outputs [T_host, d] float32 of `assignments` over host hidden states [T_host, d]."""
        if hidden.dim() != 2 or hidden.shape[1] != self.d:
            raise ValueError(f"hidden states must be [T, d = {self.d}], got {tuple(hidden.shape)}")
        if hidden.device.type != "cpu":
            raise ValueError(f"host expert compute reads host hidden states, got a tensor on {hidden.device}")
        T = hidden.shape[0]
        out = torch.zeros(T, self.d, dtype=torch.float32)  # [T_host, d]
        n = assignments.num_assignments
        if n == 0:
            return out
        rows, experts, weights = assignments.rows, assignments.experts, assignments.weights
        if int(rows.min()) < 0 or int(rows.max()) >= T:
            raise ValueError(f"host assignment rows must be in [0, {T}), got [{int(rows.min())}, {int(rows.max())}]")
        E = self.store.num_experts
        if int(experts.min()) < 0 or int(experts.max()) >= E:
            raise ValueError(f"host assignment experts must be in [0, {E}), got "
                             f"[{int(experts.min())}, {int(experts.max())}]")
        h = hidden if hidden.dtype == self.store.dtype else hidden.to(self.store.dtype)
        # group the assignments by expert: one sort, then each expert's rows are one contiguous run
        order = torch.argsort(experts, stable=True)  # [n]
        ids, counts = torch.unique_consecutive(experts[order], return_counts=True)
        runs, start = [], 0
        for e, c in zip(ids.tolist(), counts.tolist(), strict=True):
            runs.append((e, order[start : start + c]))  # [n_e] assignment positions of expert e
            start += c
        threads = self.worker_threads(len(runs))
        if len(threads) == 1:
            self._accumulate(layer, h, rows, weights, runs, out)
            return out
        # deal the experts to the workers: largest first, each to the least loaded (ties: the lower worker)
        shares: list[list[tuple[int, Tensor]]] = [[] for _ in threads]
        load = [0] * len(threads)
        for run in sorted(runs, key=lambda r: (-r[1].numel(), r[0])):
            i = min(range(len(threads)), key=lambda j: (load[j], j))
            shares[i].append(run)
            load[i] += run[1].numel()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="host-experts")
        caller = torch.get_num_threads()
        futures = [self._pool.submit(self._worker, layer, h, rows, weights, share, t, T)
                   for share, t in zip(shares, threads, strict=True)]
        wait(futures)  # every worker done before the next call, and no error lost behind the first
        # a worker's set_num_threads also sets the count a thread starts with that first runs torch later (e.g. a
        # server's engine thread): give that back the caller's
        torch.set_num_threads(caller)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]
        for f in futures:  # in worker order: the sum's order is fixed
            out += f.result()
        return out

    def _worker(self, layer: int, h: Tensor, rows: Tensor, weights: Tensor, runs: list[tuple[int, Tensor]],
                threads: int, T: int) -> Tensor:
        torch.set_num_threads(threads)  # this thread's intra-op threads (and, see compute, new threads' default)
        part = torch.zeros(T, self.d, dtype=torch.float32)
        self._accumulate(layer, h, rows, weights, runs, part)
        return part

    def _accumulate(self, layer: int, h: Tensor, rows: Tensor, weights: Tensor, runs: list[tuple[int, Tensor]],
                    out: Tensor) -> None:
        with torch.no_grad():
            for e, run in runs:
                r = rows[run]  # [n_e]
                y = self.expert_output(layer, e, h[r])  # [n_e, d]
                out.index_add_(0, r, y.float() * weights[run, None])
