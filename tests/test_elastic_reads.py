"""benchmarks/elastic_reads.py: reads per offloaded pass from a served timeline's cumulative counters, binned by
experts out beside a simulation's per-step reads."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import elastic_reads  # noqa: E402

NUM_EXPERTS = 100


def served_row() -> dict:
    """Eight samples: nothing out for two windows of two, then 20 out at 3 reads a pass, then 60 out at 10."""
    resident = [100, 100, 100, 100, 80, 80, 40, 40, 40]
    passes = [0, 0, 0, 0, 0, 4, 8, 10, 12]  # decode; mixed passes add 1 from sample 5 on
    mixed = [0, 0, 0, 0, 0, 1, 1, 1, 1]
    reads = [0, 0, 0, 0, 0, 15, 27, 47, 67]
    return {"timeline": {
        "t": [float(i) for i in range(9)], "running": [0, 0, 5, 5, 10, 10, 30, 30, 30],
        "resident_experts": resident, "offloaded_passes_decode": passes, "offloaded_passes_mixed": mixed,
        "expert_host_reads_decode": reads, "expert_host_reads_mixed": [0] * 9,
        "cost_expected_reads": [None, None, None, None, 2.0, 4.0, 8.0, 8.0, 8.0]}}


def test_windows_divide_the_reads_by_the_offloaded_passes_and_skip_windows_without_any() -> None:
    windows = elastic_reads.served_windows(served_row(), NUM_EXPERTS, window=2)
    # windows [0,2) and [2,4) have no offloaded pass: left out
    assert [(w["t0"], w["t1"]) for w in windows] == [(4.0, 6.0), (6.0, 8.0)]
    assert windows[0]["reads_per_pass"] == pytest.approx(27 / 9)  # 27 reads over 8 decode + 1 mixed passes
    assert windows[0]["offloaded"] == pytest.approx(20.0)
    assert windows[0]["expected_reads"] == pytest.approx(3.0)
    assert windows[1]["reads_per_pass"] == pytest.approx(40 / 4) and windows[1]["offloaded"] == pytest.approx(60.0)


def test_bins_weight_the_engine_by_passes_and_place_the_simulation_by_experts_out() -> None:
    windows = elastic_reads.served_windows(served_row(), NUM_EXPERTS, window=2)
    sim = {"running": np.array([10.0, 12.0, 40.0]), "offloaded": np.array([25.0, 35.0, 70.0]),
           "reads": np.array([2.0, 4.0, 9.0])}
    bins = {b["offloaded_from"]: b for b in elastic_reads.by_offloaded(windows, sim, bin_width=50)}
    assert sorted(bins) == [0, 50]
    assert bins[0]["engine_reads_per_pass"] == pytest.approx(3.0) and bins[0]["sim_reads_per_step"] == 3.0
    assert bins[50]["engine_reads_per_pass"] == pytest.approx(10.0) and bins[50]["sim_steps"] == 1
    two = elastic_reads.by_offloaded(windows, None, bin_width=100)
    # one bin of both windows: (27 + 40) reads over (9 + 4) passes
    assert len(two) == 1 and two[0]["engine_reads_per_pass"] == pytest.approx(67 / 13)
