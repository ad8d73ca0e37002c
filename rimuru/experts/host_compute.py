"""Routed experts computed on the host, from their home copy in the host store, with PyTorch's CPU matmul.

A cold expert that a step routes a handful of tokens to costs a PCIe copy of its weights (9.4 MB for a
Qwen3-30B-A3B expert in bf16) when the GPU computes it, and only a read of those weights from host memory plus a
few KB of activations each way when the host does. This module is the host half: given one MoE layer's
assignments (token row, expert, router weight) and the tokens' hidden states on the host, it returns each token's
weighted sum over its host-computed experts:

    out[t] = sum over assignments (t, e, w) of  w * W2_e (SiLU(W1_e h_t) * W3_e h_t)        [T_host, d] float32

Weights are read in place from the store (`layers[l][e]` = [3, f*d]: W1 and W3 are adjacent rows, so
`[2, f*d] -> [2f, d]` is one gate/up GEMM over a view, no copy); the matmuls run in the store's dtype, where
oneDNN uses AVX-512 BF16 / AMX when the CPU has them (host_profile.py reports which); the combine accumulates in
float32, as the paged kernel's reference does. Each expert's matmuls are split over the intra-op threads
(`torch.set_num_threads`, set once by the engine from `--cpu-expert-threads`), so a GEMV streams its weights
through every core's share of the memory bandwidth.
"""

from __future__ import annotations

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
    def __init__(self, store: HostExpertStore) -> None:
        self.store = store
        self.f, self.d = store.f, store.d

    def expert_output(self, layer: int, expert: int, hidden: Tensor) -> Tensor:
        """One expert on hidden rows [n, d] (store dtype): W2 (SiLU(W1 h) * W3 h), [n, d] in the store dtype."""
        f, d = self.f, self.d
        w = self.store.expert(layer, expert)  # [3, f*d]
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
        start = 0
        with torch.no_grad():
            for e, c in zip(ids.tolist(), counts.tolist(), strict=True):
                run = order[start : start + c]  # [n_e] assignment positions
                start += c
                r = rows[run]  # [n_e]
                y = self.expert_output(layer, e, h[r])  # [n_e, d]
                out.index_add_(0, r, y.float() * weights[run, None])
        return out
