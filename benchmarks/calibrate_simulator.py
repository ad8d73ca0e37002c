"""Fit the simulator's step time to the passes measured in serve_sweep files (rimuru/sim/calibration.py).

Every static row of the given files that carries a step profile gives one sample per kind of pass with at least
`--min-steps` steps (decode graphs, mixed graphs): its mean batch (tokens, sequences), the context per sequence
from the timeline (KV pages held / running requests / attention layers x block size, averaged over the samples
with requests running), and the mean GPU time of its forward pass. Where a row carries the profiler's
`decode_by_batch` groups, each all-resident group is a decode sample of its own (its mean sequences and context per
sequence) in place of the decode kind's mean: a step's time is concave in the batch, so the kind's mean time at its
mean batch reads low. Static rows only: every expert resident, so the pass is compute and memory traffic alone.
Prints each sample measured against the fitted profile and the profile in use, and writes the fitted coefficients.
With `--linear-layers` (a hybrid model's files) only the per-linear-attention-layer terms are fitted, on top of the
profile in use (rimuru/sim/calibration.py fit_linear_layer_terms).

    python benchmarks/calibrate_simulator.py benchmarks/results/*-serve-*static*-h200.json \\
        benchmarks/results/2026-12-01-regime-map-qwen3-59gib-zipf1.0-static-elastic-78f29f2-h200.json \\
        --model-path qwen15moe=qwen1.5-moe-a2.7b --output-json benchmarks/results/...-sim-calibration-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import metadata, write_json  # noqa: E402
from benchmarks.regime_map import routing_of, server_flags  # noqa: E402
from rimuru.model_spec import ModelSpec, load_model_spec  # noqa: E402
from rimuru.sim.calibration import (  # noqa: E402
    StepSample,
    decode_chunks,
    fit_linear_layer_terms,
    fit_step_time,
    mixed_chunks,
)
from rimuru.sim.cli import dummy_router_popularity  # noqa: E402
from rimuru.sim.cost_model import HARDWARE, CostModel  # noqa: E402

KINDS = ("decode-graph", "mixed-graph")
BLOCK_SIZE = 16  # the servers' KV block (EngineConfig.block_size default)


def sample(spec: ModelSpec, probabilities: np.ndarray, chunks: tuple[tuple[int, int], ...], measured: dict[str, Any],
           label: str) -> StepSample:
    """One fitting sample: `measured` is a step-profile entry (a decode group or a kind) with its mean sequences and
    mean GPU forward time."""
    return StepSample(spec=spec, probabilities=probabilities, chunks=chunks, num_sampled=round(measured["seqs_mean"]),
                      measured_s=measured["gpu_forward_ms"] / 1e3, label=label)


def samples_of(doc: dict[str, Any], source: str, model_of: dict[str, str], min_steps: int) -> list[StepSample]:
    name = Path(str(doc.get("model", ""))).name
    spec = load_model_spec(model_of.get(name, name))
    out = []
    for row in doc.get("rows", []):
        profile = row.get("step_profile")
        if row.get("status") != "ok" or row.get("config") != "static" or not profile:
            continue
        routing = routing_of(server_flags(doc, "static"))
        pop = dummy_router_popularity(name, routing, spec, int(doc.get("seed", 0)))
        tl = row["timeline"]
        running, kv = np.asarray(tl["running"], dtype=float), np.asarray(tl["kv_pages_used"], dtype=float)
        busy = running > 0
        layers = len(spec.attention_layer_ids)
        context = float((kv[busy] / running[busy]).mean()) / layers * BLOCK_SIZE if busy.any() else 0.0
        label = f"{source} {name} {routing} {row['rate']:g} req/s"
        groups = [g for g in profile.get("decode_by_batch", [])
                  if not g["offloaded"] and g["steps"] >= min_steps and g.get("gpu_forward_ms")]
        for g in groups:  # each batch size of decode on its own: a step's time is not linear in the batch
            per_seq = g["context_tokens_mean"] / max(1.0, g["seqs_mean"])
            out.append(sample(spec, pop.probabilities, decode_chunks(g["seqs_mean"], per_seq), g,
                              f"{label} decode S={g['seqs_mean']:.1f} ctx={per_seq:.0f} ({g['steps']} steps)"))
        for kind in KINDS:
            k = profile.get("kinds", {}).get(kind)
            if not k or k["steps"] < min_steps or not k.get("gpu_forward_ms") or (groups and kind == "decode-graph"):
                continue
            chunks = decode_chunks(k["seqs_mean"], context) if kind == "decode-graph" \
                else mixed_chunks(k["tokens_mean"], k["seqs_mean"], context)
            out.append(sample(spec, pop.probabilities, chunks, k,
                              f"{label} {kind} T={k['tokens_mean']:.0f} S={k['seqs_mean']:.1f} ctx={context:.0f}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--model-path", action="append", default=[], metavar="NAME=PATH",
                    help="what load_model_spec reads for a file's model name (default: the name, a preset)")
    ap.add_argument("--min-steps", type=int, default=20)
    ap.add_argument("--hardware", default="h200", choices=sorted(HARDWARE))
    ap.add_argument("--linear-layers", action="store_true",
                    help="a hybrid model's passes: fit only the profile's per-linear-attention-layer terms "
                         "(linear_layer_s, linear_prefill_s), keeping the others as --hardware has them")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    model_of = dict(m.split("=", 1) for m in args.model_path)
    samples = []
    for path in args.files:
        samples += samples_of(json.loads(Path(path).read_text()), Path(path).name, model_of, args.min_steps)
    base = HARDWARE[args.hardware]
    try:
        fitted, predicted = (fit_linear_layer_terms if args.linear_layers else fit_step_time)(samples, base)
    except ValueError as err:  # too few passes, a term priced below 0, a file of another model than --linear-layers'
        raise SystemExit(f"calibrate_simulator: {err}") from None

    def in_use(s: StepSample) -> float:
        return CostModel(s.spec, s.probabilities, base).step(
            list(s.chunks), s.num_sampled, np.ones(s.probabilities.shape, dtype=bool)).time_s

    rows = [{"sample": s.label, "measured_ms": 1e3 * s.measured_s, "fitted_ms": 1e3 * p,
             "fitted_error": p / s.measured_s - 1, f"{args.hardware}_ms": 1e3 * in_use(s),
             f"{args.hardware}_error": in_use(s) / s.measured_s - 1} for s, p in zip(samples, predicted, strict=True)]
    for r in rows:
        print(f"{r['sample'][-95:]:95s} measured {r['measured_ms']:6.2f}  fitted {r['fitted_ms']:6.2f} "
              f"({100 * r['fitted_error']:+4.0f} %)  {args.hardware} {r[f'{args.hardware}_ms']:6.2f} "
              f"({100 * r[f'{args.hardware}_error']:+4.0f} %)")
    if args.linear_layers:
        fit = {"linear_layer_s": fitted.linear_layer_s, "linear_prefill_s": fitted.linear_prefill_s}
    else:
        fit = {"flops_efficiency": fitted.flops_efficiency, "bandwidth_efficiency": fitted.bandwidth_efficiency,
               "layer_overhead_s": fitted.layer_overhead_s, "compute_plus_memory": True}
    errors = np.array([r["fitted_error"] for r in rows])
    summary = {"rms_error": float(np.sqrt(np.mean(errors**2))), "max_abs_error": float(np.abs(errors).max()),
               f"{args.hardware}_rms_error": float(np.sqrt(np.mean([r[f'{args.hardware}_error'] ** 2
                                                                     for r in rows])))}
    print(f"fit over {len(rows)} passes: {fit}; {summary}")
    meta = metadata("calibrate_simulator", files=[Path(f).name for f in args.files], fit=fit, **summary)
    write_json(Path(args.output_json) if args.output_json else None, meta, rows)


if __name__ == "__main__":
    main()
