"""benchmarks/serving_targets.py: the targets against vLLM computed from sweep rows, exactly, on constructed rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from serving_targets import coverage, highest_rate_within_slo, load_rows, qwen3_targets, targets  # noqa: E402


def row(config: str, rate: float, out: float, ttft: float = 100.0, ttft99: float = 500.0, tpot: float = 10.0,
        tpot99: float = 20.0, run: str = "784e9b0", label: str = "uniform",
        date: str = "2026-12-01T10:00:00+00:00") -> dict:
    return {"config": config, "rate": rate, "output_throughput": out, "median_ttft_ms": ttft, "p99_ttft_ms": ttft99,
            "median_tpot_ms": tpot, "p99_tpot_ms": tpot99, "run": run, "date": date, "label": label,
            "file": f"{run}-{config}.json"}


def test_highest_rate_stops_at_the_first_miss() -> None:
    points = {10.0: {"p99_ttft_ms": 100.0}, 20.0: {"p99_ttft_ms": 1999.0}, 30.0: {"p99_ttft_ms": 2500.0},
              40.0: {"p99_ttft_ms": 1000.0}}  # 40 meets it again, but 30 did not: 20 is the answer
    assert highest_rate_within_slo(points) == 20.0
    assert highest_rate_within_slo({25.0: {"p99_ttft_ms": 2001.0}}) is None


def test_targets_from_one_run() -> None:
    rows = [row("vllm", 10, 1000), row("vllm", 20, 2000), row("vllm", 40, 4000, ttft=2000, ttft99=8000, tpot=14),
            row("elastic-cost", 10, 950, ttft=105), row("elastic-cost", 20, 2000, tpot99=23),
            row("elastic-cost", 30, 3000, ttft99=1900),
            row("elastic-cost", 40, 4800, ttft=400, ttft99=9000, tpot=17.5),
            row("vllm-unlimited", 40, 5600, run="91040d8")]
    [t] = targets(rows)
    assert t["at_40"] == {"output_ratio": 1.2, "output_met": True, "ttft_p50_ratio": 0.2, "ttft_p50_met": True,
                          "tpot_p50_ratio": 1.25, "tpot_p50_met": True}
    assert t["gap_at_40"]["share_closed"] == pytest.approx(0.5) and t["gap_at_40"]["met"]
    assert t["gap_at_40"]["unlimited_run"] == "91040d8"  # from another run of the same label: said so
    # elastic-cost meets the SLO up to 30 req/s, vLLM up to 20 (no 30 measured, 40 misses): 1.5x
    assert t["ttft_p99_slo"]["elastic_cost_rate"] == 30.0 and t["ttft_p99_slo"]["vllm_rate"] == 20.0
    assert t["ttft_p99_slo"]["met"] is True
    assert t["within_10pct_at_10"]["met"] is True  # 0.95x output, 1.05x TTFT p50
    assert t["within_10pct_at_20"]["met"] is False  # TPOT p99 1.15x
    assert t["within_10pct_at_20"]["ratios"]["p99_tpot_ms"] == pytest.approx(1.15)


def test_other_labels_and_runs_do_not_mix() -> None:
    rows = [row("vllm", 40, 4000), row("elastic-cost", 40, 4000, label="zipf1.0"),
            row("elastic-cost", 40, 4000, run="1f23f85")]
    assert targets(rows) == []  # no elastic-cost beside vllm with the same run and label
    cov = coverage(rows)
    assert cov["uniform"]["elastic-cost"] == {"40": ["1f23f85"]} and "zipf1.0" in cov


def test_reads_sweep_files_and_skips_qwen3_and_failed_rows(tmp_path: Path) -> None:
    ok = {"config": "vllm", "rate": 40.0, "status": "ok", "label": "uniform", "output_throughput": 1.0}
    meta = {"git_commit": "784e9b06acc0c6e3", "date": "2026-11-30T01:40:18+00:00"}
    (tmp_path / "2026-11-30-serve-qwen1.5-32gib-uniform-vllm-h200.json").write_text(json.dumps(
        {**meta, "label": "uniform", "rows": [ok, {**ok, "rate": 60.0, "status": "skipped"}]}))
    (tmp_path / "2026-11-30-serve-qwen3-48gib-fixed-1rps-h200.json").write_text(json.dumps({**meta, "rows": [ok]}))
    (tmp_path / "2026-11-30-serve-qwen1.5-32gib-uniform-static-h200.json").write_text(json.dumps(
        {"rows": [ok]}))  # no commit recorded: no run to pair it with, left out
    rows = load_rows(tmp_path)
    assert [(r["run"], r["rate"], r["date"]) for r in rows] == [("784e9b0", 40.0, meta["date"])]
    q3 = load_rows(tmp_path, qwen3=True)
    assert [(r["config"], r["file"]) for r in q3] == [("vllm", "2026-11-30-serve-qwen3-48gib-fixed-1rps-h200.json")]


def test_qwen3_ratios_take_the_latest_run_of_each_config() -> None:
    day1, day2, day3 = "2026-11-29T20:25:13+00:00", "2026-11-30T00:08:23+00:00", "2026-11-30T01:45:35+00:00"
    rows = [row("vllm-offload24", 2, 60.0, run="784e9b0", date=day3),
            row("q3-elastic", 2, 100.0, run="ab35acb", date=day1),
            row("q3-elastic", 2, 120.0, run="f3ae023", date=day2), row("q3-elastic-zipf1.0", 2, 500.0),
            row("q3-fixed", 1, 80.0), row("q3-elastic", 1, 95.0)]
    [t] = qwen3_targets(rows)  # 1 req/s has no vLLM row: no target there
    assert t["rate"] == 2.0 and t["elastic_output"] == 120.0 and t["elastic_ratio"] == pytest.approx(2.0)
    assert t["runs"] == {"vllm": "784e9b0", "elastic": "f3ae023", "fixed": None, "elastic_zipf1.0": "784e9b0"}
    assert t["fixed_ratio"] is None and t["met"] is False  # 2x < 3x; the skewed variant does not count
    assert t["elastic_zipf1.0_ratio"] == pytest.approx(500.0 / 60.0)  # reported beside it
    [t] = qwen3_targets([row("vllm-offload24", 2, 40.0), row("q3-elastic", 2, 120.0)])
    assert t["met"] is True
    # the latest is the one measured last, whatever its commit's name or the order of the rows
    [t] = qwen3_targets([row("vllm-offload24", 2, 40.0, run="1f23f85", date=day3),
                         row("vllm-offload24", 2, 60.0, run="784e9b0", date=day2),
                         row("q3-elastic", 2, 120.0)])
    assert t["vllm_output"] == 40.0 and t["runs"]["vllm"] == "1f23f85"
