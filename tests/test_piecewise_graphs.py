"""Piecewise CUDA graphs' host side (engine/piecewise_graphs.py), on the CPU with stand-in graph pieces.

What runs between two replayed pieces is the offloading provider's real decision: a layer with experts in host
memory gets `provider.table()` (with the captured routing ids, the captured prediction for the next layer and the
row mask that keeps padding rows out), and its table is copied into the static `active` tables the captured MoE
kernels read; a fully resident layer is not asked (no host read); an eager stretch between two pieces (a hybrid
model's gated DeltaNet prefill rows) runs in pass order with the step's layout. The captured pieces themselves run on
the GPU (tests/test_offload.py, tests/test_elastic.py, tests/test_hybrid_graphs.py, `-m gpu`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rimuru import LLM
from rimuru.engine.piecewise_graphs import Boundary, EagerCut, ExpertTableBoundaries, PiecewiseGraph
from rimuru.models.forward_batch import StepLayout
from rimuru.testing.graph_pieces import StandInPiece
from rimuru.testing.tiny_models import make_tiny_checkpoint


class FakePiece:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def replay(self) -> None:
        self.log.append(self.name)


def test_boundaries_ask_the_provider_only_for_layers_with_offloaded_experts(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "m", seed=1)
    llm = LLM(str(path), device="cpu", gpu_memory_budget="64MiB", offload_mode="fixed", offload_access="copy",
              resident_experts=4)
    eng = llm.engine
    provider, cache = eng.runtime.provider, eng.runtime.cache
    L, E = cache.num_layers, cache.num_experts
    assert L >= 2
    # make layer 1 fully resident, keep layer 0 with offloaded experts
    cache.make_resident([(1, e) for e in range(E) if not cache.residency.is_resident(1, e)])
    assert bool((cache.host_tables[1, :, 0] >= 0).all()) and not bool((cache.host_tables[0, :, 0] >= 0).all())
    bounds = ExpertTableBoundaries.over(provider, eng.model)
    calls: list[tuple] = []
    real_table = provider.table

    def spy(layer: int, ids: torch.Tensor) -> torch.Tensor:
        calls.append((layer, ids.tolist(), provider.row_mask.tolist(), provider._prediction))
        return real_table(layer, ids)

    provider.table = spy  # type: ignore[method-assign]
    offloaded = [e for e in range(E) if not cache.residency.is_resident(0, e)]
    ids0 = torch.tensor([[offloaded[0], 0], [1, 2], [offloaded[1], 3]])  # [T=3, k=2]; row 2 is padding
    ids1 = torch.tensor([[0, 1], [2, 3], [4, 0]])
    pred = (1, torch.zeros(E))
    log: list[str] = []
    graph = PiecewiseGraph(pieces=[FakePiece(log, f"p{i}") for i in range(3)],  # type: ignore[misc]
                           boundaries=[Boundary(0, ids0, pred), Boundary(1, ids1, None)],
                           row_mask=torch.tensor([True, True, False]))
    bounds.active.fill_(-7)
    bounds.replay(graph)
    assert log == ["p0", "p1", "p2"]
    assert [c[0] for c in calls] == [0]  # layer 1 is fully resident: no provider call, no host read
    layer, ids, mask, prediction = calls[0]
    assert ids == ids0.tolist() and mask == [True, True, False] and prediction is pred
    assert (bounds.skipped_waits, bounds.host_waits) == (1, 1)
    assert torch.equal(bounds.active[1], cache.tables[1])
    act0 = bounds.active[0]
    assert bool((act0[offloaded[0]] >= 0).all())  # routed by a real row: loaded, addressable
    assert int(act0[offloaded[1], 0]) == -1  # routed only by the padding row: not loaded
    assert provider.row_mask is None and provider._prediction is None  # nothing left behind
    assert eng.runtime.loader.counters.experts_loaded >= 1


def test_predictor_ignores_padding_rows(tmp_path: Path) -> None:
    """Captured predictions must not prefetch experts that only padding rows of a padded batch would use."""
    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "m", seed=1)
    llm = LLM(str(path), device="cpu", gpu_memory_budget="64MiB", offload_mode="fixed", offload_access="copy",
              resident_experts=4)
    predictor = llm.engine.runtime.provider.predictor
    g = torch.Generator().manual_seed(0)
    d = llm.engine.spec.hidden_size
    real, pad = torch.randn(3, d, generator=g), torch.randn(5, d, generator=g)
    mask = torch.tensor([True] * 3 + [False] * 5)
    masked = predictor.scores(1, torch.cat([real, pad]), mask)
    torch.testing.assert_close(masked, predictor.scores(1, real))
    assert not torch.allclose(predictor.scores(1, torch.cat([real, pad])), masked)


def test_eager_stretches_run_in_pass_order_with_the_steps_layout(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "m", seed=1)
    llm = LLM(str(path), device="cpu", gpu_memory_budget="64MiB", offload_mode="fixed", offload_access="copy",
              resident_experts=4)
    eng = llm.engine
    provider, cache = eng.runtime.provider, eng.runtime.cache
    cache.make_resident([(m, e) for m in range(cache.num_layers) for e in range(cache.num_experts)
                         if not cache.residency.is_resident(m, e)])  # every boundary takes the resident path
    bounds = ExpertTableBoundaries.over(provider, eng.model)
    log: list[object] = []
    ids = torch.zeros(2, 2, dtype=torch.int64)
    graph = PiecewiseGraph(pieces=[FakePiece(log, f"p{i}") for i in range(5)],  # type: ignore[misc]
                           boundaries=[EagerCut(lambda lay: log.append(("s0", lay))), Boundary(0, ids, None),
                                       EagerCut(lambda lay: log.append(("s1", lay))), Boundary(1, ids, None)],
                           row_mask=torch.tensor([True, False]))
    assert graph.has_table_decisions
    layout = StepLayout(1, 2, 4, 3)
    bounds.replay(graph, layout=layout)
    assert log == ["p0", ("s0", layout), "p1", "p2", ("s1", layout), "p3", "p4"]
    assert bounds.skipped_waits == 2 and bounds.host_waits == 0
    stretches_only = PiecewiseGraph(pieces=[FakePiece(log, "q0"), FakePiece(log, "q1")],  # type: ignore[list-item]
                                    boundaries=[EagerCut(lambda lay: log.append(("s", lay)))])
    log.clear()
    stretches_only.replay(layout)  # no table decision: the graph replays itself
    assert log == ["q0", ("s", layout), "q1"]


class MoePiece:
    """Stands in for a captured piece holding MoE layer 0's kernel: at replay it writes the kernel's output for the
    static rows into the static `out`, reading whatever table the boundary put in `active` (rows -1 skipped)."""

    def __init__(self, log: list[str], bounds: ExpertTableBoundaries, f: int, hidden: torch.Tensor,
                 weights: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        self.log, self.bounds, self.f = log, bounds, f
        self.hidden, self.weights, self.ids, self.out = hidden, weights, ids, out

    def replay(self) -> None:
        from rimuru.kernels.fused_moe import fused_moe_reference

        self.log.append("moe")
        self.out.copy_(fused_moe_reference(self.hidden, self.weights, self.ids, self.bounds.expert_view,
                                           self.bounds.active[0], self.f, skip_absent=True))


def test_a_host_join_adds_the_host_tiers_experts_into_the_kernels_output(tmp_path: Path) -> None:
    """With a host tier the replay's table decision leaves routed offloaded experts to the host (rows -1 in the
    active table), starts their job before the kernel's piece, and the HostJoin after it adds them into the
    kernel's static output: the same numbers as the eager path (table, host job, kernel, join)."""
    from rimuru.engine.piecewise_graphs import HostJoin
    from rimuru.kernels.fused_moe import fused_moe_reference

    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "m", seed=3)
    llm = LLM(str(path), device="cpu", gpu_memory_budget="64MiB", offload_mode="fixed", offload_access="copy",
              resident_experts=4, cpu_expert_compute="on")
    eng = llm.engine
    provider, cache = eng.runtime.provider, eng.runtime.cache
    assert provider.host_tier is not None
    bounds = ExpertTableBoundaries.over(provider, eng.model)
    assert bounds.host_joins
    spec, f = eng.spec, eng.spec.moe_intermediate_size
    E, k = cache.num_experts, spec.num_experts_per_tok
    offloaded = [e for e in range(E) if not cache.residency.is_resident(0, e)]
    g = torch.Generator().manual_seed(5)
    T = 4
    hidden = torch.randn(T, spec.hidden_size, generator=g)
    ids = torch.stack([torch.tensor([offloaded[t % len(offloaded)], t % 2]) for t in range(T)])[:, :k]
    weights = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    out = torch.full((T, spec.hidden_size), float("nan"))
    log: list[str] = []
    graph = PiecewiseGraph(pieces=[FakePiece(log, "p0"), MoePiece(log, bounds, f, hidden, weights, ids, out),
                                   FakePiece(log, "p2")],  # type: ignore[list-item]
                           boundaries=[Boundary(0, ids, None, hidden, weights), HostJoin(0, out)],
                           row_mask=torch.ones(T, dtype=torch.bool))
    before = provider.host_tier.counters.experts
    bounds.replay(graph)
    assert log == ["p0", "moe", "p2"]
    computed = provider.host_tier.counters.experts - before
    assert computed == len({int(e) for e in ids.flatten()} & set(offloaded)) > 0  # "on": every candidate
    assert all(int(bounds.active[0][e, 0]) == -1 for e in offloaded)  # left to the host, not loaded
    # the eager path over the same rows
    table = provider.table(0, ids)
    job = provider.host_experts(0, hidden, weights, ids)
    assert job is not None
    eager = job.join(fused_moe_reference(hidden, weights, ids, provider.expert_view, table, f, skip_absent=True))
    assert torch.equal(out, eager)
    # and every expert resident: the layer's full MoE
    store = eng.runtime.store
    full = torch.zeros_like(out)
    for t in range(T):
        for j in range(k):
            w1, w3, w2 = (store.expert(0, int(ids[t, j]))[i].view(-1, spec.hidden_size) for i in range(3))
            h = torch.nn.functional.silu(hidden[t] @ w1.T) * (hidden[t] @ w3.T)
            full[t] += weights[t, j] * (w2.view(spec.hidden_size, -1) @ h)
    torch.testing.assert_close(out, full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tier", ["on", "off"])
def test_a_capture_with_a_host_tier_cuts_after_every_moe_kernel(tier: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture's cuts with a host tier, in pass order: each MoE layer's table decision (its boundary keeping the
    static rows and weights the host job reads), then a HostJoin on that layer's kernel output; without a tier, the
    decisions only."""
    import rimuru.engine.piecewise_graphs as pw
    from rimuru.engine.cuda_graphs import StepGraphs

    monkeypatch.setattr(pw.torch.cuda, "CUDAGraph", StandInPiece)
    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "m", seed=1)
    llm = LLM(str(path), device="cpu", gpu_memory_budget="64MiB", offload_mode="fixed", offload_access="copy",
              resident_experts=4, cpu_expert_compute=tier, max_num_seqs=4, max_num_batched_tokens=32)
    eng = llm.engine
    plan = eng.runtime.graph_plan()
    assert plan.piecewise is not None
    bounds = pw.ExpertTableBoundaries.over(plan.piecewise, eng.model)
    assert bounds.host_joins == (tier == "on")
    runner, cfg = eng.runner, eng.config
    graphs = StepGraphs(eng.model, eng.device, runner.num_layers, cfg.max_num_seqs, eng.max_model_len,
                        cfg.block_size, cfg.max_num_batched_tokens, counter=plan.counter, boundaries=bounds)
    bounds.install()
    # the CPU's reference refuses the -1 rows the GPU kernel skips: point them at a resident expert for this stand-in
    for table in bounds.active:
        resident = table[:, 0] >= 0
        table[~resident] = table[resident][0]
    try:
        with torch.inference_mode():
            graph = graphs._capture_pieces(graphs.mixed_batch(graphs.token_sizes[-1]), True)
    finally:
        bounds.uninstall()
    kinds = "".join("M" if isinstance(b, Boundary) else "J" if isinstance(b, pw.HostJoin) else "?"
                    for b in graph.boundaries)
    L = eng.runtime.cache.num_layers
    assert kinds == ("MJ" if tier == "on" else "M") * L
    assert len(graph.pieces) == len(kinds) + 1 and all(p.began and p.ended for p in graph.pieces)
    decisions = [b for b in graph.boundaries if isinstance(b, Boundary)]
    joins = [b for b in graph.boundaries if isinstance(b, pw.HostJoin)]
    assert [b.moe_layer for b in decisions] == list(range(L)) and [j.moe_layer for j in joins] == (
        list(range(L)) if tier == "on" else [])
    T = graphs.token_sizes[-1]
    for b in decisions:
        if tier == "on":
            assert b.hidden is not None and b.hidden.shape == (T, eng.spec.hidden_size)
            assert b.topk_weights is not None and b.topk_weights.shape == b.topk_ids.shape
        else:
            assert b.hidden is None and b.topk_weights is None
    assert all(j.out.shape == (T, eng.spec.hidden_size) for j in joins)
