"""Reads of evicted experts by elastic mode: the served engine against its own estimate and against `rimuru simulate`.

A served elastic row's timeline (serve_sweep.py, scraped from the server's metrics) carries, per sample, the experts
resident, the running requests, the cumulative host reads of offloaded experts and passes that had any offloaded
(decode and mixed), and the cost adjuster's `cost_expected_reads`: the reads a pass makes by its popularity
estimate for the experts out at that moment. A simulation's timeline (`rimuru simulate --output-json`) carries, per
sampled step, the experts' bytes resident, the running requests and the bytes read over PCIe in that step.

Per window of the served timeline (`--window` samples): requests running, experts offloaded, reads per offloaded
pass (measured) and the estimate; then, binned by experts offloaded (`--bin`), the engine's reads per pass, its
estimate, and the simulation's reads per step at the same number out. Where the engine reads more than it
estimates, the experts it evicted were more popular than it judged them; where the simulation reads fewer than the
engine at the same number out, its evicted experts are colder than the engine's.

    PYTHONPATH=. .venv/bin/python benchmarks/elastic_reads.py SERVED.json --rate 16 --sim SIM.json \
        --output-json benchmarks/results/<date>-elastic-reads-....json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import metadata, print_header, write_json  # noqa: E402
from rimuru.model_spec import load_model_spec  # noqa: E402


def _floats(values: list[Any]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def served_windows(row: dict[str, Any], num_experts: int, window: int) -> list[dict[str, float]]:
    """The served timeline cut into windows of `window` samples; windows with no offloaded pass are left out."""
    tl = row["timeline"]
    t = _floats(tl["t"])
    running = _floats(tl["running"])
    offloaded = num_experts - _floats(tl["resident_experts"])
    reads = _floats(tl["expert_host_reads_decode"]) + _floats(tl["expert_host_reads_mixed"])
    passes = _floats(tl["offloaded_passes_decode"]) + _floats(tl["offloaded_passes_mixed"])
    expected = _floats(tl["cost_expected_reads"])
    out = []
    for i in range(0, len(t) - window, window):
        j = i + window
        n = passes[j] - passes[i]
        if not n > 0:
            continue
        est = expected[i:j]
        out.append({"t0": float(t[i]), "t1": float(t[j]), "running": float(np.nanmean(running[i:j])),
                    "offloaded": float(np.nanmean(offloaded[i:j])), "offloaded_passes": float(n),
                    "reads_per_pass": float((reads[j] - reads[i]) / n),
                    "expected_reads": float(np.nanmean(est)) if np.isfinite(est).any() else None})
    return out


def simulated_steps(mode: dict[str, Any], num_experts: int, expert_bytes: float) -> dict[str, np.ndarray]:
    """The simulation's sampled steps: running, experts offloaded, experts read (bytes over one expert's)."""
    tl = mode["timeline"]
    return {"running": _floats(tl["running"]),
            "offloaded": num_experts - _floats(tl["expert_bytes"]) / expert_bytes,
            "reads": _floats(tl["pcie_bytes"]) / expert_bytes}


def by_offloaded(windows: list[dict[str, float]], sim: dict[str, np.ndarray] | None, bin_width: int
                 ) -> list[dict[str, Any]]:
    """Per bin of experts offloaded: the engine's reads per pass (weighted by passes), its estimate, and the
    simulation's mean reads per step in the same bin."""
    top = max([w["offloaded"] for w in windows] + ([float(np.nanmax(sim["offloaded"]))] if sim else [0.0]))
    rows = []
    for lo in range(0, int(top) + bin_width, bin_width):
        hi = lo + bin_width
        ws = [w for w in windows if lo <= w["offloaded"] < hi]
        row: dict[str, Any] = {"offloaded_from": lo, "offloaded_to": hi, "engine_windows": len(ws)}
        if ws:
            n = np.array([w["offloaded_passes"] for w in ws])
            row["engine_running"] = float(np.average([w["running"] for w in ws], weights=n))
            row["engine_reads_per_pass"] = float(np.average([w["reads_per_pass"] for w in ws], weights=n))
            est = [(w["expected_reads"], k) for w, k in zip(ws, n, strict=True) if w["expected_reads"] is not None]
            row["engine_expected_reads"] = (float(np.average([e for e, _ in est], weights=[k for _, k in est]))
                                            if est else None)
        if sim is not None:
            m = (sim["offloaded"] >= lo) & (sim["offloaded"] < hi)
            row["sim_steps"] = int(m.sum())
            if m.any():
                row["sim_running"] = float(sim["running"][m].mean())
                row["sim_reads_per_step"] = float(sim["reads"][m].mean())
        if ws or row.get("sim_steps"):
            rows.append(row)
    return rows


