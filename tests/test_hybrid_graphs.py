"""CUDA graphs for a hybrid model's steps (engine/cuda_graphs.py; the state pages: models/state_cache.py).

A hybrid model's graphs read the state page ids from static [L_lin, B_graph] buffers: the live rows' pages, -1 in
padding rows. A pure-decode step replays a decode graph; a step with a prefill chunk a mixed graph cut at every gated
DeltaNet layer (engine/piecewise_graphs.py), whose prefill sequences run eagerly between the pieces with the step's
layout.

On the CPU: the static batches a decode and a mixed step fill, the step kinds, the capture's cuts (stand-in graph
pieces: one eager stretch per gated DeltaNet layer, between the expert-table decisions where those cut too), and the
engine serving with every "graph" replayed as an eager pass over the graphs' static buffers (what a captured graph
reads, without CUDA; a mixed one with the step's layout for its stretches): the eager engine's tokens, every step
through the buffers, through chunked prefill, preemption, evictions, and requests arriving and finishing between
steps, nothing held after. On the GPU (`-m gpu`): the captured graphs against enforce_eager, in float32 (equal tokens)
and bfloat16 (equal up to a near-tie), in static mode, elastic mode with direct access (whole decode graphs), fixed
mode with copies (piecewise graphs) and elastic mode with copies (piecewise, and over the resident tables).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.engine.cuda_graphs import StepGraphs
from rimuru.engine.llm_engine import LLMEngine
from rimuru.engine.model_runner import SampledTokens
from rimuru.engine.piecewise_graphs import Boundary, EagerCut, PiecewiseGraph
from rimuru.engine.scheduler import SchedulerOutput
from rimuru.engine.step_profiler import StepTrace
from rimuru.experts.residency import EXPERT
from rimuru.models.forward_batch import StepLayout
from rimuru.testing.graph_pieces import StandInPiece
from rimuru.testing.pools import assert_nothing_held
from rimuru.testing.reference import random_prompts

pytest.importorskip("transformers")

CHUNK = 16  # max_num_batched_tokens: the longer prompts are prefilled in chunks
SEQS = 8  # max_num_seqs: decode graphs of 1, 2, 4 and 8 rows
# (engine step at which the request arrives, prompt length, max_tokens): requests arrive while others decode, finish
# at different steps (the batch shrinks through the padded sizes), one prompt of one token decodes its first token
# as a fresh sequence (no state to continue) inside a decode step, and the last prompt is the second one's first 17
# tokens: a prefix hit at its 16-token boundary (where the pool keeps the snapshot) leaves it one token to compute,
# a decode step whose state copy runs before it
ARRIVALS = ((0, 12, 14), (0, 30, 18), (0, 7, 6), (3, 21, 16), (6, 40, 10), (9, 1, 12), (12, 5, 8), (14, 17, 6))
HIT = (7, 1)  # ARRIVALS[7]'s prompt is the start of ARRIVALS[1]'s


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("qwen3_5_moe_text", seed=3)


def tight_pool(ckpt: Path, requests: int, kv_blocks: int, **args: object) -> int:
    """A page pool (bytes) that holds every expert, `requests` requests' state pages, `kv_blocks` KV blocks and one
    huge page of slack; page sizes from a CPU engine of the same dtype (the geometry does not depend on the device)."""
    probe = LLM(str(ckpt), gpu_memory_budget="1GiB", device="cpu", max_num_batched_tokens=CHUNK, enforce_eager=True,
                **args)
    e = probe.engine
    assert e.state is not None
    geo = e.geometry
    experts = 3 * e.runtime.cache.total_experts * geo.size(EXPERT)
    pool = experts + requests * e.state.request_bytes + kv_blocks * e.kv.num_layers * geo.size("kv") + geo.huge_size
    probe.shutdown()
    return pool


class Launches:
    """Counts the engine's launches by what they schedule: pure decode (every request one sampled token) or not, and
    the pure-decode ones with state copies (a prefix hit's snapshot) queued before them."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pure_decode = self.other = self.decode_after_copies = 0
        launch = engine.runner.launch

        def counted(sched: SchedulerOutput, trace: StepTrace) -> SampledTokens:
            if all(s.num_new_tokens == 1 and s.samples for s in sched.scheduled):
                self.pure_decode += 1
                self.decode_after_copies += bool(sched.state_copies)
            else:
                self.other += 1
            return launch(sched, trace)

        monkeypatch.setattr(engine.runner, "launch", counted)


def serve(engine: LLMEngine) -> dict[str, list[int]]:
    """Greedy tokens of ARRIVALS' requests, each added at its step of the engine's loop."""
    prompts = random_prompts(tuple(n for _, n, _ in ARRIVALS), seed=41)
    hit, source = HIT
    prompts[hit] = prompts[source][: len(prompts[hit])]
    todo = list(enumerate(ARRIVALS))
    done: dict[str, list[int]] = {}
    step = 0
    while todo or engine.has_unfinished_requests():
        while todo and todo[0][1][0] <= step:
            i, (_, _, max_tokens) = todo.pop(0)
            engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                  ignore_eos=True))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert sorted(done) == [str(i) for i in range(len(ARRIVALS))]
    assert all(len(done[str(i)]) == a[2] for i, a in enumerate(ARRIVALS))
    return done


