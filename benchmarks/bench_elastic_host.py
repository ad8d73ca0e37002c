"""Host time of the expert runtime's per-step calls: elastic mode (direct access) beside static mode.

Every engine step calls its runtime in the same order (experts/runtime.py): begin_step, plan, before_pass,
after_pass, then the allocator's complete_forward. Static mode's calls do nothing; elastic mode's build the
adjuster's state, run or hold its plan, read the pass's routing counts, count the bytes read from host memory and
fold the counts into the popularity estimate. This times those calls alone, without a forward pass, on a CPU
engine of tiny widths but the layer and expert counts of a real model, so the host work per step is that model's:

    qwen1.5   24 MoE layers x 60 experts, top-4 (Qwen1.5-MoE-A2.7B)
    qwen3     48 MoE layers x 128 experts, top-8 (Qwen3-30B-A3B)

The adjuster is given the real model's economics: its expert bytes (17.3 / 9.4 MB), a measured-looking decode
compute of 9 ms, and a pool whose KV holds ~11 expert pages a request (the H200 cell at 32 GiB: 3 expert pages hold
0.29 of a request). Each step's routing counts are a fresh multinomial draw of 40 decode tokens. Scenarios:

    resident      every expert resident, nobody short of pages (a step that moves nothing)
    one-out       one expert offloaded (a hard shortfall evicted it), a queue short of pages: the state elastic
                  mode held for most of the 40 req/s point on the H200 (it admitted the queue with one expert)
    many-out      MANY_OUT experts offloaded the same way, a queue short of pages: the multi-turn chats' state
                  (Qwen1.5-MoE at 32 GiB), where elastic's offloaded decode steps waited 1-3 ms a step on the host
                  beyond their GPU time on the H100 (docs/benchmarks.md section 23)

`--base REF` measures the same scenarios on the tree at git REF too (a temporary worktree, run in a subprocess),
alternating with this tree, so that a change's effect is read side by side in one run; the script's own code runs
on both trees and uses only what both have. Times are this host's (a CPU): compare within a run, never across
machines.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_elastic_host.py --base 86f45ed \\
        --output-json benchmarks/results/YYYY-MM-DD-elastic-host-cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CALLS = ("begin_step", "plan", "before_pass", "after_pass", "complete_forward")
SCENARIOS = ("resident", "one-out", "many-out")
MANY_OUT = 100  # experts out in the many-out scenario (the multi-turn chats held 50-190 out on the H100 and H200)
DECODE_TOKENS = 40  # running requests, one token each
COMPUTE_S = 9e-3  # decode step compute the adjuster reckons with (the H200's at Qwen1.5 shapes)
MID_PAGES_PER_REQUEST = 11  # KV of one request, in expert pages (Qwen1.5 at 32 GiB on the H200)


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    experts: int
    top_k: int
    expert_bytes: int  # one expert's three matrices in bf16, the real model's


SHAPES = {
    "qwen1.5": Shape("qwen1.5", 24, 60, 4, 3 * 1408 * 2048 * 2),
    "qwen3": Shape("qwen3", 48, 128, 8, 3 * 768 * 2048 * 2),
}


def _engine(ckpt: Path, mode: str, shape: Shape) -> Any:
    from rimuru import LLM

    llm = LLM(str(ckpt), device="cpu", offload_mode=mode, gpu_memory_budget="1GiB", max_num_seqs=256)
    engine = llm.engine
    alloc = engine.pool.allocator
    # KV for DECODE_TOKENS requests of MID_PAGES_PER_REQUEST expert pages each (the rest of the pool stays free in
    # static mode, which never reads it; in elastic mode only a few pages are left, so no grow has room)
    smalls = alloc.geometry.smalls_per_mid("kv", "expert")
    kv = DECODE_TOKENS * MID_PAGES_PER_REQUEST * smalls
    free = alloc.free_small_capacity("kv")
    take = min(kv, free) if mode == "static" else free - 2 * smalls
    assert alloc.allocate_small("kv", take, owner="bench") is not None
    return llm


def _demand(scenario: str) -> Any:
    from rimuru.experts.runtime import StepDemand

    queue = scenario != "resident"
    return StepDemand(shortfall_kv_pages=8 if queue else 0, num_batched_tokens=DECODE_TOKENS,
                      num_scheduled=DECODE_TOKENS, num_running=DECODE_TOKENS, num_waiting=20 if queue else 0,
                      max_num_seqs=256, oldest_wait_s=0.5 if queue else 0.0)


def measure(ckpt: Path, shape: Shape, steps: int, seed: int) -> dict[str, Any]:
    """Per scenario and mode: the median host microseconds of each call, the mean step total, and what the
    elastic runtime did (evictions, grows, held plans)."""
    import numpy as np
    import torch

    from rimuru.experts.runtime import StepDemand

    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for scenario in SCENARIOS:
        for mode in ("static", "elastic"):
            llm = _engine(ckpt, mode, shape)
            engine = llm.engine
            rt = engine.runtime
            alloc = engine.pool.allocator
            elastic = mode == "elastic"
            if elastic:
                costs = rt.core.step_cost
                for _ in range(64):
                    costs.observe_compute(COMPUTE_S, tokens=DECODE_TOKENS, decode=True)
                rt.core.adjuster.expert_bytes = shape.expert_bytes
                if scenario != "resident":  # hard shortfalls evict one expert (one-out) or MANY_OUT of them
                    smalls = alloc.geometry.smalls_per_mid("kv", "expert")
                    want = 1 if scenario == "one-out" else MANY_OUT
                    rt.core.adjuster.offloaded_at_least(want)
                    while rt.cache.total_experts - rt.cache.num_resident < want:  # older trees (--base) too
                        rt.begin_step()
                        rt.plan(StepDemand(shortfall_kv_pages=smalls, num_running=DECODE_TOKENS, num_waiting=20,
                                           max_num_seqs=256))
                        rt.before_pass(0)
                        rt.after_pass()
                        alloc.complete_forward()
                    # KV takes the pages the evictions freed (as the queue they were evicted for would), so that no
                    # grow has room and the experts stay out
                    free = alloc.free_small_capacity("kv")
                    if free > 2 * smalls:
                        assert alloc.allocate_small("kv", free - 2 * smalls, owner="bench") is not None
            demand = _demand(scenario)
            times: dict[str, list[float]] = {c: [] for c in CALLS}
            total: list[float] = []
            probs = np.full(shape.experts, 1.0 / shape.experts)
            for step in range(steps):
                if elastic:
                    routed = np.stack([rng.multinomial(DECODE_TOKENS * shape.top_k, probs)
                                       for _ in range(shape.layers)]).astype(np.float32)
                    rt.counter.counts.copy_(torch.from_numpy(routed))
                t0 = time.perf_counter()
                rt.begin_step()
                t1 = time.perf_counter()
                rt.plan(demand)
                t2 = time.perf_counter()
                rt.before_pass(DECODE_TOKENS)
                t3 = time.perf_counter()
                rt.after_pass()
                t4 = time.perf_counter()
                alloc.complete_forward()
                t5 = time.perf_counter()
                if step >= steps // 5:  # the first fifth warms caches and the adjuster's state
                    for call, a, b in zip(CALLS, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5), strict=True):
                        times[call].append((b - a) * 1e6)
                    total.append((t5 - t0) * 1e6)
            row: dict[str, Any] = {
                "median_us": {c: round(statistics.median(v), 2) for c, v in times.items()},
                "step_mean_us": round(statistics.fmean(total), 2),
                "step_median_us": round(statistics.median(total), 2),
            }
            if elastic:
                st = rt.stats()
                row |= {"resident_experts": rt.cache.num_resident, "evictions": int(st["expert_evictions"]),
                        "grows": int(st["expert_grows"]), "plans_held": int(st.get("cost_plans_held", 0))}
            out[f"{scenario}/{mode}"] = row
            llm.shutdown()
    return out


def _checkpoint(shape: Shape, folder: Path) -> Path:
    from rimuru.testing import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen2_moe", folder / shape.name, seed=3, num_hidden_layers=shape.layers,
                                num_experts=shape.experts, num_experts_per_tok=shape.top_k, mlp_only_layers=[],
                                hidden_size=64, moe_intermediate_size=32)


def _child(args: argparse.Namespace) -> None:
    """Measure on whatever tree PYTHONPATH names; print one JSON line."""
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _checkpoint(SHAPES[args.shape], Path(tmp))
        print(json.dumps(measure(ckpt, SHAPES[args.shape], args.steps, args.seed)))


def _run_on(tree: Path, shape: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree), "TQDM_DISABLE": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--shape", shape, "--steps", str(args.steps),
           "--seed", str(args.seed)]
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"measuring on {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per scenario/mode, the run of lowest mean step (the least disturbed by other processes)."""
    return {key: min((r[key] for r in runs), key=lambda row: row["step_mean_us"]) for key in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen1.5,qwen3")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3, help="runs per tree and shape, alternating trees")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base", default=None, help="a git ref to measure beside this tree (a temporary worktree)")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="qwen1.5", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    shapes = [s.strip() for s in args.shapes.split(",")]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import metadata

    meta = metadata("elastic_host", config=vars(args))
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": ROOT}
        if args.base:
            base = Path(tmp) / "base"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                           capture_output=True)
            trees["base"] = base
        try:
            results: dict[str, dict[str, Any]] = {}
            for shape in shapes:
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
                for _ in range(max(1, args.repeats)):
                    for name, tree in trees.items():
                        runs[name].append(_run_on(tree, shape, args))
                results[shape] = {name: _best(r) for name, r in runs.items()}
        finally:
            if args.base:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False,
                               capture_output=True)
    print(f"{'shape':8} {'scenario':9} {'tree':5} {'static us':>10} {'elastic us':>11} {'extra us':>9}  "
          f"{'plan':>7} {'after_pass':>10}  moves")
    for shape, by_tree in results.items():
        for scenario in SCENARIOS:
            for name, rows in by_tree.items():
                s, e = rows[f"{scenario}/static"], rows[f"{scenario}/elastic"]
                moves = f"out {SHAPES[shape].layers * SHAPES[shape].experts - e['resident_experts']}, " \
                        f"evict {e['evictions']}, grow {e['grows']}, held {e['plans_held']}"
                print(f"{shape:8} {scenario:9} {name:5} {s['step_mean_us']:>10.1f} {e['step_mean_us']:>11.1f} "
                      f"{e['step_mean_us'] - s['step_mean_us']:>9.1f}  {e['median_us']['plan']:>7.1f} "
                      f"{e['median_us']['after_pass']:>10.1f}  {moves}")
    doc = {**meta, "base": args.base, "results": results}
    if args.base:
        doc["elastic_extra_us_base_this"] = {
            f"{shape}/{scenario}": [round(by_tree[t][f"{scenario}/elastic"]["step_mean_us"]
                                          - by_tree[t][f"{scenario}/static"]["step_mean_us"], 1)
                                    for t in ("base", "this")]
            for shape, by_tree in results.items() for scenario in SCENARIOS}
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
