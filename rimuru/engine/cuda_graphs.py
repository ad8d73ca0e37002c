"""CUDA graphs for every step kind: the whole forward pass plus the logits, replayed, so that a step costs
one launch instead of ~60 per layer (eager launches cost ~40 µs each on the H200 host, more than the
kernels of a small step).

Two ladders of graphs share one memory pool and one set of static input buffers:

  * decode graphs, one per padded batch size Bp in `capture_sizes` (1, 2, 4, 8, 16, 32, ...): every
    sequence has one new token. Rows b >= B are padding: token 0, position 0, context 1 on block-table
    row of page 0, slot -1 (no KV write). Attention uses its split-K decode launch.
  * mixed graphs, one per padded token count Tp in `token_buckets` (32, 64, ..., max_num_batched_tokens, or
    --max-cudagraph-capture-size when smaller; larger steps run eagerly):
    any mix of prefill chunks and decodes with T <= Tp tokens and B <= max_num_seqs sequences. Rows
    t >= T are padding tokens (token 0, position 0, slot -1) that belong to no sequence; sequences
    b >= B are empty (q_len 0). Attention uses the tile-mapped launch (`q_tile_start`), whose grid
    depends on (Tp, max_num_seqs) alone; padding rows come out 0 and are never sampled.

A step's numbers arrive on the device in the runner's one packed host->device copy, already padded
(ModelRunner.host_arrays), and are copied device to device into the static buffers. Page tables are
read through these buffers and expert tables through the provider's own [L_moe, E, 3] tensor, both
updated in place, so pages and experts may move between steps without invalidating any graph. The
logits of every graph land in one static fp32 buffer [max rows, V] (rows past the sampled ones are
garbage); a step reads its rows before the next replay overwrites them. Prompt logprobs read a mixed graph's hidden
states where the graph itself leaves them, in its memory pool, with no copy (`mixed_hidden` says why that is safe).

Elastic mode captures both kinds for every size: piecewise graphs (for passes with experts in host memory)
and whole graphs over the live resident tables (`resident_provider`, a StaticExpertProvider on the expert
cache's device tables that counts routing inside the graph). A pass replays the whole graph while every
expert is resident: one launch and no per-layer host work, as in static mode (measured on the H200, the
piecewise replay of a fully resident pass cost ~2 ms of host time and ~1.8 ms of GPU time more than static
at 10 req/s). Both ladders share the one memory pool: they are never replayed at the same time.

Hybrid models (gated DeltaNet layers, models/state_cache.py) read the state page ids too: `ssm_pages` /
`conv_pages`, static [L_lin, max(max_bs, max_num_seqs)] int64 buffers rewritten in place each step like the block
tables: column b names sequence b's state pages per linear-attention layer, -1 in padding rows and sequences (the
paged decode kernels read and write nothing there). Their decode graphs are whole (or piecewise at the table
decisions) as for every model: whether a sequence has state to continue is computed inside the graph from the
static seq_lens (a context longer than its one new token), so fresh sequences, and padding rows (context 1), select
zero states on the device. Their mixed graphs are piecewise, cut at every gated DeltaNet layer
(engine/piecewise_graphs.py `EagerCut`), as vLLM cuts hybrid models at their token mixers: each piece holds the
projections, norms, routers, MoE, attention (the tile-mapped launch) and the DeltaNet decode rows (the runner puts
decodes first; the pieces find them on the device among the first min(Tp, max_num_seqs) rows, `begin_pass`); each
cut runs the chunk form over the step's prefill sequences of one layer eagerly, with the step's StepLayout (host
ints: their rows, the longest, the number of decodes), reading the layer's projections from and writing its output
rows into static buffers every layer and graph shares (`LinearStateCache.reserve_graph_rows`, outside the pool).
A mixed step thus costs one replay per DeltaNet layer plus that layer's prefill launches, where an eager pass paid
every launch of every layer; fla-core's kernel, where it runs, syncs the host once per step (its chunk indices).
With copies the same graphs are also cut at the table decisions; elastic's resident-tables mixed graphs are cut
at the DeltaNet layers only.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rimuru.config import EngineConfig
from rimuru.engine.piecewise_graphs import ExpertTableBoundaries, PieceCapture, PiecewiseGraph
from rimuru.engine.scheduler import SchedulerOutput
from rimuru.experts.routing_counter import RoutingCounter
from rimuru.experts.runtime import GraphPlan
from rimuru.experts.static_provider import StaticExpertProvider
from rimuru.models.causal_lm import MoECausalLM
from rimuru.models.forward_batch import ForwardBatch, StepLayout

logger = logging.getLogger("rimuru")

# Mixed-step token buckets: fine steps where prefill chunks are short, coarser (x1.5) above 1024.
_TOKEN_LADDER = (32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
MAX_MIXED_GRAPH_TOKENS = _TOKEN_LADDER[-1]  # larger steps run eagerly (activation memory of the graph pool)


def release_cublas_workspaces(device: torch.device) -> None:
    """Gives back every cuBLAS workspace torch holds (after the device's work is done). torch keeps one workspace per
    (cuBLAS handle, stream) for the life of the process, 32 MiB on Hopper, made by the first matmul on that stream
    and outside any graph pool: a workspace made by an eager warm-up or by the start-up profile would stay held
    beside what was measured. Cleared, the next matmul on a stream makes its workspace where it runs: inside the
    pool of the graph being captured (as torch's own cudagraph trees do), or in the allocator for an eager pass.
    Safe for graphs captured here, whose workspace lives in their pool; eager passes find theirs made anew."""
    torch.cuda.synchronize(device)
    torch._C._cuda_clearCublasWorkspaces()


def why_no_graphs(config: EngineConfig, mode: str, in_place_decode: bool) -> str | None:
    """Why an engine on a GPU captures no CUDA graphs in offload `mode` (None: it captures them), one rule for the
    engine and its workspace profile. `in_place_decode`: a hybrid model's state decodes by the paged kernels in place
    (the gather path syncs the host). Under tensor parallelism every rank replays rank 0's graph choice, which
    copy access cannot give: its passes decide on the host at every expert-table cut inside the graph. There the
    rule reads the configured mode, not the one chosen from a rank's measured memory (`mode`): every rank's
    profile must capture alike, before the ranks agree on the mode, or its captures' collectives would not pair."""
    if config.enforce_eager:
        return "--enforce-eager"
    if not in_place_decode:
        return "a hybrid model without Triton's paged decode kernels (the state gather path syncs the host)"
    if config.tensor_parallel_size > 1 and config.offload_mode != "static" and config.offload_access == "copy":
        return ("tensor parallelism with copy access, unless --offload-mode static (each rank's passes decide at "
                "every expert-table cut)")
    return None


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode ladder: 1, 2, 4, 8, then every 16 up to max_num_seqs (vLLM's ladder, shortened)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Mixed ladder: the token counts up to min(max_num_batched_tokens, MAX_MIXED_GRAPH_TOKENS), that one last."""
    top = min(max_num_batched_tokens, MAX_MIXED_GRAPH_TOKENS)
    return [t for t in _TOKEN_LADDER if t < top] + [top]


def capture_step_graphs(model: MoECausalLM, plan: GraphPlan, device: torch.device, num_attention_layers: int,
                        max_num_seqs: int, max_model_len: int, block_size: int, max_num_batched_tokens: int,
                        max_capture_size: int | None, num_linear_layers: int = 0) -> StepGraphs:
    """The graphs a runtime's GraphPlan asks for, captured: whole graphs (static experts), or piecewise graphs cut
    at every MoE layer's expert-table decision, replayed with that decision on the host between the pieces
    (engine/piecewise_graphs.py), plus whole graphs over the resident tables where the plan has them (elastic).
    Expert tables and page tables change in place, so evictions, grows and loads never invalidate a graph.
    `num_linear_layers` > 0 (a hybrid model): the state page ids are static buffers too, and mixed graphs are cut at
    every gated DeltaNet layer (its prefill sequences run eagerly between the pieces)."""
    boundaries = ExpertTableBoundaries.over(plan.piecewise, model) if plan.piecewise is not None else None
    graphs = StepGraphs(model, device, num_attention_layers, max_num_seqs, max_model_len, block_size,
                        max_num_batched_tokens, counter=plan.counter, boundaries=boundaries,
                        resident_provider=plan.resident, max_capture_size=max_capture_size,
                        num_linear_layers=num_linear_layers)
    graphs.capture()
    return graphs


class StepGraphs:
    def __init__(self, model: MoECausalLM, device: torch.device, num_layers: int, max_num_seqs: int,
                 max_model_len: int, block_size: int, max_num_batched_tokens: int | None = None,
                 counter: RoutingCounter | None = None, boundaries: ExpertTableBoundaries | None = None,
                 resident_provider: StaticExpertProvider | None = None,
                 max_capture_size: int | None = None, num_linear_layers: int = 0) -> None:
        if resident_provider is not None and boundaries is None:
            raise ValueError("resident_provider needs boundaries (whole graphs are the piecewise ones' fast path)")
        self.model = model
        self.counter = counter  # the providers' routing counter: graphs count real rows only (row_mask)
        self.boundaries = boundaries  # offloading provider: piecewise graphs (engine/piecewise_graphs.py)
        # elastic: whole graphs over the live resident tables, replayed while every expert is resident
        self.resident_provider = resident_provider
        self.device = device
        # max_capture_size (EngineConfig.max_cudagraph_capture_size): no graph of more rows; larger steps run eagerly
        cap = max_capture_size or max(max_num_seqs, max_num_batched_tokens or 0)
        self.sizes = capture_sizes(min(max_num_seqs, cap))  # decode ladder
        self.token_sizes = token_buckets(min(max_num_batched_tokens, cap)) if max_num_batched_tokens else []
        self.num_linear_layers = num_linear_layers
        # what captures piecewise graphs: the boundaries' (expert-table cuts) or its own (a hybrid's mixed graphs)
        self.pieces = boundaries.capture if boundaries is not None else PieceCapture()
        self.max_bs = self.sizes[-1]
        self.max_seqs = max_num_seqs  # sequences of every mixed graph (and its sampled rows)
        self.max_model_len = max_model_len
        self.max_blocks = max_blocks = -(-max_model_len // block_size)
        n = max([self.max_bs, *self.token_sizes])  # token rows of the largest graph
        L, S = num_layers, max_num_seqs

        def i32(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        # shared by both ladders: each step rewrites the rows its graph reads
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((L, n), -1, dtype=torch.int64, device=device)
        self.block_tables = i32(L, max(S, self.max_bs), max_blocks)
        self.logits_out: torch.Tensor | None = None  # [max(S, max_bs), V] fp32, made at capture
        # by id of a captured mixed graph (or piecewise graph): its pass's hidden states [Tp, d], a view that does
        # not own the graph pool's memory it reads (`mixed_hidden`); the last replayed graph's (None after a decode
        # graph), until the next replay
        self._hidden_views: dict[int, torch.Tensor] = {}
        self._replayed_hidden: torch.Tensor | None = None
        # decode ladder: one token per row, so query_start_loc and logits_indices never change
        self.query_start_loc = torch.arange(self.max_bs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(self.max_bs, dtype=torch.int64, device=device)
        # hybrid models: [L_lin, max(max_bs, S)] state page ids of each sequence (a decode row, a mixed graph's
        # sequence), -1 = padding (no state read or written)
        self.ssm_pages: torch.Tensor | None = None
        self.conv_pages: torch.Tensor | None = None
        if num_linear_layers:
            rows = max(self.max_bs, S)
            self.ssm_pages = torch.full((num_linear_layers, rows), -1, dtype=torch.int64, device=device)
            self.conv_pages = torch.full((num_linear_layers, rows), -1, dtype=torch.int64, device=device)
            if self.token_sizes:  # what the mixed graphs' pieces hand their eager stretches, outside the pool
                state_cache = model.state_cache
                assert state_cache is not None, "a hybrid model's graphs need its state cache bound"
                state_cache.reserve_graph_rows(self.token_sizes[-1])
        # mixed ladder
        self.mix_query_start_loc = i32(S + 1)
        self.mix_seq_lens = i32(S)
        self.mix_q_tile_start = i32(S + 1)
        self.mix_logits_indices = torch.zeros(S, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph | PiecewiseGraph] = {}
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph | PiecewiseGraph] = {}
        self.whole_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # resident_provider's, by decode size
        # by token count; a hybrid's are cut at its eager stretches only (no table decision)
        self.whole_mixed_graphs: dict[int, torch.cuda.CUDAGraph | PiecewiseGraph] = {}
        self.whole_replays = 0  # passes that replayed a whole graph although the provider offloads
        # a hybrid's mixed graphs, by token count, for a step with ONE prefill sequence: whole graphs that hold its
        # gated DeltaNet prefill in a static window (models/state_cache.py single_prefill) instead of cutting at an
        # eager stretch per layer; captured where no expert-table cut is (static mode, direct access)
        self.single_prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.single_prefill_replays = 0
        self._single_prefill_failed = False
        self.pool = None
        self.capture_s = 0.0

    # ---- the static batches the graphs read ---------------------------------------------------------
    def batch(self, bs: int) -> ForwardBatch:
        """Decode graph of bs rows."""
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:, :bs], slot_mapping=self.slot_mapping[:, :bs],
            logits_indices=self.logits_indices[:bs], max_query_len=1, max_seq_len=self.max_model_len,
            ssm_pages=self.ssm_pages[:, :bs] if self.ssm_pages is not None else None,
            conv_pages=self.conv_pages[:, :bs] if self.conv_pages is not None else None, padded=True,
        )

    def mixed_batch(self, tokens: int) -> ForwardBatch:
        """Mixed graph of `tokens` rows and max_seqs sequences."""
        S = self.max_seqs
        return ForwardBatch(
            input_ids=self.input_ids[:tokens], positions=self.positions[:tokens],
            query_start_loc=self.mix_query_start_loc, seq_lens=self.mix_seq_lens,
            block_tables=self.block_tables[:, :S], slot_mapping=self.slot_mapping[:, :tokens],
            logits_indices=self.mix_logits_indices, max_query_len=tokens, max_seq_len=self.max_model_len,
            q_tile_start=self.mix_q_tile_start,
            ssm_pages=self.ssm_pages[:, :S] if self.ssm_pages is not None else None,
            conv_pages=self.conv_pages[:, :S] if self.conv_pages is not None else None, padded=True,
        )

    def _forward_into_logits(self, batch: ForwardBatch, piecewise: bool = False) -> _TensorPlace:
        """The pass and its logits into `logits_out`; returns where the pass left its hidden states (freed when this
        returns, inside a capture as any other activation)."""
        if piecewise:  # routing is counted at the boundaries, with this mask
            assert self.boundaries is not None
            self.boundaries.set_row_mask(batch.slot_mapping[0] >= 0)
        elif self.counter is not None:  # padding rows have slot -1 in every layer, real rows never
            self.counter.row_mask = batch.slot_mapping[0] >= 0
        try:
            hidden = self.model(batch)  # [T, d]
        finally:
            if self.counter is not None and not piecewise:
                self.counter.row_mask = None
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [rows, V] fp32
        if self.logits_out is None:
            rows = max(self.max_seqs, self.max_bs)
            self.logits_out = torch.empty(rows, logits.shape[1], dtype=torch.float32, device=self.device)
        self.logits_out[: logits.shape[0]].copy_(logits)
        return _TensorPlace.of(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        if self.boundaries is not None:
            self.boundaries.install()
        state_cache = self.model.state_cache if self.num_linear_layers else None
        if state_cache is not None:
            state_cache.capture = self.pieces  # its gated DeltaNet layers cut mixed passes at their prefill rows
        try:
            self._capture_all()
        finally:
            if self.boundaries is not None:
                self.boundaries.uninstall()
            if state_cache is not None:
                state_cache.capture = None
        self.capture_s = time.monotonic() - t0
        kind = "piecewise (cut at every MoE expert-table decision)" if self.boundaries is not None else "whole"
        if self.resident_provider is not None:
            kind += " and whole (replayed while every expert is resident)"
        if self.num_linear_layers and self.token_sizes:
            kind += "; mixed graphs also cut at every gated DeltaNet layer's prefill rows"
            if self.single_prefill_graphs:
                kind += ", and whole ones for steps with one prefill sequence"
        logger.info("captured %s CUDA graphs in %.1f s: decode batch sizes %s; mixed token counts %s", kind,
                    self.capture_s, self.sizes, self.token_sizes)

    def _capture_all(self) -> None:
        piecewise = self.boundaries is not None
        self._forward_into_logits(self.batch(1), piecewise)  # makes logits_out outside any graph
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        todo = [(True, t) for t in reversed(self.token_sizes)] + [(False, b) for b in reversed(self.sizes)]
        todo.sort(key=lambda x: -x[1])  # largest first: smaller graphs reuse its memory pool
        with torch.cuda.stream(stream):
            # Every eager warm-up (compiles and autotunes kernels for each shape) runs before the first capture,
            # each one's activations given back before the next: no warm-up sits beside a graph pool that
            # already holds the largest graph's activations (interleaved, the start-up peak would be the pool
            # plus the next size's eager pass: above what serving holds).
            singles = self._single_prefill_sizes()
            for mixed, size in todo:
                batch = self._sized_batch(mixed, size)
                for _ in range(2):
                    self._forward_into_logits(batch, piecewise)
                if mixed and size in singles:
                    with self._single_prefill():
                        for _ in range(2):
                            self._forward_into_logits(batch)
                self._release_warmup_cache()
            if self.resident_provider is not None:
                with self._resident_modules():
                    for mixed, size in todo:  # this provider's path, warmed up the same way
                        self._forward_into_logits(self._sized_batch(mixed, size))
                        self._release_warmup_cache()
            for mixed, size in todo:
                batch = self._sized_batch(mixed, size)
                graph: torch.cuda.CUDAGraph | PiecewiseGraph
                if piecewise or (mixed and self.num_linear_layers):
                    graph = self._capture_pieces(batch, piecewise)
                else:
                    graph = self._capture_whole(batch, stream)
                (self.mixed_graphs if mixed else self.graphs)[size] = graph
                if mixed and size in singles:
                    self._capture_single_prefill(batch, stream)
            if self.resident_provider is not None:
                self._capture_resident(todo, stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # the captures' cuBLAS workspace was made inside the graphs' pool (the warm-ups' was released): the graphs
        # keep its bytes there as one more activation, and no later matmul on this stream reuses it outside them
        release_cublas_workspaces(self.device)
        # the eager warm-ups cached activation blocks outside the graphs' pool: give them back, so the process
        # holds the pool once and not the same peak twice (the budget's workspace bound covers one)
        torch.cuda.empty_cache()

    def _single_prefill_sizes(self) -> set[int]:
        """Token counts of the single-prefill mixed graphs to capture: every mixed one of a hybrid model, where its
        mixed graphs have no expert-table cut."""
        if not self.num_linear_layers or self.boundaries is not None or self._single_prefill_failed:
            return set()
        return set(self.token_sizes)

    @contextlib.contextmanager
    def _single_prefill(self) -> Iterator[None]:
        state_cache = self.model.state_cache
        assert state_cache is not None
        state_cache.single_prefill = True
        try:
            yield
        finally:
            state_cache.single_prefill = False

    def _capture_single_prefill(self, batch: ForwardBatch, stream: torch.cuda.Stream) -> None:
        """One whole single-prefill graph of `batch`'s size. A capture that fails (a kernel that cannot be captured)
        leaves the hybrid's steps to the cut mixed graphs, which serve every step as before, and says so once."""
        if self._single_prefill_failed:
            return
        try:
            with self._single_prefill():
                self.single_prefill_graphs[batch.num_tokens] = self._capture_whole(batch, stream)
        except RuntimeError as err:
            self._single_prefill_failed = True
            self.single_prefill_graphs.clear()
            logger.warning("single-prefill mixed graphs not captured (%s): every mixed step replays the graphs cut "
                           "at the gated DeltaNet layers", str(err).splitlines()[0])

    def _release_warmup_cache(self) -> None:
        """The eager warm-up's activations are dead but cached outside the graphs' pool; give them back before
        the capture allocates the same activations inside the pool, so start-up holds them once, not twice. The
        same for the capture stream's cuBLAS workspace: the first captured matmul then makes it inside the pool."""
        release_cublas_workspaces(self.device)
        torch.cuda.empty_cache()

    def _capture_whole(self, batch: ForwardBatch, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            hidden = self._forward_into_logits(batch)
        if batch.q_tile_start is not None:  # a mixed pass: prompt logprobs may read its hidden states
            self._hidden_views[id(graph)] = hidden.unowned_view()
        return graph

    def _capture_pieces(self, batch: ForwardBatch, table_cuts: bool) -> PiecewiseGraph:
        """A piecewise graph of one pass (on the capture stream), cut at the expert-table decisions (`table_cuts`:
        the offloading boundaries are installed) and at a hybrid mixed pass's eager stretches."""
        self.pieces.begin(self.pool)
        try:
            hidden = self._forward_into_logits(batch, table_cuts)
        except BaseException:
            with contextlib.suppress(Exception):
                self.pieces.end()
            raise
        graph = self.pieces.end()
        if batch.q_tile_start is not None:  # a mixed pass: prompt logprobs may read its hidden states (mixed_hidden)
            self._hidden_views[id(graph)] = hidden.unowned_view()
        return graph

    def _sized_batch(self, mixed: bool, size: int) -> ForwardBatch:
        """The static batch a graph of the mixed (token count) or decode (batch size) ladder is captured with."""
        return self.mixed_batch(size) if mixed else self.batch(size)

    @contextlib.contextmanager
    def _resident_modules(self) -> Iterator[None]:
        """The MoE modules read the resident tables directly (elastic mode's whole graphs) inside the block; the
        capture stand-in (the boundaries) again after it."""
        assert self.boundaries is not None and self.resident_provider is not None
        self.model.attach_experts(self.resident_provider)
        try:
            yield
        finally:
            self.model.attach_experts(self.boundaries)

    def _capture_resident(self, todo: list[tuple[bool, int]], stream: torch.cuda.Stream) -> None:
        """Whole graphs with the MoE modules reading the resident tables directly (elastic mode's fast path);
        warmed up in _capture_all before any capture."""
        with self._resident_modules():
            for mixed, size in todo:
                batch = self._sized_batch(mixed, size)
                if mixed and self.num_linear_layers:  # no table decision, but the eager stretches
                    self.whole_mixed_graphs[size] = self._capture_pieces(batch, table_cuts=False)
                else:
                    (self.whole_mixed_graphs if mixed else self.whole_graphs)[size] = self._capture_whole(batch,
                                                                                                         stream)

    def measure_piecewise_overhead(self, batch_size: int = 48, reps: int = 20) -> float | None:
        """Seconds a decode pass of the piecewise graph takes beyond the whole graph of the same size over the same
        tables (the piecewise replay's fast path at every boundary: no routing read, no copy; an offloaded expert
        is skipped by both). Wall time around `reps` replays each, so host launch work counts where it outlasts
        the GPU. The replays read the static buffers as capture left them (padding rows: slot -1, no KV write);
        their routing counts are discarded. None when no whole graphs were captured (every pass is piecewise)."""
        if self.resident_provider is None or self.boundaries is None:
            return None
        bs = self.padded_size(min(batch_size, self.max_bs))
        whole, piecewise = self.whole_graphs[bs], self.graphs[bs]
        assert isinstance(piecewise, PiecewiseGraph)

        def wall(replay) -> float:
            replay()  # warm
            torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            for _ in range(reps):
                replay()
            torch.cuda.synchronize(self.device)
            return (time.perf_counter() - t0) / reps

        waits = (self.boundaries.host_waits, self.boundaries.skipped_waits)
        t_whole = wall(whole.replay)
        t_piecewise = wall(lambda: self.boundaries.replay(piecewise, as_resident=True))
        # timing passes are not traffic: their routing counts and boundary counts are dropped
        self.boundaries.host_waits, self.boundaries.skipped_waits = waits
        if self.counter is not None:
            self.counter.snapshot_and_reset()
        logger.info("piecewise graphs: %.2f ms per decode pass of %d rows beyond the whole graph (%.2f ms)",
                    1e3 * max(0.0, t_piecewise - t_whole), bs, 1e3 * t_whole)
        return max(0.0, t_piecewise - t_whole)

    # ---- which graph a step can use ------------------------------------------------------------------
    def can_run(self, sched: SchedulerOutput) -> bool:
        """A decode graph: every scheduled request decodes one token."""
        return (len(sched.scheduled) <= self.max_bs
                and all(s.num_new_tokens == 1 and s.samples for s in sched.scheduled)
                and max(len(s.request.kv_pages) for s in sched.scheduled) <= self.max_blocks)

    def can_run_mixed(self, sched: SchedulerOutput) -> bool:
        return (bool(self.token_sizes) and sched.num_tokens <= self.token_sizes[-1]
                and len(sched.scheduled) <= self.max_seqs
                and max(len(s.request.kv_pages) for s in sched.scheduled) <= self.max_blocks)

    def padded_size(self, bs: int) -> int:
        return next(s for s in self.sizes if s >= bs)

    def padded_tokens(self, tokens: int) -> int:
        return next(t for t in self.token_sizes if t >= tokens)

    # ---- replay ------------------------------------------------------------------------------------------
    def _replay(self, graph: torch.cuda.CUDAGraph | PiecewiseGraph,
                whole: torch.cuda.CUDAGraph | PiecewiseGraph | None = None, layout: StepLayout | None = None) -> None:
        """`whole`: the same size's resident-tables graph, replayed instead while every expert is resident.
        `layout`: the step's (a hybrid mixed graph's eager stretches)."""
        if whole is not None and self.boundaries is not None and self.boundaries.all_resident():
            graph = whole
            whole.replay(layout) if isinstance(whole, PiecewiseGraph) else whole.replay()
            self.whole_replays += 1
        elif isinstance(graph, PiecewiseGraph) and graph.has_table_decisions:
            assert self.boundaries is not None
            self.boundaries.replay(graph, layout=layout)
        elif isinstance(graph, PiecewiseGraph):
            graph.replay(layout)
        else:
            graph.replay()
        self._replayed_hidden = self._hidden_views.get(id(graph))

    def fill_decode(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, slot_mapping: torch.Tensor, ssm_pages: torch.Tensor | None = None,
                    conv_pages: torch.Tensor | None = None) -> int:
        """Copies one decode step's inputs, on the device and padded to a captured size Bp
        (ModelRunner.host_arrays(pad_to=Bp)), into the static buffers (device to device, no host sync): [Bp], [Bp],
        [Bp], [L, Bp, nb], [L, Bp], and a hybrid model's [L_lin, Bp] state page ids (-1 in padding rows). Returns
        Bp."""
        bp = input_ids.shape[0]
        if bp not in self.sizes:
            raise ValueError(f"no decode graph for {bp} rows (the ladder: {self.sizes})")
        if (ssm_pages is None) != (self.ssm_pages is None) or (conv_pages is None) != (self.conv_pages is None):
            raise ValueError("a hybrid model's decode graphs take ssm_pages and conv_pages, and only theirs do")
        nb = block_tables.shape[2]
        self.input_ids[:bp].copy_(input_ids)
        self.positions[:bp].copy_(positions)
        self.seq_lens[:bp].copy_(seq_lens)
        self.block_tables[:, :bp, :nb].copy_(block_tables)
        self.slot_mapping[:, :bp].copy_(slot_mapping)
        if self.ssm_pages is not None and self.conv_pages is not None:
            assert ssm_pages is not None and conv_pages is not None
            self.ssm_pages[:, :bp].copy_(ssm_pages)
            self.conv_pages[:, :bp].copy_(conv_pages)
        return bp

    def run(self, num_seqs: int, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
            block_tables: torch.Tensor, slot_mapping: torch.Tensor, ssm_pages: torch.Tensor | None = None,
            conv_pages: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of `num_seqs` requests: its inputs into the static buffers (`fill_decode`), the graph of
        their padded size replayed; returns logits [num_seqs, V]."""
        bp = input_ids.shape[0]
        if bp not in self.graphs:
            raise ValueError(f"no decode graph captured for {bp} rows (captured: {self.sizes})")
        self.fill_decode(input_ids, positions, seq_lens, block_tables, slot_mapping, ssm_pages, conv_pages)
        self._replay(self.graphs[bp], self.whole_graphs.get(bp))
        assert self.logits_out is not None
        return self.logits_out[:num_seqs]

    def run_mixed(self, num_sampled: int, input_ids: torch.Tensor, positions: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  slot_mapping: torch.Tensor, logits_indices: torch.Tensor, q_tile_start: torch.Tensor,
                  ssm_pages: torch.Tensor | None = None, conv_pages: torch.Tensor | None = None,
                  layout: StepLayout | None = None) -> torch.Tensor:
        """One mixed step, inputs padded by ModelRunner.host_arrays(pad_tokens=Tp, pad_seqs=max_seqs): [Tp],
        [Tp], [S+1], [S], [L, B, nb] (real sequences only), [L, Tp], [S], [S+1]; a hybrid model's also its state
        page ids [L_lin, S] (-1 past the real sequences) and the step's layout (its eager stretches' host ints).
        Returns logits [num_sampled, V]."""
        tp = input_ids.shape[0]
        if tp not in self.mixed_graphs:
            raise ValueError(f"no mixed graph captured for {tp} tokens (captured: {self.token_sizes})")
        hybrid = self.ssm_pages is not None and self.conv_pages is not None
        if hybrid != (ssm_pages is not None and conv_pages is not None and layout is not None):
            raise ValueError("a hybrid model's mixed graphs take ssm_pages, conv_pages and the layout, and only theirs")
        _, b, nb = block_tables.shape
        self.input_ids[:tp].copy_(input_ids)
        self.positions[:tp].copy_(positions)
        self.slot_mapping[:, :tp].copy_(slot_mapping)
        self.block_tables[:, :b, :nb].copy_(block_tables)
        self.mix_query_start_loc.copy_(query_start_loc)
        self.mix_seq_lens.copy_(seq_lens)
        self.mix_logits_indices.copy_(logits_indices)
        self.mix_q_tile_start.copy_(q_tile_start)
        if hybrid:
            assert self.ssm_pages is not None and self.conv_pages is not None
            assert ssm_pages is not None and conv_pages is not None
            self.ssm_pages[:, : self.max_seqs].copy_(ssm_pages)
            self.conv_pages[:, : self.max_seqs].copy_(conv_pages)
            single = self.single_prefill_graphs.get(tp)
            if single is not None and layout is not None and layout.num_prefills == 1:
                self.single_prefill_replays += 1
                self._replay(single)
                assert self.logits_out is not None
                return self.logits_out[:num_sampled]
        self._replay(self.mixed_graphs[tp], self.whole_mixed_graphs.get(tp), layout)
        assert self.logits_out is not None
        return self.logits_out[:num_sampled]

    def mixed_hidden(self) -> torch.Tensor:
        """[Tp, d]: the hidden states of the mixed pass just replayed (its padded token rows), where the graph left
        them in its memory pool. To be read by work queued on the stream before the next replay.

        Why no copy is needed: the tensor is the captured pass's own output, allocated in the graphs' private pool.
        No eager allocation is ever served from that pool, and its memory stays while the graphs do. Within its own
        graph nothing is written over it after the final norm writes it (the pass holds it until the capture's
        forward returns, so no later allocation of that capture reuses its block). After that capture it is a free
        block of the shared pool, which graphs captured later (smaller sizes, the decode ladder, elastic mode's whole
        graphs) may reuse: any replay of any graph may overwrite it, and it is valid from its own replay until the
        next replay on the stream. The runner queues the prompt-logprobs LM head over it (ModelRunner.launch,
        compute_prompt_logprobs) in the same launch as the replay, on the same stream, before launch returns; the
        next replay is queued by a later launch, also under async scheduling (step n + 1 is launched before step n
        is read, but after step n's launch has queued all of its work), so stream order puts it after those reads.
        The view does not own the pool's memory: a strong reference would keep each mixed graph's [Tp, d] out of
        every later capture's reach (more memory than a static buffer), this one keeps the pool as if nothing held
        it."""
        assert self._replayed_hidden is not None, "the last graph replayed is not a mixed graph"
        return self._replayed_hidden


@dataclass(frozen=True)
class _TensorPlace:
    """Where a tensor's elements are: enough to view them again without owning the memory."""

    data_ptr: int
    nbytes: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> _TensorPlace:
        storage = t.untyped_storage()
        return cls(storage.data_ptr(), storage.nbytes(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
                   t.device)

    def unowned_view(self) -> torch.Tensor:
        """A tensor over the same memory that does not keep it allocated (the caching allocator may hand the memory
        to someone else: the owner of the view says when reading it is valid). torch's CUDA-graph trees view their
        graphs' outputs the same way."""
        storage = torch._C._construct_storage_from_data_pointer(self.data_ptr, self.device, self.nbytes)
        return torch.empty(0, dtype=self.dtype, device=self.device).set_(storage, self.offset, self.shape, self.stride)
