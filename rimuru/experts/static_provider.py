"""The expert provider whose tables the kernel reads as they are: every routed expert resident at fixed pages, or
(with `host_rows`) some named by rows of the pinned host store, which the MoE kernel reads over PCIe. The tables
never change during a pass, so no decision reaches the host and the whole forward pass can be one CUDA graph."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from rimuru.experts.routing_counter import RoutingCounter


class StaticExpertProvider:
    def __init__(self, expert_view: Tensor, tables: Tensor, counter: RoutingCounter | None = None,
                 host_rows: Sequence[Tensor] | None = None) -> None:
        if tables.dim() != 3 or tables.shape[2] != 3:
            raise ValueError(f"expert tables must be [L_moe, E, 3], got {tuple(tables.shape)}")
        self.expert_view = expert_view  # [n_mid, f*d]
        self.tables = tables  # [L_moe, E, 3] int32, updated in place by the expert cache
        self.counter = counter  # when set, every routing decision is counted (on the device)
        self._host_rows = host_rows  # per MoE layer [3E, f*d], pinned: what table entries <= -2 name

    def before_layer(self, moe_layer: int, hidden: Tensor) -> None:
        return None

    def host_rows(self, moe_layer: int) -> Tensor | None:
        return None if self._host_rows is None else self._host_rows[moe_layer]

    def table(self, moe_layer: int, topk_ids: Tensor) -> Tensor:
        if self.counter is not None:
            self.counter.record(moe_layer, topk_ids)
        return self.tables[moe_layer]  # [E, 3]

    def host_experts(self, moe_layer: int, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> None:
        return None  # every routed expert is in the table