# ---------------------------------------------------------------------------------------------- the static batch

def _llm(ckpt: Path, lengths: tuple[int, ...]) -> LLM:
    """A CPU engine with one request per prompt length added, nothing run yet."""
    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=64, max_num_seqs=SEQS)
    for i, p in enumerate(random_prompts(lengths, seed=42)):
        llm.engine.add_request(str(i), p, SamplingParams(max_tokens=4, ignore_eos=True))
    return llm


def _graphs_for(engine: LLMEngine, hybrid: bool = True) -> StepGraphs:
    """Graphs at the engine's limits, not captured (the ladders and static buffers only)."""
    runner, cfg = engine.runner, engine.config
    return StepGraphs(engine.model, engine.device, runner.num_layers, cfg.max_num_seqs, engine.max_model_len,
                      cfg.block_size, cfg.max_num_batched_tokens,
                      num_linear_layers=runner.num_linear_layers if hybrid else 0)


def test_a_decode_step_fills_the_live_rows_state_pages_and_minus_one_in_padding(ckpt: Path) -> None:
    llm = _llm(ckpt, (5, 9, 3))
    engine = llm.engine
    engine.step()  # every prompt in one step: the next schedule is pure decode
    sched = engine.scheduler.schedule()
    runner = engine.runner
    L_lin = len(engine.spec.linear_layer_ids)
    graphs = _graphs_for(engine)
    assert graphs.ssm_pages is not None and graphs.conv_pages is not None
    assert graphs.ssm_pages.shape == graphs.conv_pages.shape == (L_lin, SEQS)
    assert bool((graphs.ssm_pages == -1).all()) and bool((graphs.conv_pages == -1).all())  # as captured
    runner.use_cuda_graphs(graphs)
    assert runner.step_kind(sched) == "decode-graph"
    reqs = [s.request for s in sched.scheduled]
    bp = graphs.padded_size(len(reqs))
    assert (len(reqs), bp) == (3, 4)
    h = runner.host_arrays(sched, pad_to=bp)
    ids, pos, _, seq_lens, bt, slots, _, ssm, conv = runner.to_device(h)
    graphs.ssm_pages.fill_(99)  # a previous, larger step's rows
    graphs.conv_pages.fill_(99)
    assert graphs.fill_decode(ids, pos, seq_lens, bt, slots, ssm, conv) == bp
    want_ssm = torch.tensor([r.ssm_pages for r in reqs], dtype=torch.int64).T  # [L_lin, 3]
    want_conv = torch.tensor([r.conv_pages for r in reqs], dtype=torch.int64).T
    assert torch.equal(graphs.ssm_pages[:, :3], want_ssm) and torch.equal(graphs.conv_pages[:, :3], want_conv)
    assert len(set(want_ssm.flatten().tolist())) == 3 * L_lin and bool((want_ssm >= 0).all())
    assert graphs.ssm_pages[:, 3].tolist() == graphs.conv_pages[:, 3].tolist() == [-1] * L_lin  # the padding row
    assert bool((graphs.ssm_pages[:, bp:] == 99).all())  # rows past the graph's are not its to read
    batch = graphs.batch(bp)
    assert batch.ssm_pages is not None and batch.conv_pages is not None
    assert batch.ssm_pages.shape == batch.conv_pages.shape == (L_lin, bp)
    assert batch.ssm_pages.data_ptr() == graphs.ssm_pages.data_ptr()  # the graph reads the buffer itself
    # has_initial_state inside the graph: context beyond the one new token; the padding row's context is 1 (fresh)
    assert batch.seq_lens.tolist() == [len(r.prompt_token_ids) + 1 for r in reqs] + [1]
    with pytest.raises(ValueError, match="ssm_pages and conv_pages"):
        graphs.fill_decode(ids, pos, seq_lens, bt, slots)
    with pytest.raises(ValueError, match="ssm_pages and conv_pages"):
        _graphs_for(engine, hybrid=False).fill_decode(ids, pos, seq_lens, bt, slots, ssm, conv)