def _cell(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("served", help="a serve_sweep result file with an elastic row")
    ap.add_argument("--rate", type=float, required=True, help="the row's request rate")
    ap.add_argument("--config", default=None, help="the row's configuration (default: the first at the rate)")
    ap.add_argument("--sim", default=None, help="a `rimuru simulate --output-json` file of one elastic mode")
    ap.add_argument("--window", type=int, default=4, help="served timeline samples per window")
    ap.add_argument("--bin", type=int, default=50, help="experts offloaded per bin")
    ap.add_argument("--output-json", type=Path, default=None)
    args = ap.parse_args()

    served = json.loads(Path(args.served).read_text())
    rows = [r for r in served["rows"] if r["rate"] == args.rate and (args.config is None or r["config"] == args.config)]
    if not rows or "timeline" not in rows[0]:
        sys.exit(f"{args.served}: no row with a timeline at rate {args.rate}"
                 + (f" for configuration {args.config}" if args.config else ""))
    row = rows[0]
    spec = load_model_spec(served["model"])
    num_experts = spec.num_moe_layers * spec.num_experts
    windows = served_windows(row, num_experts, args.window)
    sim = None
    if args.sim:
        doc = json.loads(Path(args.sim).read_text())
        modes = [m for m in doc["modes"].values() if m["mode"].startswith("elastic")]
        if not modes:
            sys.exit(f"{args.sim}: no elastic mode")
        mem = modes[0]["memory"]
        per_layer = mem["initial_resident_per_layer"]
        expert_bytes = mem["initial_expert_bytes"] / (spec.num_moe_layers * per_layer)
        sim = simulated_steps(modes[0], num_experts, expert_bytes)
    bins = by_offloaded(windows, sim, args.bin)

    meta = metadata("elastic_reads", served_file=Path(args.served).name, rate=args.rate, config=row["config"],
                    sim_file=Path(args.sim).name if args.sim else None, window_samples=args.window,
                    bin_experts=args.bin, served_device=served.get("device"), served_commit=served.get("git_commit"))
    print_header(meta)
    print(f"{'t (s)':>11} {'running':>8} {'out':>6} {'passes':>7} {'reads/pass':>11} {'estimate':>9}")
    for w in windows:
        print(f"{w['t0']:5.1f}-{w['t1']:5.1f} {w['running']:8.1f} {w['offloaded']:6.1f} {w['offloaded_passes']:7.0f} "
              f"{w['reads_per_pass']:11.1f} {_cell(w['expected_reads'], '9.1f')}")
    print(f"\n{'out':>9} | {'engine running':>14} {'reads/pass':>10} {'estimate':>8} | "
          f"{'sim steps':>9} {'running':>7} {'reads/step':>10}")
    for b in bins:
        print(f"{b['offloaded_from']:>4}-{b['offloaded_to']:<4} | {_cell(b.get('engine_running'), '14.1f')} "
              f"{_cell(b.get('engine_reads_per_pass'), '10.1f')} {_cell(b.get('engine_expected_reads'), '8.1f')} | "
              f"{b.get('sim_steps', 0):>9} {_cell(b.get('sim_running'), '7.1f')} "
              f"{_cell(b.get('sim_reads_per_step'), '10.1f')}")
    write_json(args.output_json, meta, [{"windows": windows, "by_offloaded": bins}])


if __name__ == "__main__":
    main()
