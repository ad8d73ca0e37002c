"""Piecewise CUDA graphs: a forward pass captured as one graph per stretch between two cuts, with what cannot live
in a graph run eagerly at each cut. Three kinds of cut, in any mix:

  * an MoE expert-table decision (offloading modes with copies: `ExpertTableBoundaries`, `Boundary`);
  * the host tier's join after that layer's MoE kernel (`HostJoin`, where the provider has a host tier,
    experts/host_tier.py): the experts the decision left to the host are added to the kernel's output there;
  * an eager stretch (`EagerCut`): a hybrid model's gated DeltaNet layer over the prefill sequences of a mixed
    step (models/state_cache.py `prefill_rows`), whose sizes are the step's host ints, run with the layout of
    the step the replay serves.

An offloading provider (fixed / elastic with experts in host memory) must see a MoE layer's real routing
before that layer's kernel runs: it reads which experts were routed (one device->host read), copies the
missing ones into a load buffer and hands the kernel a table. That decision cannot live inside a graph,
so the forward pass is cut at every `provider.table(l, ids)` call:

    piece 0:  embed, layer 0 (norms, attention, router)                  -> ids_0 (a static tensor)
    boundary 0 (host):  table_0 = provider.table(0, ids_0); active[0] <- table_0
    piece 1:  layer 0's MoE (reads active[0]), layer 1 (norms, attention, router) -> ids_1
    ...
    piece L:  layer L-1's MoE, final norm, logits

With a host tier every MoE layer has a second cut right after its kernel, and the decision may leave experts to
the host (their table rows -1, the kernel skips them):

    boundary l (host):  table_l, and the host job of the experts left to the host: their tokens' hidden rows
                        device -> host, queued before the kernel
    piece:              layer l's MoE kernel (the resident and copied experts)        -> out_l (a static tensor)
    join l (host):      the host computes its experts (the kernel ran meanwhile) and adds them into out_l in
                        place, queued after the kernel; nothing when the boundary left nothing to the host

The captured MoE kernels read `active` [L_moe, E, 3], a static copy of whatever table the provider
returned (its resident tables or a load buffer's table), refreshed by one small device copy per layer.
A boundary needs the host read only when its layer has experts in host memory; when every expert of a
layer is resident the boundary queues the copy and the routing count and goes on without waiting, so a
step with everything resident costs L+1 graph launches and no synchronisation.

A hybrid model's mixed step is cut at every gated DeltaNet layer instead (and at the table decisions too where
they are): each piece runs the layers' projections, norms, routers, MoE, attention and the DeltaNet decode rows
(paged kernels, no host data), and each cut the chunk form over the step's prefill sequences of one layer, reading
the projections from and writing its output rows into static buffers the pieces around it share.

Capture: `PieceCapture` holds the graph being captured; `cut` ends the current piece's capture and begins the next
one. While capturing, `ExpertTableBoundaries` stands in for the provider of every MoE module: `before_layer` runs
the predictor (device work, captured into the piece); `table` cuts. A hybrid model's state cache cuts at its
eager stretches (its `capture` is the same PieceCapture). Graph pieces share one memory pool and are always replayed
in capture order, which is what makes the tensors handed from one piece to the next (hidden states, routing ids,
predictions) safe in that pool; what an eager stretch reads and writes lives in static buffers outside it.

Padding rows (a padded batch) route too: `row_mask` ([T] bool, computed inside piece 0 from the slot
mapping) keeps them out of the provider's load decisions and out of the routing counts. An expert routed
only by padding rows may stay in host memory; the kernel skips it (table row -1) and writes zeros there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rimuru.experts.offload_provider import OffloadExpertProvider
from rimuru.models.causal_lm import MoECausalLM
from rimuru.models.forward_batch import StepLayout


@dataclass
class Boundary:
    moe_layer: int
    topk_ids: Tensor  # [T, k] static, written by the piece before
    prediction: tuple[int, Tensor] | None  # (next MoE layer, predictor scores [E]) static, or None
    # with a host tier (a HostJoin follows the layer's kernel): the layer's input rows [T, d] and routing weights
    # [T, k], static, what the host job reads
    hidden: Tensor | None = None
    topk_weights: Tensor | None = None


@dataclass
class HostJoin:
    """After `moe_layer`'s MoE kernel: the host tier's experts added into `out` (the kernel's static output)."""

    moe_layer: int
    out: Tensor  # [T, d], written by the piece before, read by the piece after


@dataclass
class EagerCut:
    """Work run eagerly between two pieces at every replay: `run(layout)`, with the layout of the step served."""

    run: Callable[[StepLayout | None], None]


@dataclass
class PiecewiseGraph:
    """One padded batch size: len(boundaries) + 1 graph pieces."""

    pieces: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    boundaries: list[Boundary | EagerCut | HostJoin] = field(default_factory=list)
    row_mask: Tensor | None = None  # [T] bool, static (piece 0 computes it)

    @property
    def has_table_decisions(self) -> bool:
        return any(isinstance(b, Boundary) for b in self.boundaries)

    def replay(self, layout: StepLayout | None = None) -> None:
        """One pass of a graph cut at eager stretches only: each piece, then the stretch after it. A graph with
        expert-table decisions replays through ExpertTableBoundaries.replay."""
        if self.has_table_decisions:
            raise RuntimeError("this graph has expert-table decisions: ExpertTableBoundaries.replay replays it")
        for k, piece in enumerate(self.pieces):
            piece.replay()
            if k < len(self.boundaries):
                cut = self.boundaries[k]
                assert isinstance(cut, EagerCut)
                cut.run(layout)


class PieceCapture:
    """Captures one pass as a PiecewiseGraph: pieces of one memory pool, a new one begun at every cut."""

    def __init__(self) -> None:
        self._graph: PiecewiseGraph | None = None
        self._pool: Any = None

    @property
    def capturing(self) -> bool:
        return self._graph is not None

    @property
    def row_mask(self) -> Tensor | None:
        return self._graph.row_mask if self._graph is not None else None

    def begin(self, pool: Any, row_mask: Tensor | None = None) -> None:
        if self._graph is not None:
            raise RuntimeError("a piecewise capture is already running")
        self._pool = pool
        self._graph = PiecewiseGraph(row_mask=row_mask)
        self._begin_piece()

    def set_row_mask(self, row_mask: Tensor) -> None:
        if self._graph is not None:
            self._graph.row_mask = row_mask

    def cut(self, run: Callable[[StepLayout | None], None]) -> None:
        """An eager stretch here (models/state_cache.py PassCut): `run(layout)` between this piece and the next."""
        self.cut_at(EagerCut(run))

    @property
    def last_boundary(self) -> Boundary | EagerCut | HostJoin | None:
        return self._graph.boundaries[-1] if self._graph is not None and self._graph.boundaries else None

    def cut_at(self, boundary: Boundary | EagerCut | HostJoin) -> None:
        assert self._graph is not None
        self._graph.pieces[-1].capture_end()
        self._graph.boundaries.append(boundary)
        self._begin_piece()

    def end(self) -> PiecewiseGraph:
        graph, self._graph = self._graph, None
        assert graph is not None
        graph.pieces[-1].capture_end()
        return graph

    def _begin_piece(self) -> None:
        assert self._graph is not None
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self._pool)
        self._graph.pieces.append(g)


