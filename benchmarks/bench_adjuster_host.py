"""Host time of the cost-aware adjuster per engine step: `CostAdjuster.plan` and the two pick functions it calls.

Every engine step the elastic controller builds an `AdjusterState` and calls `plan()`, which orders every
movable expert (`pick_grows(state, n_now)` + `pick_evictions(state, sum of limits)`) and runs the cost model over
the candidate splits. The old picks were heap merges in Python (kept as references in
tests/test_adjuster_picks.py); the new ones are vectorised. Both run here side by side on the same states, with
the results checked equal, for two model shapes:

    qwen3-30b-a3b   48 MoE layers x 128 experts, top_k 8, 9.4 MB experts, limit 64, ~33 offloaded per layer
    qwen1.5-moe     24 MoE layers x 60 experts,  top_k 4, 17.3 MB experts, limit 10, 5 offloaded per layer

States: Zipf-like routing per layer, the committed ranking from an older estimate (so the current probabilities
are not monotone along it), requests waiting and R > 0 with tokens scheduled (the full model runs, no hard
shortfall). `model` is `CostAdjuster._model` alone (same for old and new: it reads the order the picks make).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_adjuster_host.py \
        --output-json benchmarks/results/2026-11-29-adjuster-host-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import rimuru.experts.cost_adjuster as cost_adjuster  # noqa: E402
from benchmarks.common import metadata  # noqa: E402
from rimuru.experts.adjuster import (  # noqa: E402
    AdjusterState,
    eviction_order,
    grow_order,
    pick_evictions,
    pick_grows,
)
from rimuru.experts.cost_adjuster import CostAdjuster, CostAdjusterConfig  # noqa: E402
from tests.test_adjuster_picks import _reference_pick_evictions, _reference_pick_grows  # noqa: E402

COMPUTE_S = 0.012


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    experts: int
    top_k: int
    expert_bytes: int
    limit: int
    offloaded: int  # per layer, about


SHAPES = (
    Shape("qwen3-30b-a3b", 48, 128, 8, 9_400_000, 64, 33),
    Shape("qwen1.5-moe", 24, 60, 4, 17_300_000, 10, 5),
)


def make_state(shape: Shape, seed: int = 0) -> AdjusterState:
    """Like ElasticCore.state builds it: planned residents (sets), the estimate, the committed ranking."""
    rng = np.random.default_rng(seed)
    L, E = shape.layers, shape.experts
    committed = rng.zipf(1.3, size=(L, E)).astype(np.float64) + rng.random((L, E))
    committed /= committed.sum(axis=1, keepdims=True)
    rankings = np.argsort(-committed, axis=1, kind="stable")
    probs = committed * rng.uniform(0.7, 1.3, size=(L, E))  # the estimate has moved since the ranking was made
    probs /= probs.sum(axis=1, keepdims=True)
    resident = []
    for layer in range(L):
        k = int(np.clip(shape.offloaded + rng.integers(-2, 3), 0, shape.limit))
        out = set(rankings[layer, E - k:].tolist())
        if k and layer % 3 == 0:  # a move in flight: not exactly a prefix
            out ^= {int(rankings[layer, E - k - 1]), int(rankings[layer, E - k])}
        resident.append({e for e in range(E) if e not in out})
    n_off = sum(E - len(r) for r in resident)
    return AdjusterState(shortfall_mid_pages=8, free_mid_pages=2, resident=resident, probabilities=probs,
                         rankings=rankings, offload_limit=shape.limit, num_batched_tokens=48, num_running=48,
                         num_waiting=12, num_stalled=0, max_num_seqs=256, kv_mid_pages=float(3 * n_off))


def _flat(experts: list[tuple[int, int]], num_experts: int) -> np.ndarray:
    return np.asarray([layer * num_experts + e for layer, e in experts], dtype=np.int64)


@contextmanager
def picks(old: bool) -> Iterator[None]:
    """CostAdjuster.plan with the reference picks (old: heap merges, as flat ids) or the current ones."""
    saved = cost_adjuster.pick_evictions, cost_adjuster.eviction_order, cost_adjuster.grow_order
    if old:
        cost_adjuster.pick_evictions = _reference_pick_evictions
        cost_adjuster.eviction_order = lambda st, n: _flat(_reference_pick_evictions(st, n), st.rankings.shape[1])
        cost_adjuster.grow_order = lambda st, n: _flat(_reference_pick_grows(st, n), st.rankings.shape[1])
    try:
        yield
    finally:
        cost_adjuster.pick_evictions, cost_adjuster.eviction_order, cost_adjuster.grow_order = saved


def time_call(fn: Callable[[], Any], samples: int, sample_s: float) -> float:
    """Median over samples of the mean time per call (ms); each sample runs back to back for ~sample_s."""
    fn()
    t = time.perf_counter()
    fn()
    per = max(time.perf_counter() - t, 1e-7)
    reps = max(1, int(sample_s / per))
    out = []
    for _ in range(samples):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - t) / reps * 1e3)
    return statistics.median(out)


def adjuster(shape: Shape) -> CostAdjuster:
    return CostAdjuster(CostAdjusterConfig(), expert_bytes=shape.expert_bytes, top_k=shape.top_k,
                        compute_time=lambda _: COMPUTE_S)


def bench_shape(shape: Shape, samples: int, sample_s: float) -> dict[str, Any]:
    state = make_state(shape)
    L = shape.layers
    n_now = sum(shape.experts - len(r) for r in state.resident)
    n_lim = sum(state.limit(layer) for layer in range(L))
    # the same answers first
    assert pick_grows(state, n_now) == _reference_pick_grows(state, n_now)
    assert pick_evictions(state, n_lim) == _reference_pick_evictions(state, n_lim)
    with picks(old=True):
        old_plan = adjuster(shape).plan(state)
    new_a = adjuster(shape)
    new_plan = new_a.plan(state)
    assert old_plan == new_plan, "old and new plans differ"
    assert new_a.last is not None and not new_a.last.hard and new_a.last.candidates, "the model did not run"

    order = np.concatenate([grow_order(state, n_now)[::-1], eviction_order(state, n_lim)])
    cands = new_a._candidates(len(order), n_now, 0)
    rows: dict[str, dict[str, float]] = {}

    def row(name: str, old: Callable[[], Any] | None, new: Callable[[], Any]) -> None:
        rows[name] = {"old_ms": time_call(old, samples, sample_s) if old else None,
                      "new_ms": time_call(new, samples, sample_s)}

    row("pick_grows", lambda: _reference_pick_grows(state, n_now), lambda: pick_grows(state, n_now))
    row("pick_evictions", lambda: _reference_pick_evictions(state, n_lim), lambda: pick_evictions(state, n_lim))
    row("model", None, lambda: new_a._model(state, order, n_now, COMPUTE_S, cands))
    old_a, new_b = adjuster(shape), adjuster(shape)

    def old_plan_call() -> None:
        with picks(old=True):
            old_a.plan(state)

    row("plan", old_plan_call, lambda: new_b.plan(state))
    for r in rows.values():
        r["speedup"] = r["old_ms"] / r["new_ms"] if r["old_ms"] else None
    return {"shape": shape.__dict__, "n_offloaded": n_now, "n_evictable": len(pick_evictions(state, n_lim)),
            "candidates": len(cands), "plan": {"evict": len(new_plan.evict), "grow": len(new_plan.grow)},
            "rows": rows}


def cpu_name() -> str:
    name = platform.processor()
    if not name:
        try:
            name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                        if line.startswith("model name"))
        except (OSError, StopIteration):
            name = platform.machine()
    return f"cpu {name} ({os.cpu_count()} cores)"


def uncommitted_sources() -> list[str]:
    """Files under rimuru/ that differ from the recorded commit (the timed code is the working tree's)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "rimuru"], capture_output=True, text=True,
                             timeout=5, cwd=Path(__file__).resolve().parent.parent).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted(line[3:] for line in out.splitlines() if line.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--sample-ms", type=float, default=100.0)
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args()
    meta = metadata("adjuster_host", compute_time_s=COMPUTE_S, samples=args.samples, sample_ms=args.sample_ms)
    meta["device"] = cpu_name()
    meta["uncommitted_sources"] = uncommitted_sources()
    print(f"{meta['device']}  numpy {np.__version__}  commit {str(meta['git_commit'])[:10]}  {meta['date']}")
    results = {s.name: bench_shape(s, args.samples, args.sample_ms / 1e3) for s in SHAPES}
    print(f"{'shape':<15} {'call':<15} {'old ms':>9} {'new ms':>9} {'speedup':>8}")
    for name, res in results.items():
        for call, r in res["rows"].items():
            old = f"{r['old_ms']:9.3f}" if r["old_ms"] is not None else f"{'-':>9}"
            sp = f"{r['speedup']:7.1f}x" if r["speedup"] is not None else f"{'-':>8}"
            print(f"{name:<15} {call:<15} {old} {r['new_ms']:9.3f} {sp}")
    if args.output_json:
        args.output_json.write_text(json.dumps({**meta, "numpy": np.__version__, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
