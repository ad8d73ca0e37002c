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

import torch

from rimuru import LLM
from rimuru.engine.piecewise_graphs import Boundary, EagerCut, ExpertTableBoundaries, PiecewiseGraph
from rimuru.models.forward_batch import StepLayout
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