class ExpertTableBoundaries:
    """Stands in for an OffloadExpertProvider while graphs are captured, and replays its decisions."""

    def __init__(self, provider: OffloadExpertProvider | None, model: MoECausalLM, expert_view: Tensor,
                 tables: Tensor, host_joins: bool = False) -> None:
        self._provider = provider  # None: capture only (the start-up memory profile), never replayed
        self.host_joins = host_joins  # the provider has a host tier: a HostJoin after every MoE kernel
        self.model = model  # its MoE blocks read through this object while capturing
        self.predictor = provider.predictor if provider is not None else None
        self.num_layers = tables.shape[0]
        self.expert_view = expert_view
        self.active = tables.clone()  # [L_moe, E, 3] int32: what the captured MoE kernels read
        self._pending: tuple[int, Tensor] | None = None
        self.capture = PieceCapture()  # shared with a hybrid model's state cache, which cuts the same pass
        self.host_waits = 0  # boundaries that read the routing on the host (offloaded experts, not streaming)
        self.skipped_waits = 0  # boundaries that went on without a host read (fully resident or streaming)

    @classmethod
    def over(cls, provider: OffloadExpertProvider, model: MoECausalLM) -> ExpertTableBoundaries:
        """The boundaries of a live offloading provider: captured, then replayed with its decisions."""
        return cls(provider, model, provider.expert_view, provider.cache.tables,
                   host_joins=provider.host_tier is not None)

    @property
    def provider(self) -> OffloadExpertProvider:
        if self._provider is None:
            raise RuntimeError("these boundaries were made to capture graphs for a memory profile, not to replay")
        return self._provider

    # ---- the provider protocol, used while capturing (and during the eager warm-up before it) ------
    def before_layer(self, moe_layer: int, hidden: Tensor) -> None:
        predictor, nxt = self.predictor, moe_layer + 1
        if predictor is not None and nxt < self.num_layers:
            mask = self.capture.row_mask  # padding rows prefetch nothing (None outside a capture)
            self._pending = (nxt, predictor.scores(nxt, hidden, mask))
        else:
            self._pending = None

    def host_rows(self, moe_layer: int) -> Tensor | None:
        return None  # offloaded experts reach the kernel through the load buffers' pages

    def table(self, moe_layer: int, topk_ids: Tensor) -> Tensor:
        pred, self._pending = self._pending, None
        if self.capture.capturing:
            self.capture.cut_at(Boundary(moe_layer, topk_ids, pred))
        return self.active[moe_layer]

    def host_experts(self, moe_layer: int, hidden: Tensor, topk_weights: Tensor,
                     topk_ids: Tensor) -> _CapturedJoin | None:
        """While capturing with a host tier: the layer's boundary keeps the static rows and weights its host job
        will read, and the MoE layer's `join` cuts after its kernel. Otherwise nothing (the eager warm-up passes
        before a capture, and graphs without a host tier, whose replay gives every routed expert to the GPU)."""
        if not (self.host_joins and self.capture.capturing):
            return None
        b = self.capture.last_boundary
        assert isinstance(b, Boundary) and b.moe_layer == moe_layer, "host_experts follows its layer's table()"
        b.hidden, b.topk_weights = hidden, topk_weights
        return _CapturedJoin(self.capture, moe_layer)

    # ---- capture -------------------------------------------------------------------------------------
    def install(self) -> None:
        self.model.attach_experts(self)

    def uninstall(self) -> None:
        if self._provider is not None:
            self.model.attach_experts(self._provider)

    def begin_capture(self, pool: Any, row_mask: Tensor | None = None) -> None:
        self.capture.begin(pool, row_mask)

    def set_row_mask(self, row_mask: Tensor) -> None:
        self.capture.set_row_mask(row_mask)

    def end_capture(self) -> PiecewiseGraph:
        return self.capture.end()

    # ---- replay ----------------------------------------------------------------------------------------
    def all_resident(self) -> bool:
        """Every expert of every layer is in the pool now (tables change only between passes): a whole graph
        over the resident tables computes the same pass (engine/cuda_graphs.py)."""
        return self.provider.cache.all_resident()

    def replay(self, graph: PiecewiseGraph, as_resident: bool = False, layout: StepLayout | None = None) -> None:
        """One pass. `as_resident`: every boundary takes the fully-resident path whatever the tables hold (timing
        the replay itself, `StepGraphs.measure_piecewise_overhead`; an offloaded expert is then skipped). `layout`:
        the step's, for the graph's eager stretches."""
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
        jobs: dict[int, Any] = {}  # MoE layer -> its started host job, joined at the layer's HostJoin
        try:
            for k, piece in enumerate(graph.pieces):
                piece.replay()
                if k == len(graph.boundaries):
                    break
                b = graph.boundaries[k]
                if isinstance(b, EagerCut):
                    b.run(layout)
                    continue
                if isinstance(b, HostJoin):
                    job = jobs.pop(b.moe_layer, None)
                    if job is not None:
                        job.join_into(b.out)
                    continue
                if fully_resident[b.moe_layer]:
                    # every expert of this layer is resident: nothing to decide on the host
                    if counter is not None:
                        counter.record(b.moe_layer, b.topk_ids)
                    self.active[b.moe_layer].copy_(cache.tables[b.moe_layer])
                    provider.prefetch_next(b.moe_layer)  # a streaming next layer starts its copies here
                    self.skipped_waits += 1
                    continue
                # routing read (unless streaming), loads, waits; with host joins captured, the host tier may take
                # some routed experts (table rows -1), whose job starts before the kernel's piece is replayed
                host_tier = b.hidden is not None and not as_resident
                table, read = provider.replay_table(b.moe_layer, b.topk_ids, b.prediction, host_tier=host_tier)
                self.active[b.moe_layer].copy_(table)
                if host_tier:
                    assert b.hidden is not None and b.topk_weights is not None
                    job = provider.host_experts(b.moe_layer, b.hidden, b.topk_weights, b.topk_ids)
                    if job is not None:
                        jobs[b.moe_layer] = job
                if read:
                    self.host_waits += 1
                else:
                    self.skipped_waits += 1
        finally:
            provider.row_mask = None
            if counter is not None:
                counter.row_mask = None


class _CapturedJoin:
    """What a MoE layer's host join is while its pass is captured: a cut after its kernel (HostJoin)."""

    def __init__(self, capture: PieceCapture, moe_layer: int) -> None:
        self.capture = capture
        self.moe_layer = moe_layer

    def join(self, out: Tensor) -> Tensor:
        self.capture.cut_at(HostJoin(self.moe_layer, out))
        return out  # the next piece reads it; the replay's join adds the host's experts into it first
