"""ExpertProvider: how a MoE layer finds its routed experts' weights in the page pool.

The model never owns routed-expert weights. Before a MoE layer computes, it hands its routing
decision to the provider, which makes every routed expert addressable (a resident page, or a load
buffer it fills now) and returns the layer's expert table:

    expert_view   [n_mid, f*d]     the pool seen as expert pages
    table[e]      (p_W1, p_W3, p_W2) page ids into expert_view; -1 = not addressable; <= -2: rows of the layer's
                  host rows (kernels/fused_moe.py), where the provider reads offloaded experts in host memory

W1/W3 pages hold [f, d] row-major, W2 pages hold [d, f] (docs/architecture.md). The implementations live in
experts/ (static_provider.py, offload_provider.py); the model only knows this protocol.

An offloading provider may leave some routed experts out of the table (rows -1) for the host to compute
(experts/host_tier.py): right after `table`, `host_experts` starts that work and returns a `HostPart`, the layer
queues its kernel (whose -1 rows contribute zeros) and then joins the host part with the kernel's output.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class HostPart(Protocol):
    def join(self, out: Tensor) -> Tensor:
        """The kernel's output [T, d] plus the host-computed experts' weighted outputs."""
        ...


class ExpertProvider(Protocol):
    expert_view: Tensor  # [n_mid, f*d]

    def table(self, moe_layer: int, topk_ids: Tensor) -> Tensor:
        """Expert table [E, 3] int32 of MoE layer `moe_layer` (its ordinal among MoE layers), valid
        for every expert id in `topk_ids` [T, k]."""
        ...

    def host_rows(self, moe_layer: int) -> Tensor | None:
        """The pinned host copy [3E, f*d] of MoE layer `moe_layer`'s experts that table entries <= -2 name (None:
        every routed expert is in pages)."""
        ...

    def before_layer(self, moe_layer: int, hidden: Tensor) -> None:
        """Called with the input hidden states [T, d] of the decoder layer that holds MoE layer
        `moe_layer`, before its attention runs: a chance to start prefetching."""
        ...

    def host_experts(self, moe_layer: int, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> HostPart | None:
        """After `table(moe_layer, topk_ids)`: the host work for the routed experts that table left out (None: it
        left none out). `hidden` [T, d] is the MoE layer's input, `topk_weights` / `topk_ids` [T, k] its routing."""
        ...
