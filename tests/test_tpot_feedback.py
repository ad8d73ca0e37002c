"""The SLO mode's TPOT correction: what finished requests saw tightens (or relaxes, down to the SLO) the bound the
cost adjuster holds its modelled decode step to; and the TPOT the engine feeds it, from finished requests."""

from __future__ import annotations

import numpy as np
import pytest

from rimuru.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from rimuru.engine.recent_tpot import RecentTpot, recent_p99
from rimuru.experts.adjuster import AdjusterState
from rimuru.experts.cost_adjuster import CostAdjuster, CostAdjusterConfig


def _state(p99: float | None, observed: int) -> AdjusterState:
    E = 4
    return AdjusterState(shortfall_mid_pages=0, free_mid_pages=0, resident=[frozenset(range(E))],
                         probabilities=np.full((1, E), 1 / E), rankings=np.arange(E)[None, :], offload_limit=E,
                         tpot_p99_s=p99, tpot_observed=observed)


def _adjuster(slo: float | None = 0.05) -> CostAdjuster:
    return CostAdjuster(CostAdjusterConfig(pcie_bandwidth=50e9, tpot_slo_s=slo, tpot_feedback_requests=16),
                        expert_bytes=1 << 20, top_k=2, compute_time=lambda tokens: 0.01)


def test_the_bound_tightens_when_requests_miss_and_relaxes_back_to_the_slo() -> None:
    adj = _adjuster()
    assert adj.tpot_bound_s == pytest.approx(0.05)
    adj.plan(_state(0.062, 16))  # requests saw 62 ms against 50
    assert adj.tpot_correction == pytest.approx(1.24) and adj.tpot_bound_s == pytest.approx(0.05 / 1.24)
    adj.plan(_state(0.070, 20))  # only 4 new requests: no update yet
    assert adj.tpot_correction == pytest.approx(1.24)
    adj.plan(_state(0.055, 32))
    assert adj.tpot_correction == pytest.approx(1.24 * 1.1)
    adj.plan(_state(0.045, 48))  # within: relax
    assert adj.tpot_correction == pytest.approx(1.24 * 1.1 * 0.9)
    adj.plan(_state(0.010, 64))  # far within: back to the SLO itself, never looser
    assert adj.tpot_correction == 1.0 and adj.tpot_bound_s == pytest.approx(0.05)
    assert adj.stats()["cost_tpot_correction"] == 1.0


def test_no_slo_or_no_measurement_changes_nothing() -> None:
    adj = _adjuster(slo=None)
    adj.plan(_state(0.5, 100))
    assert adj.tpot_correction == 1.0 and adj.tpot_bound_s is None and "cost_tpot_correction" not in adj.stats()
    adj = _adjuster()
    adj.plan(_state(None, 100))  # too few finished requests for a p99
    assert adj.tpot_correction == 1.0


def _finished(first: float, end: float, tokens: int) -> RequestOutput:
    out = CompletionOutput(0, "", list(range(tokens)), "length", None)
    return RequestOutput("r", None, [1], [out], True,
                         metrics=RequestMetrics(arrival_time=0.0, first_token_time=first, finished_time=end))


def test_recent_tpot_is_what_users_measure() -> None:
    recent = RecentTpot(window=4, min_samples=2)
    recent.observe(_finished(1.0, 1.9, 10))  # 0.1 s per token after the first
    assert recent.p99_s() is None and recent.count == 1
    recent.observe(_finished(0.0, 0.0, 1))  # one token: no TPOT
    recent.observe(RequestOutput("u", None, [1], [], False))  # not finished
    recent.observe(_finished(0.0, 0.6, 4))  # 0.2
    assert recent.count == 2 and recent.p99_s() == pytest.approx(np.percentile([0.1, 0.2], 99))
    for _ in range(4):  # the window keeps the last four
        recent.observe(_finished(0.0, 0.3, 4))
    assert recent.p99_s() == pytest.approx(0.1)
    assert recent_p99([0.1] * 15) is None and recent_p99([0.1] * 16) == pytest.approx(0.1)