def test_a_mixed_step_fills_the_mixed_graphs_static_batch(ckpt: Path) -> None:
    llm = _llm(ckpt, (5, 9))
    engine = llm.engine
    graphs = _graphs_for(engine)
    assert graphs.token_sizes == [32, 64] and graphs.sizes == [1, 2, 4, 8]  # a mixed ladder for a hybrid too
    engine.runner.use_cuda_graphs(graphs)
    engine._take_inbox()
    prefill = engine.scheduler.schedule()
    assert engine.runner.step_kind(prefill) == "prefill-graph" and graphs.can_run_mixed(prefill)

    llm = _llm(ckpt, (5, 9))
    engine = llm.engine
    engine.step()  # the prompts, eagerly: the two requests decode next
    engine.add_request("new", random_prompts((20,), seed=43)[0], SamplingParams(max_tokens=2))
    engine._take_inbox()
    mixed = engine.scheduler.schedule()
    n = [s.num_new_tokens for s in mixed.scheduled]
    assert n[:2] == [1, 1] and n[2] > 1  # the two decodes and a chunk of the new prompt
    graphs = _graphs_for(engine)
    runner = engine.runner
    runner.use_cuda_graphs(graphs)
    assert not graphs.can_run(mixed) and graphs.can_run_mixed(mixed)
    assert runner.step_kind(mixed) == "mixed-graph"
    tp = graphs.padded_tokens(sum(n))
    h = runner.host_arrays(mixed, pad_tokens=tp, pad_seqs=SEQS)
    assert h.layout is not None and (h.layout.num_decodes, h.layout.num_seqs) == (2, 3)
    assert h.layout.num_tokens == sum(n) and h.layout.max_prefill_len == n[2]
    ids, pos, qsl, seq_lens, bt, slots, li, qts, ssm, conv = runner.to_device(h)
    L_lin = len(engine.spec.linear_layer_ids)
    assert ssm.shape == conv.shape == (L_lin, SEQS)
    reqs = [s.request for s in mixed.scheduled]
    assert ssm[:, :3].T.tolist() == [r.ssm_pages for r in reqs] and bool((ssm[:, 3:] == -1).all())
    assert graphs.mixed_graphs == {}
    with pytest.raises(ValueError, match="no mixed graph captured"):
        graphs.run_mixed(h.num_sampled, ids, pos, qsl, seq_lens, bt, slots, li, qts, ssm, conv, h.layout)
    graphs.mixed_graphs[tp] = NoReplay()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="ssm_pages, conv_pages and the layout"):
        graphs.run_mixed(h.num_sampled, ids, pos, qsl, seq_lens, bt, slots, li, qts)
    graphs.ssm_pages.fill_(99)
    graphs.conv_pages.fill_(99)
    graphs.logits_out = torch.zeros(SEQS, engine.spec.vocab_size)
    graphs.run_mixed(h.num_sampled, ids, pos, qsl, seq_lens, bt, slots, li, qts, ssm, conv, h.layout)
    assert torch.equal(graphs.ssm_pages[:, :SEQS], ssm) and torch.equal(graphs.conv_pages[:, :SEQS], conv)
    batch = graphs.mixed_batch(tp)
    assert batch.padded and batch.layout is None and batch.ssm_pages is not None
    assert batch.ssm_pages.shape == (L_lin, SEQS) and batch.ssm_pages.data_ptr() == graphs.ssm_pages.data_ptr()


