"""The expert ranking `rimuru profile` would find for a model served with dummy weights and `--dummy-routing`:
the router's own target shares (rimuru/models/dummy_routing.py, capped at 1/top_k as the router caps them), as a
ranking file for `--expert-ranking`.

Fixed mode makes the first K experts of each layer's ranking resident; without a ranking it takes them in index
order, which under a skewed dummy router offloads experts of any popularity. The regime map's fixed splits are
meant as the best a user of fixed mode gets, one who profiled the traffic first, so they read this file.

    PYTHONPATH=. python benchmarks/dummy_ranking.py --model qwen3-30b-a3b --routing zipf:1.0 --output ranking.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rimuru.config import EngineConfig  # noqa: E402
from rimuru.model_spec import load_model_spec  # noqa: E402
from rimuru.sim.cli import dummy_router_popularity  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="preset name or a directory with config.json")
    ap.add_argument("--routing", required=True, help="uniform | zipf:S, as the server's --dummy-routing")
    ap.add_argument("--seed", type=int, default=EngineConfig.seed, help="the server's --seed (the router's)")
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    spec = load_model_spec(args.model)
    dummy_router_popularity(args.model, args.routing, spec, args.seed).save(args.output)
    print(f"wrote {args.output}: {spec.num_moe_layers} layers x {spec.num_experts} experts, {args.routing}")


if __name__ == "__main__":
    main()
