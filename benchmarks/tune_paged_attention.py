"""Tuning sweep for paged-attention decode: which launch plan reads K/V fastest, per (batch, context).

Decode attention reached only 27-42 % of HBM bandwidth on the H200 (`2026-11-29-paged-attention-h200.md`). This
script times the planned launch (`plan_launch`) against variations of it: split count multiplied (more programs
in flight), wider KV tiles (`block_n`), other warp counts and pipeline depths. Every variant is checked against
the planned launch's output before it is timed. Per shape it prints the planned time, the best variant and its
gain, and writes every timing to JSON, so that a new `plan_launch` heuristic can be read off the data.

    PYTHONPATH=. python benchmarks/tune_paged_attention.py --output-json out.json          # GPU only

Times are CUDA-graph replays (benchmarks/common.time_op), rotated over input sets larger than L2.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_paged_attention import BLOCK_SIZE, HBM_GBPS, MODELS, make_inputs  # noqa: E402
from benchmarks.common import metadata, print_header, rotation_sets, time_op, write_json  # noqa: E402
from rimuru.kernels.paged_attention import paged_attention_triton, plan_launch  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def variants(planned_splits: int, args: argparse.Namespace) -> list[dict[str, int]]:
    """Plan overrides to try; {} is the planned launch itself."""
    out: list[dict[str, int]] = [{}]
    for mult, block_n, warps, stages in itertools.product(ints(args.split_mults), ints(args.block_ns),
                                                          ints(args.warps), ints(args.stages)):
        splits = min(64, planned_splits * mult)
        out.append({"num_splits": splits, "block_n": block_n, "num_warps": warps, "num_stages": stages})
    return out


def run_shape(model: str, batch: int, ctx: int, args: argparse.Namespace) -> dict[str, Any]:
    hq, hkv, d = MODELS[model]
    dtype = torch.bfloat16
    elem = 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_launch(batch, hq, hkv, d, BLOCK_SIZE, 1, sms, elem)
    kv_bytes = batch * ctx * hkv * d * 2 * elem
    sets = [make_inputs(1, ctx, batch, hq, hkv, d, dtype) for _ in range(rotation_sets(kv_bytes))]
    reference = paged_attention_triton(*sets[0])
    results = []
    for ov in variants(plan.num_splits, args):
        splits = ov.get("num_splits")
        rest = {k: v for k, v in ov.items() if k != "num_splits"}
        try:
            out = paged_attention_triton(*sets[0], num_splits=splits, plan_override=rest or None)
            err = (out.float() - reference.float()).abs().max().item()
            if err > 2e-2:
                results.append({**ov, "error": f"max abs err {err:.3g} against the planned launch"})
                continue
            timing, _ = time_op([lambda a=a, s=splits, r=rest: paged_attention_triton(*a, num_splits=s,
                                                                                      plan_override=r or None)
                                 for a in sets])
        except Exception as e:  # a variant that does not compile (shared memory) is a data point, not a crash
            results.append({**ov, "error": repr(e)[:200]})
            continue
        us = timing.graph_us
        results.append({**ov, "us": us, "pct_hbm": None if us is None else 100 * kv_bytes / us / 1e3 / HBM_GBPS})
    timed = [r for r in results if r.get("us")]
    planned = results[0].get("us")
    best = min(timed, key=lambda r: r["us"]) if timed else None
    row = {"model": model, "batch": batch, "context": ctx, "planned_splits": plan.num_splits,
           "planned_block_n": plan.block_n, "planned_warps": plan.num_warps, "planned_stages": plan.num_stages,
           "planned_us": planned, "best": best, "variants": results}
    if best and planned:
        print(f"{model:14} B={batch:<4} ctx={ctx:<5} planned {planned:8.1f} us ({results[0]['pct_hbm']:4.1f} % HBM)"
              f"  best {best['us']:8.1f} us ({best['pct_hbm']:4.1f} %) x{planned / best['us']:.2f}  "
              f"{ {k: v for k, v in best.items() if k not in ('us', 'pct_hbm')} }", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen1.5-moe")
    ap.add_argument("--batches", default="8,32,64,128")
    ap.add_argument("--contexts", default="256,512,1024,2048")
    ap.add_argument("--split-mults", default="1,2,4", help="multiples of the planned split count")
    ap.add_argument("--block-ns", default="64,128")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--output-json", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the tuning sweep needs a CUDA GPU")
    meta = metadata("paged_attention_decode_tuning", config=vars(args))
    print_header(meta)
    rows = []
    for model in args.models.split(","):
        for batch in ints(args.batches):
            for ctx in ints(args.contexts):
                rows.append(run_shape(model, batch, ctx, args))
                write_json(Path(args.output_json), meta, rows)
    print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