class NoReplay:
    def replay(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------- serving, on the CPU

class EagerReplay:
    """Stands in for a captured decode graph of `bs` rows on the CPU: a replay is an eager pass over the graphs'
    static batch (the buffers the captured kernels read), its logits into the graphs' logits buffer."""

    def __init__(self, graphs: StepGraphs, bs: int) -> None:
        self.graphs, self.bs = graphs, bs

    def replay(self) -> None:
        g = self.graphs
        batch = g.batch(self.bs)
        if g.counter is not None:  # as the capture: padding rows (slot -1) count no routing
            g.counter.row_mask = batch.slot_mapping[0] >= 0
        try:
            hidden = g.model(batch)  # [bs, d]
        finally:
            if g.counter is not None:
                g.counter.row_mask = None
        logits = g.model.compute_logits(hidden[batch.logits_indices])  # [bs, V]
        if g.logits_out is None:
            g.logits_out = torch.empty(max(g.max_seqs, g.max_bs), logits.shape[1])
        g.logits_out[: self.bs].copy_(logits)


class EagerMixedReplay(PiecewiseGraph):
    """Stands in for a captured mixed graph of `tokens` rows on the CPU: an eager pass over the graphs' static mixed
    batch, a hybrid's gated DeltaNet layers' eager stretches run with the step's layout (as between a replay's
    pieces)."""

    def __init__(self, graphs: StepGraphs, tokens: int) -> None:
        super().__init__()
        self.graphs, self.tokens = graphs, tokens
        self.layouts: list[StepLayout | None] = []

    def replay(self, layout: StepLayout | None = None) -> None:
        g = self.graphs
        batch = g.mixed_batch(self.tokens)
        state_cache = g.model.state_cache
        assert (state_cache is None) == (layout is None)  # a layout for a hybrid's stretches, and only for them
        self.layouts.append(layout)
        if state_cache is not None:
            state_cache.step_layout = layout
        if g.counter is not None:
            g.counter.row_mask = batch.slot_mapping[0] >= 0
        try:
            hidden = g.model(batch)  # [tokens, d]
        finally:
            if state_cache is not None:
                state_cache.step_layout = None
            if g.counter is not None:
                g.counter.row_mask = None
        logits = g.model.compute_logits(hidden[batch.logits_indices])  # [S, V]
        if g.logits_out is None:
            g.logits_out = torch.empty(max(g.max_seqs, g.max_bs), logits.shape[1])
        g.logits_out[: logits.shape[0]].copy_(logits)


class EagerSinglePrefillReplay(EagerMixedReplay):
    """Stands in for a captured single-prefill mixed graph on the CPU: an eager pass over the static mixed batch with
    no layout at all, its one prefill sequence found on the device and run in a static window (as captured)."""

    def replay(self, layout: StepLayout | None = None) -> None:
        assert layout is None  # a whole graph: nothing of the step is handed to it
        state_cache = self.graphs.model.state_cache
        assert state_cache is not None
        state_cache.single_prefill = True
        try:
            super().replay(StepLayout(0, 0, 0, 0))  # recorded, never read: the window path takes no layout
        finally:
            state_cache.single_prefill = False


def replay_through_static_buffers(engine: LLMEngine, single_prefill: bool = False) -> StepGraphs:
    """Decode and mixed "graphs" for a CPU engine, each an eager pass over the static buffers (EagerReplay,
    EagerMixedReplay, and with `single_prefill` EagerSinglePrefillReplay for steps of one prefill sequence), over
    the runtime's routing counter."""
    runner, cfg = engine.runner, engine.config
    graphs = StepGraphs(engine.model, engine.device, runner.num_layers, cfg.max_num_seqs, engine.max_model_len,
                        cfg.block_size, cfg.max_num_batched_tokens, counter=engine.runtime.graph_plan().counter,
                        num_linear_layers=runner.num_linear_layers)
    graphs.graphs.update({bs: EagerReplay(graphs, bs) for bs in graphs.sizes})
    graphs.mixed_graphs.update({t: EagerMixedReplay(graphs, t) for t in graphs.token_sizes})
    if single_prefill:
        graphs.single_prefill_graphs.update({t: EagerSinglePrefillReplay(graphs, t)  # type: ignore[misc]
                                             for t in graphs.token_sizes})
    runner.use_cuda_graphs(graphs)
    return graphs


# name: (engine arguments, the pool: tight_pool's (requests, KV blocks), or None for a roomy budget)
MODES = {
    "static": ({"offload_mode": "static"}, (3, 5)),  # preemptions: requests recompute their state
    "elastic-direct": ({"offload_mode": "elastic", "offload_access": "direct", "adjuster": "paper",
                        "expert_offload_limit": 5}, (1, 6)),  # experts evicted for state pages, read in host memory
    # offloaded experts copied (piecewise graphs on the GPU; every expert on the GPU's kernel, as the replays do);
    # room for HIT's snapshot
    "fixed-copy": ({"offload_mode": "fixed", "offload_access": "copy", "resident_experts": 4,
                    "cpu_expert_compute": "off"}, None),
    # evictions with copies: piecewise graphs while an expert is offloaded, the resident-tables ones otherwise
    "elastic-copy": ({"offload_mode": "elastic", "offload_access": "copy", "adjuster": "paper",
                      "expert_offload_limit": 5, "cpu_expert_compute": "off"}, (1, 6)),
}


def _memory(ckpt: Path, mode: str, **probe_args: object) -> dict[str, object]:
    room = MODES[mode][1]
    if room is None:
        return {"gpu_memory_budget": "1GiB"}
    return {"page_pool_memory_bytes": tight_pool(ckpt, *room, **probe_args)}


def _mode_did_its_part(mode: str, stats: dict, launches: Launches) -> None:
    """What each mode's run is there for happened: preemptions (static), evictions (elastic), copies and a prefix hit
    that leaves a decode step a state copy to run first (fixed)."""
    if mode == "static":
        assert stats["preemptions"] > 0, stats
    elif mode.startswith("elastic"):
        assert stats["expert_evictions"] > 0 and stats["peak_running"] > 1, stats
    else:
        assert stats["expert_bytes_loaded"] > 0 and stats["prefix_cache_hits"] > 0, stats
        assert launches.decode_after_copies > 0
    assert launches.other > 0 and launches.pure_decode > 0


@pytest.mark.parametrize("single_prefill", [False, True], ids=["cut", "single-prefill"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_serving_through_the_static_buffers_decodes_the_eager_tokens(ckpt: Path, mode: str, single_prefill: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    args = MODES[mode][0]
    memory = _memory(ckpt, mode)
    got = {}
    for through_graphs in (False, True):
        llm = LLM(str(ckpt), device="cpu", max_num_batched_tokens=CHUNK, max_num_seqs=SEQS, async_scheduling=True,
                  **memory, **args)
        engine = llm.engine
        cache = engine.model.state_cache
        assert cache is not None
        cache.in_place_decode = True  # the GPU's decode path (the paged kernels' torch references here)
        graphs = replay_through_static_buffers(engine, single_prefill) if through_graphs else None
        launches = Launches(engine, monkeypatch)
        got[through_graphs] = serve(engine)
        _mode_did_its_part(mode, llm.stats(), launches)
        if graphs is not None:  # every step through the buffers: the pure-decode ones decode graphs, the rest mixed
            assert engine.runner.graph_steps == launches.pure_decode + launches.other
            assert engine.runner.mixed_graph_steps == launches.other
            # with them, steps of one prefill sequence took the single-prefill graphs, only the others the cut ones
            assert (graphs.single_prefill_replays > 0) == single_prefill
            cut = [lay for g in graphs.mixed_graphs.values() for lay in g.layouts]  # type: ignore[attr-defined]
            assert not single_prefill or all(lay.num_prefills != 1 for lay in cut)
        assert_nothing_held(engine)
        llm.shutdown()
    assert got[True] == got[False]


# ---------------------------------------------------------------------------------------------- the capture's cuts

@pytest.mark.parametrize("mode", ["static", "fixed-copy"])
def test_a_mixed_capture_is_cut_at_every_deltanet_layer(ckpt: Path, mode: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The cuts of a hybrid mixed pass's capture, in pass order: one eager stretch per gated DeltaNet layer, and with
    copies also one expert-table decision per MoE layer; each stretch runs the chunk form with the replay's layout."""
    import rimuru.engine.piecewise_graphs as pw

    monkeypatch.setattr(pw.torch.cuda, "CUDAGraph", StandInPiece)
    llm = LLM(str(ckpt), device="cpu", max_num_batched_tokens=CHUNK, max_num_seqs=SEQS, **_memory(ckpt, mode),
              **MODES[mode][0])
    engine = llm.engine
    plan = engine.runtime.graph_plan()
    boundaries = pw.ExpertTableBoundaries.over(plan.piecewise, engine.model) if plan.piecewise is not None else None
    assert (boundaries is not None) == (mode == "fixed-copy")
    runner, cfg = engine.runner, engine.config
    graphs = StepGraphs(engine.model, engine.device, runner.num_layers, cfg.max_num_seqs, engine.max_model_len,
                        cfg.block_size, cfg.max_num_batched_tokens, counter=plan.counter, boundaries=boundaries,
                        num_linear_layers=runner.num_linear_layers)
    state_cache = engine.model.state_cache
    assert state_cache is not None
    state_cache.in_place_decode = True
    if boundaries is not None:
        boundaries.install()
        # the captured MoE kernels read the static tables; the CPU's reference refuses the offloaded experts' -1
        # rows that the GPU kernel skips: point them at a resident expert's pages for this eager stand-in
        for table in boundaries.active:
            resident = table[:, 0] >= 0
            table[~resident] = table[resident][0]
    state_cache.capture = graphs.pieces
    try:
        with torch.inference_mode():
            graph = graphs._capture_pieces(graphs.mixed_batch(graphs.token_sizes[-1]), boundaries is not None)
    finally:
        state_cache.capture = None
        if boundaries is not None:
            boundaries.uninstall()
    kinds = ["L" if isinstance(b, EagerCut) else "M" for b in graph.boundaries]
    types = engine.spec.layer_types
    want = "".join(("L" if t == "linear_attention" else "") + ("M" if boundaries is not None else "") for t in types)
    assert "".join(kinds) == want  # the layer's stretch, then its MoE layer's decision
    assert len(graph.pieces) == len(kinds) + 1 and all(p.began and p.ended for p in graph.pieces)
    assert graph.has_table_decisions == (boundaries is not None)
    assert all(b.moe_layer == i for i, b in enumerate(b for b in graph.boundaries if isinstance(b, Boundary)))
    # the stretches are the state cache's prefill_rows of each layer, over the static batch, awaiting a layout
    stretches = [b.run for b in graph.boundaries if isinstance(b, EagerCut)]
    assert all(r.func == state_cache._stretch for r in stretches)  # type: ignore[attr-defined]
    assert [r.args[1] for r in stretches] == list(range(len(engine.spec.linear_layer_ids)))  # type: ignore[attr-defined]
    for r in stretches:  # the graphs' static batch: the buffers each step fills
        assert r.args[2].padded and r.args[2].input_ids.data_ptr() == graphs.input_ids.data_ptr()  # type: ignore
    seen: list[StepLayout | None] = []
    for cut in graph.boundaries:
        if isinstance(cut, EagerCut):
            cut.run = seen.append  # a replay hands each stretch the step's layout, in order
    layout = StepLayout(0, 1, 1, 1)
    if boundaries is None:
        graph.replay(layout)
        assert seen == [layout] * kinds.count("L")
    else:
        with pytest.raises(RuntimeError, match="expert-table decisions"):
            graph.replay(layout)


# ---------------------------------------------------------------------------------------------- the GPU

BF16_TIE = 0.25  # a top-2 logprob gap within bf16 rounding of the tiny models' logits (tests/test_cpu_expert_tier.py)


def _cuda_serve(ckpt: Path, mode: str, dtype: str, eager: bool, monkeypatch: pytest.MonkeyPatch,
                memory: dict[str, object]) -> dict[str, list[int]]:
    args = MODES[mode][0]
    llm = LLM(str(ckpt), device="cuda", dtype=dtype, enforce_eager=eager, max_num_batched_tokens=CHUNK,
              max_num_seqs=SEQS, **memory, **args)
    engine, runner = llm.engine, llm.engine.runner
    assert engine.async_scheduling
    launches = Launches(engine, monkeypatch)
    got = serve(engine)
    _mode_did_its_part(mode, llm.stats(), launches)
    if eager:
        assert runner.graphs is None and runner.graph_steps == 0
    else:
        graphs = runner.graphs
        assert graphs is not None and graphs.token_sizes and graphs.ssm_pages is not None
        assert (graphs.boundaries is not None) == mode.endswith("copy")  # piecewise with copies
        assert all(isinstance(g, PiecewiseGraph) for g in graphs.mixed_graphs.values())  # cut at the DeltaNets
        # elastic with copies, where the pool can hold every expert again: mixed graphs over the resident tables too,
        # cut at the DeltaNets only
        assert bool(graphs.whole_mixed_graphs) == (graphs.resident_provider is not None)
        assert all(isinstance(g, PiecewiseGraph) and not g.has_table_decisions
                   for g in graphs.whole_mixed_graphs.values())
        # every step a replay: pure-decode steps decode graphs, the others (chunks, beside decodes or not) mixed
        assert runner.graph_steps == launches.pure_decode + launches.other
        assert runner.mixed_graph_steps == launches.other
        # without table cuts, whole graphs for the steps of one prefill sequence (its DeltaNet prefill captured in a
        # static window), and this serving had such steps
        assert bool(graphs.single_prefill_graphs) == (graphs.boundaries is None)
        assert (graphs.single_prefill_replays > 0) == (graphs.boundaries is None)
    assert_nothing_held(engine)
    llm.shutdown()  # one engine on the GPU at a time
    return got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", sorted(MODES))
def test_cuda_graphs_give_the_eager_tokens(ckpt: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured graphs (decode graphs whole in static and elastic-direct mode, piecewise with copies, elastic's whole
    ones over the resident tables too; mixed graphs cut at every gated DeltaNet layer, and at the table decisions
    with copies; without copies whole single-prefill ones too) against the same engine run eagerly, float32: the
    same greedy tokens, every step a replay, nothing held after."""
    memory = _memory(ckpt, mode, dtype="float32")
    eager = _cuda_serve(ckpt, mode, "float32", True, monkeypatch, memory)
    assert _cuda_serve(ckpt, mode, "float32", False, monkeypatch, memory) == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["static", "fixed-copy"])
def test_cuda_bf16_graphs_give_the_eager_tokens_up_to_a_near_tie(ckpt: Path, mode: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 (fla-core's chunk kernel where installed): graphs against eager, the same greedy tokens up to a
    near-tie: where a sequence first differs, the eager engine's top-2 logprobs there are within BF16_TIE (a graph's
    GEMMs of padded rows may round differently), and the rest of that sequence is not compared."""
    memory = _memory(ckpt, mode, dtype="bfloat16")
    eager = _cuda_serve(ckpt, mode, "bfloat16", True, monkeypatch, memory)
    graphs = _cuda_serve(ckpt, mode, "bfloat16", False, monkeypatch, memory)
    prompts = random_prompts(tuple(n for _, n, _ in ARRIVALS), seed=41)
    hit, source = HIT
    prompts[hit] = prompts[source][: len(prompts[hit])]
    differ = [(i, next(j for j, (a, b) in enumerate(zip(graphs[str(i)], eager[str(i)], strict=True)) if a != b))
              for i in range(len(ARRIVALS)) if graphs[str(i)] != eager[str(i)]]
    if differ:
        llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", enforce_eager=True, max_num_batched_tokens=CHUNK,
                  max_num_seqs=SEQS, **memory, **MODES[mode][0])
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2)
        for i, j in differ:
            top = llm.generate([{"prompt_token_ids": prompts[i] + eager[str(i)][:j]}], one)[0].outputs[0].logprobs[0]
            first, second = sorted((lp.logprob for lp in top.values()), reverse=True)[:2]
            assert first - second < BF16_TIE, (f"request {i} token {j}: graphs {graphs[str(i)]}, eager "
                                               f"{eager[str(i)]}, top-2 logprob gap {first - second:.3g}")
        llm.shutdown()
    assert len(differ) <= len(ARRIVALS) // 2, differ  # near-ties are the exception


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_elastic_copies_replay_resident_mixed_graphs(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Elastic with copies and room for every expert: passes replay the graphs over the resident tables, the mixed
    ones cut at the gated DeltaNet layers only; the eager engine's tokens, float32."""
    args = {"offload_mode": "elastic", "offload_access": "copy", "adjuster": "paper", "cpu_expert_compute": "off"}
    got = {}
    for eager in (True, False):
        llm = LLM(str(ckpt), device="cuda", dtype="float32", enforce_eager=eager, max_num_batched_tokens=CHUNK,
                  max_num_seqs=SEQS, gpu_memory_budget="1GiB", **args)
        engine = llm.engine
        launches = Launches(engine, monkeypatch)
        got[eager] = serve(engine)
        if not eager:
            graphs = engine.runner.graphs
            assert graphs is not None and graphs.resident_provider is not None and graphs.whole_mixed_graphs
            assert all(isinstance(g, PiecewiseGraph) and not g.has_table_decisions
                       for g in graphs.whole_mixed_graphs.values())
            assert graphs.whole_replays > 0 and engine.runner.mixed_graph_steps == launches.other > 0
        assert_nothing_held(engine)
        llm.shutdown()
    assert got[False] == got[True]
