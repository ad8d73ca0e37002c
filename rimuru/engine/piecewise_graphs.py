"""Piecewise CUDA graphs for offloading modes: a forward pass captured as one graph per stretch between
two MoE expert-table decisions, with the host decision replayed eagerly in between.

An offloading provider (fixed / elastic with experts in host memory) must see a MoE layer's real routing
before that layer's kernel runs: it reads which experts were routed (one device->host read), copies the
missing ones into a load buffer and hands the kernel a table. That decision cannot live inside a graph,
so the forward pass is cut at every `provider.table(l, ids)` call:

    piece 0:  embed, layer 0 (norms, attention, router)                  -> ids_0 (a static tensor)
    boundary 0 (host):  table_0 = provider.table(0, ids_0); active[0] <- table_0
    piece 1:  layer 0's MoE (reads active[0]), layer 1 (norms, attention, router) -> ids_1
    ...
    piece L:  layer L-1's MoE, final norm, logits

The captured MoE kernels read `active` [L_moe, E, 3], a static copy of whatever table the provider
returned (its resident tables or a load buffer's table), refreshed by one small device copy per layer.
A boundary needs the host read only when its layer has experts in host memory; when every expert of a
layer is resident the boundary queues the copy and the routing count and goes on without waiting, so a
step with everything resident costs L+1 graph launches and no synchronisation.

Capture: while capturing, this object stands in for the provider of every MoE module. `before_layer`
runs the predictor (device work, captured into the piece); `table` ends the current piece's capture and
begins the next one. Graph pieces share one memory pool and are always replayed in capture order, which
is what makes the tensors handed from one piece to the next (hidden states, routing ids, predictions)
safe in that pool.

Padding rows (a padded batch) route too: `row_mask` ([T] bool, computed inside piece 0 from the slot
mapping) keeps them out of the provider's load decisions and out of the routing counts. An expert routed
only by padding rows may stay in host memory; the kernel skips it (table row -1) and writes zeros there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rimuru.experts.offload_provider import OffloadExpertProvider
from rimuru.models.causal_lm import MoECausalLM


@dataclass
class Boundary:
    moe_layer: int
    topk_ids: Tensor  # [T, k] static, written by the piece before
    prediction: tuple[int, Tensor] | None  # (next MoE layer, predictor scores [E]) static, or None


@dataclass
class PiecewiseGraph:
    """One padded batch size: len(boundaries) + 1 graph pieces."""

    pieces: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    boundaries: list[Boundary] = field(default_factory=list)
    row_mask: Tensor | None = None  # [T] bool, static (piece 0 computes it)


class ExpertTableBoundaries:
    """Stands in for an OffloadExpertProvider while graphs are captured, and replays its decisions."""

    def __init__(self, provider: OffloadExpertProvider | None, model: MoECausalLM, expert_view: Tensor,
                 tables: Tensor) -> None:
        self._provider = provider  # None: capture only (the start-up memory profile), never replayed
        self.model = model  # its MoE blocks read through this object while capturing
        self.predictor = provider.predictor if provider is not None else None
        self.num_layers = tables.shape[0]
        self.expert_view = expert_view
        self.active = tables.clone()  # [L_moe, E, 3] int32: what the captured MoE kernels read
        self._pending: tuple[int, Tensor] | None = None
        self._capture: PiecewiseGraph | None = None
        self._pool: Any = None
        self.host_waits = 0  # boundaries that read the routing on the host (offloaded experts, not streaming)
        self.skipped_waits = 0  # boundaries that went on without a host read (fully resident or streaming)

    @classmethod
    def over(cls, provider: OffloadExpertProvider, model: MoECausalLM) -> ExpertTableBoundaries:
        """The boundaries of a live offloading provider: captured, then replayed with its decisions."""
        return cls(provider, model, provider.expert_view, provider.cache.tables)

    @property
    def provider(self) -> OffloadExpertProvider:
        if self._provider is None:
            raise RuntimeError("these boundaries were made to capture graphs for a memory profile, not to replay")
        return self._provider

    # ---- the provider protocol, used while capturing (and during the eager warm-up before it) ------
    def before_layer(self, moe_layer: int, hidden: Tensor) -> None:
        predictor, nxt = self.predictor, moe_layer + 1
        if predictor is not None and nxt < self.num_layers:
            mask = self._capture.row_mask if self._capture is not None else None  # padding rows prefetch nothing
            self._pending = (nxt, predictor.scores(nxt, hidden, mask))
        else:
            self._pending = None

    def host_rows(self, moe_layer: int) -> Tensor | None:
        return None  # offloaded experts reach the kernel through the load buffers' pages

    def table(self, moe_layer: int, topk_ids: Tensor) -> Tensor:
        pred, self._pending = self._pending, None
        if self._capture is not None:
            self._capture.pieces[-1].capture_end()
            self._capture.boundaries.append(Boundary(moe_layer, topk_ids, pred))
            self._begin_piece()
        return self.active[moe_layer]

    def host_experts(self, moe_layer: int, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> None:
        return None  # the replay asks the provider for tables with every routed expert in them (replay_table)

    # ---- capture -------------------------------------------------------------------------------------
    def install(self) -> None:
        self.model.attach_experts(self)

    def uninstall(self) -> None:
        if self._provider is not None:
            self.model.attach_experts(self._provider)

    def begin_capture(self, pool: Any, row_mask: Tensor | None = None) -> None:
        self._pool = pool
        self._capture = PiecewiseGraph(row_mask=row_mask)
        self._begin_piece()

    def set_row_mask(self, row_mask: Tensor) -> None:
        if self._capture is not None:
            self._capture.row_mask = row_mask

    def end_capture(self) -> PiecewiseGraph:
        graph, self._capture = self._capture, None
        assert graph is not None
        graph.pieces[-1].capture_end()
        return graph

    def _begin_piece(self) -> None:
        assert self._capture is not None
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self._pool)
        self._capture.pieces.append(g)

    # ---- replay ----------------------------------------------------------------------------------------
    def all_resident(self) -> bool:
        """Every expert of every layer is in the pool now (tables change only between passes): a whole graph
        over the resident tables computes the same pass (engine/cuda_graphs.py)."""
        return self.provider.cache.all_resident()

    def replay(self, graph: PiecewiseGraph, as_resident: bool = False) -> None:
        """One pass. `as_resident`: every boundary takes the fully-resident path whatever the tables hold (timing
        the replay itself, `StepGraphs.measure_piecewise_overhead`; an offloaded expert is then skipped)."""
        provider = self.provider
        cache = provider.cache
        counter = provider.counter
        if counter is not None:
            counter.row_mask = graph.row_mask
        provider.row_mask = graph.row_mask
        # tables change only between forward passes (grows commit before, evictions leave after): one host
        # read of which layers are fully resident serves every boundary of this pass
        fully_resident = [True] * cache.num_layers if as_resident \
            else (cache.host_tables[:, :, 0] >= 0).all(dim=1).tolist()  # [L_moe] bool
        try:
            for k, piece in enumerate(graph.pieces):
                piece.replay()
                if k == len(graph.boundaries):
                    break
                b = graph.boundaries[k]
                if fully_resident[b.moe_layer]:
                    # every expert of this layer is resident: nothing to decide on the host
                    if counter is not None:
                        counter.record(b.moe_layer, b.topk_ids)
                    self.active[b.moe_layer].copy_(cache.tables[b.moe_layer])
                    provider.prefetch_next(b.moe_layer)  # a streaming next layer starts its copies here
                    self.skipped_waits += 1
                    continue
                # routing read (unless streaming), loads, waits
                table, read = provider.replay_table(b.moe_layer, b.topk_ids, b.prediction)
                self.active[b.moe_layer].copy_(table)
                if read:
                    self.host_waits += 1
                else:
                    self.skipped_waits += 1
        finally:
            provider.row_mask = None
            if counter is not None:
                counter.row_mask = None
