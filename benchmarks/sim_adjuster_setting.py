"""One setting of the cost adjuster (a `CostAdjusterConfig` field, e.g. `admission_max_loss`, `home_min_gain`) in
the simulator: the elastic default's output throughput and TTFT / TPOT p99 for each value, on the cells where the
admission and homecoming rules decide something: where KV room is scarce and cold experts cheap (Qwen3-30B-A3B at
59 GiB), and where an expert's pages hold a sliver of a request (Qwen1.5-MoE at 32 GiB, with a skewed router so that
some experts are cold enough to be admitted with), static beside each cell. 400 ShareGPT requests a point, H200
hardware profile. CPU only, a few minutes.

    PYTHONPATH=. python benchmarks/sim_adjuster_setting.py --setting admission_max_loss --values 0,0.01,0.03 \\
        --output-json benchmarks/results/DATE-sim-admission-allowance-h200.json
    PYTHONPATH=. python benchmarks/sim_adjuster_setting.py --setting home_min_gain --values 0.05,0.02 \\
        --output-json benchmarks/results/DATE-sim-home-min-gain-h200.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import metadata, print_header, write_json  # noqa: E402
from rimuru.config import parse_bytes  # noqa: E402
from rimuru.experts.cost_adjuster import CostAdjusterConfig  # noqa: E402
from rimuru.experts.runtime_builders import slo_config  # noqa: E402
from rimuru.model_spec import load_model_spec  # noqa: E402
from rimuru.sim.cli import dummy_router_popularity, load_requests, with_arrivals  # noqa: E402
from rimuru.sim.cost_model import HARDWARE  # noqa: E402
from rimuru.sim.simulator import SimConfig, Simulation  # noqa: E402

# (model, budget, routing, req/s)
CELLS = (
    ("qwen3-30b-a3b", "59GiB", "zipf:1.0", 8.0),
    ("qwen3-30b-a3b", "59GiB", "zipf:1.0", 16.0),
    ("qwen3-30b-a3b", "59GiB", "uniform", 10.0),
    ("qwen1.5-moe-a2.7b", "32GiB", "zipf:1.5", 40.0),
    ("qwen1.5-moe-a2.7b", "32GiB", "zipf:1.0", 60.0),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", default="admission_max_loss", help="a CostAdjusterConfig field")
    ap.add_argument("--values", default="0,0.01,0.03", help="comma separated values of --setting")
    ap.add_argument("--num-prompts", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args()
    if args.setting not in {f.name for f in fields(CostAdjusterConfig)}:
        ap.error(f"--setting {args.setting!r} is not a CostAdjusterConfig field")
    try:
        values = [float(a) for a in args.values.split(",")]
    except ValueError:
        ap.error(f"--values must be comma separated numbers, got {args.values!r}")
    pairs = load_requests("sharegpt", args.num_prompts, args.seed)
    rows = []
    meta = metadata("sim_adjuster_setting", setting=args.setting, hardware="h200 profile (simulated)",
                    num_prompts=args.num_prompts,
                    note="rimuru simulate's engine objects on the CPU; no GPU measurement")
    print_header(meta)
    print(f"{'model':>18} {'budget':>6} {'routing':>9} {'req/s':>5} {'mode':>14} {'tok/s':>8} {'vs static':>9} "
          f"{'TTFT p99':>9} {'TPOT p99':>9} {'evictions':>9}")
    for model, budget, routing, rate in CELLS:
        spec = load_model_spec(model)
        pop = dummy_router_popularity(model, routing, spec, args.seed)
        base = SimConfig(mode="static", budget_bytes=parse_bytes(budget), hardware=HARDWARE["h200"])
        reqs = with_arrivals(pairs, rate, args.seed)
        static = Simulation(spec, pop, base).run(reqs).summary()
        runs = [("static", None, static)]
        for a in values:
            cfg = replace(base, mode="elastic", adjuster_kind="cost",
                          cost=slo_config(None, None, "direct", **{args.setting: a}))
            runs.append((f"elastic {a:g}", a, Simulation(spec, pop, cfg).run(reqs).summary()))
        for mode, a, s in runs:
            ratio = s["output_throughput_tok_s"] / static["output_throughput_tok_s"]
            print(f"{model:>18} {budget:>6} {routing:>9} {rate:5g} {mode:>14} {s['output_throughput_tok_s']:8.1f} "
                  f"{ratio:9.3f} {s['ttft_p99_s']:8.2f}s {1e3 * s['tpot_p99_s']:7.1f}ms {s['evictions']:9d}")
            rows.append({"model": model, "budget": budget, "routing": routing, "rate": rate, "mode": mode,
                         args.setting: a, "vs_static": ratio,
                         **{k: s[k] for k in ("output_throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                                              "tpot_p99_s", "peak_running", "evictions", "grows", "kv_pages_moved",
                                              "pcie_bytes")}})
    write_json(args.output_json, meta, rows)


if __name__ == "__main__":
    main()
