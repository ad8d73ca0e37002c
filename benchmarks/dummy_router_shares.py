"""What `--dummy-routing zipf:S` realises, by Monte Carlo at a model's shapes: the router of 04fa9a3 and before
(log shares added to the dummy gate's Gaussian logits) against the current one (Gumbel-top-k over a fitted bias,
rimuru/models/dummy_routing.py), next to the promised power-law shares.

The dummy gate's logit of a token is close to N(0, sigma^2), sigma = 0.02 sqrt(hidden_size) (init_dummy_weights:
N(0, 0.02) weights on an RMS-1 input). Per rank: the share of all top-k picks; and how many of the `--coldest`
least popular experts of a layer a decode batch of T tokens routes to (what offloading them would copy per step).

    PYTHONPATH=. .venv/bin/python benchmarks/dummy_router_shares.py --model qwen1.5-moe-a2.7b --exponent 1.0 \
        --output-json benchmarks/results/2026-11-29-dummy-router-shares-cpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import metadata, print_header, write_json  # noqa: E402

from rimuru.experts.popularity import ExpertPopularity  # noqa: E402
from rimuru.model_spec import load_model_spec  # noqa: E402
from rimuru.models.dummy_routing import cap_shares, fit_topk_bias  # noqa: E402


def realised(logits: torch.Tensor, top_k: int) -> np.ndarray:
    ids = torch.topk(logits, top_k, dim=1).indices
    return np.bincount(ids.reshape(-1).numpy(), minlength=logits.shape[1]) / ids.numel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen1.5-moe-a2.7b")
    ap.add_argument("--exponent", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=200_000, help="Monte Carlo draws")
    ap.add_argument("--coldest", type=int, default=10)
    ap.add_argument("--batches", default="20,50,150", help="decode batch sizes for the routed-coldest column")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args()

    spec = load_model_spec(args.model)
    E, k = spec.num_experts, spec.num_experts_per_tok
    promised = np.sort(cap_shares(ExpertPopularity.zipf("m", 1, E, args.exponent, args.seed).probabilities, k)[0])
    promised = promised[::-1].copy()  # rank order: most popular first
    g = torch.Generator().manual_seed(args.seed + 1)
    sigma = 0.02 * spec.hidden_size ** 0.5
    log_p = torch.tensor(np.log(np.sort(ExpertPopularity.zipf("m", 1, E, args.exponent, args.seed)
                                         .probabilities[0])[::-1].copy()), dtype=torch.float32)
    old = realised(torch.randn(args.tokens, E, generator=g) * sigma + log_p, k)
    bias = torch.tensor(fit_topk_bias(promised[None, :], k, seed=args.seed)[0], dtype=torch.float32)
    gumbel = -torch.log(-torch.log(torch.rand(args.tokens, E, generator=g).clamp(1e-7, 1 - 1e-7)))
    new = realised(gumbel + bias, k)

    meta = metadata("dummy_router_shares", model=args.model, exponent=args.exponent, tokens=args.tokens,
                    logit_sigma=sigma, note="Monte Carlo on the CPU, not an engine run")
    print_header(meta)
    ranks = sorted({1, 2, 3, 5, 10, 15, 20, 30, 40, 50, E} & set(range(1, E + 1)))
    rows = [{"rank": r, "promised": float(promised[r - 1]), "old_router": float(old[r - 1]),
             "current_router": float(new[r - 1])} for r in ranks]
    head = slice(0, min(30, E))
    r = np.arange(1, E + 1)
    slope = float(np.polyfit(np.log(r[head]), np.log(np.maximum(old[head], 1e-12)), 1)[0])
    summary = {"old_router_slope_top30": slope}
    for b in (int(x) for x in args.batches.split(",")):
        for name, shares in (("promised", promised), ("old_router", old), ("current_router", new)):
            cold = shares[-args.coldest:]
            summary[f"routed_of_{args.coldest}_coldest_at_{b}_tokens_{name}"] = float(
                (1 - (1 - cold) ** (k * b)).sum())
    print(f"{'rank':>5} {'promised':>10} {'old':>10} {'current':>10}")
    for row in rows:
        print(f"{row['rank']:>5} {row['promised']:>10.5f} {row['old_router']:>10.5f} {row['current_router']:>10.5f}")
    for key, value in summary.items():
        print(f"{key}: {value:.3f}")
    write_json(args.output_json, {**meta, "summary": summary}, rows)


if __name__ == "__main__":
    main()
