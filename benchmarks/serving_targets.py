"""The serving targets against vLLM and the sweep's coverage, computed from the committed sweep files (no GPU).

Reads the sweep files serve_sweep.py wrote (`benchmarks/results/*-serve-qwen1.5-32gib-*-h200.json`: Qwen1.5-MoE
shapes at 32 GiB; the Qwen3-30B-A3B files at 48 GiB, `*-serve-qwen3-48gib-*`, apart for item 3) and prints:

1. coverage: per routing label, which configuration was measured at which rate, by which run (a run = the code a
   file measured, its `git_commit`: result_files.py; a label is serve_sweep's `--label`);
2. per run where `vllm` and `elastic-cost` ran with the same label, the targets from those rows only (same code,
   same machine kind, same requests):
   * 40 req/s: output >= 1.2x vLLM's, TTFT p50 <= 0.25x, TPOT p50 <= 1.25x;
   * the highest rate with TTFT p99 <= 2 s (every lower measured rate meeting it too) >= 1.3x vLLM's;
   * 10 and 20 req/s, where both were measured: output >= 0.9x and TTFT p50 / p99, TPOT p50 / p99 <= 1.1x;
   * half the gap at 40 req/s between vLLM 32 GiB and `vllm-unlimited` (whose rows may come from another run of
     the same label: then the row says so).
3. Qwen3-30B-A3B at 48 GiB: Rimuru elastic and fixed output against vLLM `--cpu-offload-gb 24` per rate, the
   latest run of each (target: elastic >= 3x), with elastic under the zipf 1.0 router beside them (not counted).

    PYTHONPATH=. .venv/bin/python benchmarks/serving_targets.py \
        --output-json benchmarks/results/DATE-serving-targets-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import metadata, write_json  # noqa: E402
from result_files import measured_at, run_of  # noqa: E402
from slo import TTFT_P99_SLO_MS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
QWEN15_FILES = "*-serve-qwen1.5-32gib-*-h200.json"  # Qwen1.5-MoE-A2.7B shapes, 32 GiB
QWEN3_FILES = "*-serve-qwen3-48gib-*-h200.json"  # Qwen3-30B-A3B shapes, 48 GiB
LATENCIES = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def load_rows(results: Path, qwen3: bool = False) -> list[dict[str, Any]]:
    """Every ok row of every Qwen1.5 sweep file (32 GiB), or with qwen3 of the Qwen3-30B-A3B ones (48 GiB), with
    its run, date, label and file name, in time order (rows of one file in file order)."""
    rows: list[dict[str, Any]] = []
    for path in sorted(results.glob(QWEN3_FILES if qwen3 else QWEN15_FILES)):
        doc = json.loads(path.read_text())
        run = run_of(doc)
        if run is None:
            continue
        for row in doc["rows"]:
            if row.get("status") == "ok":
                rows.append({**row, "run": run, "date": measured_at(doc),
                             "label": row.get("label") or doc.get("label"), "file": path.name})
    return sorted(rows, key=lambda r: r["date"])  # stable: file order within a file


# Qwen3 at 48 GiB: the configurations by their sweep names. The target's row is elastic with uniform
# routing (dummy weights); elastic with the seeded zipf 1.0 router is reported beside it, not counted: it says
# how much of the gap skew alone closes (real MoE routing is skewed, but not by a law we chose)
QWEN3_CONFIGS = {"elastic": "q3-elastic", "fixed": "q3-fixed", "elastic_zipf1.0": "q3-elastic-zipf1.0",
                 "vllm": "vllm-offload24"}
QWEN3_OURS = tuple(name for name in QWEN3_CONFIGS if name != "vllm")  # the Rimuru configurations, in order
QWEN3_TARGET = 3.0


def qwen3_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate where vLLM --cpu-offload-gb 24 was measured: Rimuru elastic's, fixed's and skewed-routing
    elastic's output against it (target: uniform elastic >= 3x). The latest run of each configuration counts;
    the row names the runs, since these were measured by different code (one Qwen3 server and one rate per GPU
    per device call)."""
    latest: dict[tuple[str, float], dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: r["date"]):
        latest[(r["config"], r["rate"])] = r
    out = []
    for rate in sorted({rate for (cfg, rate) in latest if cfg == QWEN3_CONFIGS["vllm"]}):
        vllm = latest[(QWEN3_CONFIGS["vllm"], rate)]
        t: dict[str, Any] = {"rate": rate, "vllm_output": vllm["output_throughput"], "runs": {"vllm": vllm["run"]}}
        for name in QWEN3_OURS:
            ours = latest.get((QWEN3_CONFIGS[name], rate))
            t[f"{name}_output"] = ours and ours["output_throughput"]
            t[f"{name}_ratio"] = ours and ours["output_throughput"] / vllm["output_throughput"]
            t["runs"][name] = ours and ours["run"]
        t["met"] = None if t["elastic_ratio"] is None else t["elastic_ratio"] >= QWEN3_TARGET
        out.append(t)
    return out


