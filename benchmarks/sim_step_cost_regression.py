"""The step-cost tracker's runaway, reproduced in the simulator: the tracker of commit ab35acb (read from git
history) against the current one, and static for reference, on the same trace.

On the H200 that tracker let elastic-cost offload its whole limit (240 experts) from 25 req/s and serve 1,469-1,682
output tok/s against static's ~4,300: its compute estimate grew whenever a pass cost more than its model said,
until copies looked hidden, and from then on the whole pass counted as compute (tests/test_step_cost.py). The
simulator feeds the tracker as the engine does (each pass's time and its copies), so this script shows the runaway
and its fix without a GPU.

Hardware settings per run (flags as `rimuru simulate`): the measured start-up piecewise overhead (0.90 ms over 24
MoE layers = 37.5 us per layer, `piecewise_overhead_ms` in the H200 sweep rows), 1 ms of host time per step, and
the share of compute that copies really hide behind (`--copy-overlaps`: 1.0 = a perfect side stream, 0.0 = none,
as the H200 measured in served passes).

A second setting compared here (`elastic-cost, start 0.8`): a tracker that assumes copies hide behind 0.8 of
compute until it measures otherwise. On the H200 the first evictions at 30 req/s then offloaded 34-45 experts at
once, and elastic-cost served 2,480 output tok/s against static's 4,268 (zipf 1.0). The tracker starts at 0
(`CostAdjusterConfig.initial_copy_overlap`): unmeasured copies count as exposed.

    PYTHONPATH=. .venv/bin/python benchmarks/sim_step_cost_regression.py --rates 25,40 --output-json out.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rimuru.experts.runtime_builders as runtime_builders  # noqa: E402 - builds the tracker the simulator feeds
from rimuru.bench.cli import git_commit  # noqa: E402
from rimuru.config import parse_bytes  # noqa: E402
from rimuru.experts.adjuster import AdjusterConfig  # noqa: E402
from rimuru.experts.cost_adjuster import CostAdjusterConfig  # noqa: E402
from rimuru.experts.popularity import ExpertPopularity  # noqa: E402
from rimuru.model_spec import load_model_spec  # noqa: E402
from rimuru.sim.cli import load_requests, with_arrivals  # noqa: E402
from rimuru.sim.cost_model import HARDWARE  # noqa: E402
from rimuru.sim.simulator import SimConfig, Simulation  # noqa: E402

OLD_COMMIT = "ab35acb2f725dcca58c1027e795ddb70697b82e0"  # the tracker whose runaway the H200 measured
REPO = Path(__file__).resolve().parent.parent


def old_tracker_class() -> type:
    """StepCostTracker as of OLD_COMMIT, adapted to today's calls (tokens ignored, slowdown 1, overlap as set)."""
    source = subprocess.run(["git", "show", f"{OLD_COMMIT}:rimuru/experts/step_cost.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("old_step_cost", f.name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class OldTracker(module.StepCostTracker):  # type: ignore[name-defined,misc]
        def __init__(self, initial_overlap: float | None = None, **kwargs: Any) -> None:
            super().__init__(**kwargs)  # it had no start of its own: its overlap was the configured one

        def observe_forward(self, forward_s: float, copy_s: float = 0.0, tokens: int = 0) -> None:
            super().observe_forward(forward_s, copy_s)

        def __call__(self, tokens: int | None = None) -> float | None:
            return self.compute_s  # one EMA over every pass, whatever the batch

        def copy_slowdown(self) -> float:
            return 1.0

        def copy_overlap_share(self) -> float:
            return self.copy_overlap

        def observe_loads(self, routed: int, copied: int) -> None:
            return None  # it knew no copy excess

        def copy_excess(self) -> float:
            return 1.0

    return OldTracker


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = load_model_spec(args.model)
    pop = ExpertPopularity.from_routing(args.model, args.routing, spec.num_moe_layers, spec.num_experts,
                                        seed=args.seed)
    pairs = load_requests("sharegpt", args.num_prompts, args.seed)
    old = old_tracker_class()
    current = runtime_builders.StepCostTracker
    rows = []
    for overlap in [float(x) for x in args.copy_overlaps.split(",")]:
        hw = replace(HARDWARE["h200"], copy_overlap=overlap, step_overhead_s=args.step_overhead_ms / 1e3,
                     piecewise_overhead_per_layer_s=args.piecewise_overhead_us / 1e6)
        base = SimConfig(mode="static", budget_bytes=parse_bytes(args.gpu_memory_budget), hardware=hw,
                         adjuster=AdjusterConfig(), cost=CostAdjusterConfig())
        for rate in [float(r) for r in args.rates.split(",")]:
            optimistic = replace(base.cost, initial_copy_overlap=base.cost.copy_overlap)
            for label, mode, tracker, cost in (("static", "static", current, base.cost),
                                               ("elastic-cost, old tracker", "elastic", old, base.cost),
                                               ("elastic-cost, start 0.8", "elastic", current, optimistic),
                                               ("elastic-cost", "elastic", current, base.cost)):
                runtime_builders.StepCostTracker = tracker
                try:
                    cfg = replace(base, mode=mode, adjuster_kind="cost", cost=cost)
                    result = Simulation(spec, pop, cfg).run(with_arrivals(pairs, rate, args.seed))
                finally:
                    runtime_builders.StepCostTracker = current
                s = result.summary()
                row = {"copy_overlap": overlap, "rate": rate, "config": label,
                       **{k: s.get(k) for k in ("output_throughput_tok_s", "ttft_p50_s", "ttft_p99_s",
                                                "tpot_p50_s", "tpot_p99_s", "peak_running", "peak_waiting",
                                                "evictions", "grows", "pcie_bytes", "preemptions")}}
                rows.append(row)
                tput = row["output_throughput_tok_s"]
                print(f"overlap {overlap:.1f}  {rate:5.1f} req/s  {label:26s} {tput:8.1f} tok/s  "
                      f"TTFT p50/p99 {row['ttft_p50_s']:.3f}/{row['ttft_p99_s']:.3f} s  "
                      f"TPOT p50 {1e3 * row['tpot_p50_s']:.1f} ms  evictions {row['evictions']}  "
                      f"PCIe {row['pcie_bytes'] / 1e9:.0f} GB", flush=True)
    return {"benchmark": "sim_step_cost_regression", "device": f"cpu ({platform.processor() or platform.machine()})",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "git_commit": git_commit(),
            "old_tracker_commit": OLD_COMMIT, "command": "python " + " ".join(sys.argv), "model": args.model,
            "gpu_memory_budget": args.gpu_memory_budget, "num_prompts": args.num_prompts, "seed": args.seed,
            "routing": args.routing,
            "step_overhead_ms": args.step_overhead_ms, "piecewise_overhead_us": args.piecewise_overhead_us,
            "note": "simulated (CPU cost model), not measured", "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen1.5-moe-a2.7b")
    ap.add_argument("--gpu-memory-budget", default="32GiB")
    ap.add_argument("--num-prompts", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rates", default="25,40")
    ap.add_argument("--routing", default="uniform", help="uniform or zipf:S (as rimuru simulate --routing)")
    ap.add_argument("--copy-overlaps", default="1.0,0.0")
    ap.add_argument("--step-overhead-ms", type=float, default=1.0)
    ap.add_argument("--piecewise-overhead-us", type=float, default=37.5)
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args()
    report = run(args)
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"json: {args.output_json}")


if __name__ == "__main__":
    main()