def coverage(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, list[str]]]]:
    """label -> config -> rate -> the runs that measured it."""
    out: dict[str, dict[str, dict[str, list[str]]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        out[r["label"]][r["config"]].setdefault(f"{r['rate']:g}", []).append(r["run"])
    return {label: {cfg: dict(sorted(rates.items(), key=lambda kv: float(kv[0]))) for cfg, rates in cfgs.items()}
            for label, cfgs in out.items()}


def highest_rate_within_slo(points: dict[float, dict[str, Any]]) -> float | None:
    """The highest measured rate whose TTFT p99 and every lower measured rate's meet the SLO."""
    best = None
    for rate in sorted(points):
        if points[rate]["p99_ttft_ms"] > TTFT_P99_SLO_MS:
            break
        best = rate
    return best


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by: dict[tuple[str, str, str], dict[float, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        by[(r["run"], r["label"], r["config"])][r["rate"]] = r
    out = []
    for (run, label, config), ours in sorted(by.items()):
        if config != "elastic-cost" or (run, label, "vllm") not in by:
            continue
        vllm = by[(run, label, "vllm")]
        t: dict[str, Any] = {"run": run, "label": label, "files": sorted({p["file"] for p in [*ours.values(),
                                                                                             *vllm.values()]})}
        if 40.0 in ours and 40.0 in vllm:
            a, b = ours[40.0], vllm[40.0]
            out_r = a["output_throughput"] / b["output_throughput"]
            ttft_r = a["median_ttft_ms"] / b["median_ttft_ms"]
            tpot_r = a["median_tpot_ms"] / b["median_tpot_ms"]
            t["at_40"] = {"output_ratio": out_r, "output_met": out_r >= 1.2, "ttft_p50_ratio": ttft_r,
                          "ttft_p50_met": ttft_r <= 0.25, "tpot_p50_ratio": tpot_r, "tpot_p50_met": tpot_r <= 1.25}
            unlimited = [r for r in rows if r["label"] == label and r["config"] == "vllm-unlimited"
                         and r["rate"] == 40.0]
            if unlimited:
                u = unlimited[-1]
                gap = u["output_throughput"] - b["output_throughput"]
                share = (a["output_throughput"] - b["output_throughput"]) / gap if gap > 0 else None
                t["gap_at_40"] = {"vllm_unlimited": u["output_throughput"], "unlimited_run": u["run"],
                                  "share_closed": share, "met": share is not None and share >= 0.5}
        ours_best, vllm_best = highest_rate_within_slo(ours), highest_rate_within_slo(vllm)
        # None: not even the lowest measured rate met the SLO, so the highest one is unknown (below it); the
        # target is then undecided (None) where the other side's rate is known
        met = None if vllm_best is None and ours_best is not None else bool(
            ours_best is not None and ours_best >= 1.3 * vllm_best)
        t["ttft_p99_slo"] = {"elastic_cost_rate": ours_best, "vllm_rate": vllm_best,
                             "rates_elastic_cost": sorted(ours), "rates_vllm": sorted(vllm), "met": met}
        for rate in (10.0, 20.0):
            if rate in ours and rate in vllm:
                a, b = ours[rate], vllm[rate]
                ratios = {"output": a["output_throughput"] / b["output_throughput"],
                          **{k: a[k] / b[k] for k in LATENCIES}}
                t[f"within_10pct_at_{rate:g}"] = {"ratios": ratios, "met": ratios["output"] >= 0.9 and all(
                    ratios[k] <= 1.1 for k in LATENCIES)}
        out.append(t)
    return out


def _yes(flag: bool | None) -> str:
    return "undecided" if flag is None else "met" if flag else "missed"


def _rate(best: float | None, measured: list[float]) -> str:
    return f"{best:g}" if best is not None else f"below {min(measured):g}"


def print_report(cov: dict[str, Any], tgts: list[dict[str, Any]]) -> None:
    for label, cfgs in sorted(cov.items()):
        print(f"\ncoverage, label {label!r} (rate: runs)")
        for cfg, rates in sorted(cfgs.items()):
            print(f"  {cfg:16s} " + "  ".join(f"{rate}: {','.join(runs)}"
                                             for rate, runs in rates.items()))
    for t in tgts:
        print(f"\ntargets, run {t['run']}, label {t['label']!r} (elastic-cost against vllm, same run)")
        if "at_40" in t:
            a = t["at_40"]
            print(f"  40 req/s: output {a['output_ratio']:.2f}x ({_yes(a['output_met'])}; >= 1.2x), "
                  f"TTFT p50 {a['ttft_p50_ratio']:.2f}x ({_yes(a['ttft_p50_met'])}; <= 0.25x), "
                  f"TPOT p50 {a['tpot_p50_ratio']:.2f}x ({_yes(a['tpot_p50_met'])}; <= 1.25x)")
        if "gap_at_40" in t:
            g = t["gap_at_40"]
            share = "-" if g["share_closed"] is None else f"{100 * g['share_closed']:+.0f} %"
            print(f"  gap to vllm-unlimited ({g['vllm_unlimited']:.0f} tok/s, run {g['unlimited_run']}) closed: "
                  f"{share} ({_yes(g['met'])}; >= 50 %)")
        s = t["ttft_p99_slo"]
        ours, theirs = s["rates_elastic_cost"], s["rates_vllm"]
        print(f"  highest rate with TTFT p99 <= 2 s: elastic-cost {_rate(s['elastic_cost_rate'], ours)}, "
              f"vllm {_rate(s['vllm_rate'], theirs)} ({_yes(s['met'])}; >= 1.3x; rates measured "
              f"{', '.join(f'{x:g}' for x in ours)} / {', '.join(f'{x:g}' for x in theirs)})")
        for rate in ("10", "20"):
            w = t.get(f"within_10pct_at_{rate}")
            if w:
                r = w["ratios"]
                print(f"  {rate} req/s within 10 %: {_yes(w['met'])} (output {r['output']:.2f}x; TTFT p50 / p99 "
                      f"{r['median_ttft_ms']:.2f}x / {r['p99_ttft_ms']:.2f}x; TPOT p50 / p99 "
                      f"{r['median_tpot_ms']:.2f}x / {r['p99_tpot_ms']:.2f}x)")


def print_qwen3(q3: list[dict[str, Any]]) -> None:
    print("\nQwen3-30B-A3B at 48 GiB: output against vLLM --cpu-offload-gb 24 (latest run of each)")
    for t in q3:
        parts = [f"{name} {t[name + '_output']:.1f} tok/s = {t[name + '_ratio']:.2f}x (run {t['runs'][name]})"
                 if t[name + "_output"] is not None else f"{name} not measured" for name in QWEN3_OURS]
        print(f"  {t['rate']:g} req/s: vllm {t['vllm_output']:.1f} tok/s (run {t['runs']['vllm']}); "
              + "; ".join(parts) + f" ({_yes(t['met'])}; elastic >= {QWEN3_TARGET:g}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the sweep JSON files")
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args()
    rows = load_rows(args.results)
    if not rows:
        raise SystemExit(f"no sweep rows ({QWEN15_FILES}) under {args.results}")
    cov, tgts = coverage(rows), targets(rows)
    q3_rows = load_rows(args.results, qwen3=True)
    q3 = qwen3_targets(q3_rows)
    print_report(cov, tgts)
    print_qwen3(q3)
    if args.output_json:
        meta = metadata("serving_targets", command="python " + " ".join(sys.argv),
                        note="computed on the CPU from the committed H200 sweep files listed here",
                        files=sorted({r["file"] for r in rows + q3_rows}), coverage=cov, qwen3=q3)
        write_json(args.output_json, meta, tgts)


if __name__ == "__main__":
    main()
