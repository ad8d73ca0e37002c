"""The measured step cost the cost-aware adjuster reads: compute from copy-free passes per batch size, the copy
slowdown from passes with copies, and why passes with copies never feed the compute estimate (the runaway that
subtracting the modelled exposed copies causes)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rimuru.experts.step_cost import StepCostTracker

MS = 1e-3


def test_buckets_are_powers_of_two() -> None:
    assert [StepCostTracker.bucket(t) for t in (0, 1, 2, 3, 4, 5, 64, 65, 8192)] == [0, 0, 1, 2, 2, 3, 6, 7, 13]


def test_clean_passes_give_the_compute_time_per_batch_size() -> None:
    t = StepCostTracker(alpha=0.5)
    assert t() is None
    t.observe_forward(10 * MS, 0.0, tokens=32)
    t.observe_forward(20 * MS, 0.0, tokens=32)
    assert t() == pytest.approx(15 * MS)
    t.observe_forward(40 * MS, 0.0, tokens=500)  # a prefill-heavy pass: its own bucket
    assert t() == pytest.approx(40 * MS)
    t.observe_forward(16 * MS, 0.0, tokens=30)  # back to the 32-token bucket: 15 -> 15.5
    assert t() == pytest.approx(15.5 * MS)
    # a pass with copies at 100 tokens: no clean pass of that size; the nearest bucket below (32) is read
    t.observe_forward(80 * MS, 10 * MS, tokens=100)
    assert t() == pytest.approx(15.5 * MS)
    # below every measured bucket: the smallest measured one
    t.observe_forward(5 * MS, 1 * MS, tokens=2)
    assert t() == pytest.approx(15.5 * MS)
    # asked for a batch size (the cost adjuster: a decode step of the running requests), whatever ran last
    t.observe_forward(40 * MS, 0.0, tokens=500)
    assert t() == pytest.approx(40 * MS)
    assert (t(30), t(2), t(200), t(5000)) == (pytest.approx(15.5 * MS), pytest.approx(15.5 * MS),
                                              pytest.approx(15.5 * MS), pytest.approx(40 * MS))


def test_passes_with_copies_never_raise_the_compute_estimate() -> None:
    """Copies that hide nothing, plus host time the model does not know, fed through the estimator
    `forward - max(0, copy - overlap c)`, grow it by `overlap` x the estimate each pass until the copies look
    hidden (copy <= overlap c); from then on the whole pass counts as compute, which keeps them looking hidden.
    Here 52 ms for 10 ms of compute; on the H200 that estimator let the cost adjuster offload all 240 experts its
    limit allowed from 25 req/s (benchmarks/sim_step_cost_regression.py reproduces it in the simulator). The
    tracker takes the compute estimate from clean passes only, so it stays at 10 ms."""
    compute, extra, copy, overlap = 10 * MS, 2 * MS, 40 * MS, 0.8

    def forward() -> float:  # what the engine measured: copies serialised with compute, plus host time
        return compute + copy + extra

    old = compute  # the subtracting estimator, alpha = 1
    for _ in range(200):
        old = forward() - max(0.0, copy - overlap * old)
    assert old == pytest.approx(forward())  # 52 ms: the whole pass, 5.2x the true compute
    assert copy <= overlap * old  # and so the 40 ms of copies look hidden

    t = StepCostTracker(alpha=1.0, copy_overlap=overlap)
    t.observe_forward(compute, 0.0, tokens=64)  # the batch ran clean before anything was offloaded
    for _ in range(200):
        t.observe_forward(forward(), copy, tokens=64)
        assert t() == pytest.approx(compute)
    # the copies' real cost is learned instead: nothing hid (exposed 42 ms >= 40 ms of copy), and they took
    # 42 / 40 of their nominal time
    assert t.copy_overlap_share() == 0.0
    assert t.copy_slowdown() == pytest.approx((forward() - compute) / copy)


def test_overlap_and_slowdown_are_learned_from_passes_with_copies() -> None:
    t = StepCostTracker(alpha=1.0, copy_overlap=0.8)
    assert (t.copy_overlap_share(), t.copy_slowdown()) == (0.8, 1.0)  # the configured start
    t.observe_forward(10 * MS, 0.0, tokens=16)
    # 20 ms of nominal copies, the pass took 35 ms: 25 ms exposed, more than the copies: none hid, 1.25x slower
    t.observe_forward(35 * MS, 20 * MS, tokens=16)
    assert (t.copy_overlap_share(), t.copy_slowdown()) == (0.0, pytest.approx(1.25))
    # 10 ms of copies, 6 ms exposed: 4 ms hid behind 10 ms of compute
    t.observe_forward(16 * MS, 10 * MS, tokens=16)
    assert (t.copy_overlap_share(), t.copy_slowdown()) == (pytest.approx(0.4), 1.0)
    # 5 ms of copies that hid completely: the overlap is at least 0.5
    t.observe_forward(10 * MS, 5 * MS, tokens=16)
    assert t.copy_overlap_share() == pytest.approx(0.5)
    # 3 ms of copies, the pass 0.3 ms longer than the clean one: within the 5 % noise band, so they hid; the
    # overlap is at least 0.3 and stays 0.5 (not lowered to 0.3, nor to (3 - 0.3) / 10)
    t.observe_forward(10.3 * MS, 3 * MS, tokens=16)
    assert t.copy_overlap_share() == pytest.approx(0.5)
    # a batch size with no clean pass of its own (64 tokens): its compute is not known well enough to learn from
    t.observe_forward(60 * MS, 20 * MS, tokens=64)
    assert (t.copy_overlap_share(), t.copy_slowdown()) == (pytest.approx(0.5), 1.0)
    # 9 ms that hid: at least 0.9, but never more than the configured 0.8
    t.observe_forward(9.5 * MS, 9 * MS, tokens=16)
    assert t.copy_overlap_share() == pytest.approx(0.8)
    # too small a copy (1 ms < 0.25 x 10 ms) to tell from noise: no sample, even if the pass was slow
    t.observe_forward(30 * MS, 1 * MS, tokens=16)
    assert (t.copy_overlap_share(), t.copy_slowdown()) == (pytest.approx(0.8), 1.0) and t() == pytest.approx(10 * MS)


def test_overlap_starts_exposed_and_is_learned_upward_from_copies_that_hid() -> None:
    # as the engine and the simulator build it (CostAdjusterConfig.initial_copy_overlap = 0): until a copy is
    # measured, none counts as hidden; copies that did hide raise it, up to the configured cap, never beyond
    t = StepCostTracker(alpha=1.0, copy_overlap=0.8, initial_overlap=0.0)
    assert (t.copy_overlap_share(), t.copy_slowdown()) == (0.0, 1.0)
    t.observe_forward(10 * MS, 0.0, tokens=16)
    t.observe_forward(10.2 * MS, 6 * MS, tokens=16)  # 6 ms of copies hid behind 10 ms of compute
    assert t.copy_overlap_share() == pytest.approx(0.6)
    t.observe_forward(10 * MS, 9.5 * MS, tokens=16)
    assert t.copy_overlap_share() == pytest.approx(0.8)
    with pytest.raises(ValueError, match="initial_overlap"):
        StepCostTracker(copy_overlap=0.5, initial_overlap=0.6)


def test_forced_offloading_estimates_compute_as_if_copies_hid_nothing() -> None:
    # no pass is ever copy-free (the experts do not all fit): compute = forward - copy, the slowdown stays 1
    t = StepCostTracker(alpha=0.5)
    t.observe_forward(114 * MS, 98 * MS, tokens=27)
    assert t() == pytest.approx(16 * MS)
    t.observe_forward(100 * MS, 110 * MS, tokens=27)  # copies longer than the pass: clipped at 0
    assert t() == pytest.approx(8 * MS)
    # one estimate over every batch size (prefill-heavy passes included), whatever is asked for
    t.observe_forward(300 * MS, 100 * MS, tokens=2000)
    assert (t(), t(27), t(2000)) == (pytest.approx(104 * MS),) * 3
    assert (t.copy_slowdown(), t.copy_overlap_share()) == (1.0, 0.8)
    # the first clean pass takes over
    t.observe_forward(12 * MS, 0.0, tokens=27)
    assert t() == pytest.approx(12 * MS)


@given(st.lists(st.tuples(st.floats(0.0, 0.5), st.floats(0.0, 0.5), st.integers(0, 4096)), min_size=1, max_size=60))
def test_estimates_stay_within_what_was_measured(passes: list[tuple[float, float, int]]) -> None:
    """Whatever the passes: the compute estimate is one of the measured clean times' convex mixes (never above
    the longest clean pass once one was seen), the slowdown stays in [1, max_slowdown] and the overlap in
    [0, copy_overlap]."""
    t = StepCostTracker(alpha=0.3)
    longest_clean = None
    for forward, copy, tokens in passes:
        t.observe_forward(forward, copy, tokens)
        if copy == 0:
            longest_clean = forward if longest_clean is None else max(longest_clean, forward)
        if longest_clean is not None:
            assert t() is not None and t() <= longest_clean + 1e-12
        assert 1.0 <= t.copy_slowdown() <= t.max_slowdown
        assert 0.0 <= t.copy_overlap_share() <= t.copy_overlap


def test_bad_input_is_refused() -> None:
    for bad in ({"alpha": 0}, {"copy_overlap": 1.5}, {"min_copy_share": 0}, {"max_slowdown": 0.5},
                {"noise_share": -0.1}):
        with pytest.raises(ValueError):
            StepCostTracker(**bad)
    t = StepCostTracker()
    with pytest.raises(ValueError):
        t.observe_forward(-1.0)
    with pytest.raises(ValueError):
        t.observe_compute(-1.0)


def test_copy_excess_is_copied_per_routed_expert() -> None:
    t = StepCostTracker(alpha=0.5, max_excess=50.0)
    assert t.copy_excess() == 1.0  # nothing copied yet
    t.observe_loads(0, 0)  # a step that touched no offloaded expert: no sample
    assert t.copy_excess() == 1.0
    t.observe_loads(routed=10, copied=12)  # two wasted prefetches; a prior of one expert each
    assert t.copy_excess() == pytest.approx(13 / 11)
    t.observe_loads(routed=4, copied=67)  # the H200's bias-blind predictor: EMAs 7 and 39.5
    assert t.copy_excess() == pytest.approx(40.5 / 8)
    t.observe_loads(routed=30, copied=20)  # a prefetch that served two passes: never below 1
    t.observe_loads(routed=30, copied=20)
    assert t.copy_excess() >= 1.0
    only_waste = StepCostTracker(max_excess=5.0)
    only_waste.observe_loads(routed=0, copied=2)  # copies and nothing routed: the prior keeps it finite
    assert only_waste.copy_excess() == pytest.approx(3.0)
    only_waste.observe_loads(routed=0, copied=60)
    assert only_waste.copy_excess() == 5.0  # the cap
    with pytest.raises(ValueError, match="routed >= 0"):
        t.observe_loads(-1, 3)
    with pytest.raises(ValueError, match="max_excess >= 1"):
        StepCostTracker(max_excess=0.5)


def test_decode_estimate_ignores_a_burst_of_slow_passes_and_grows_with_the_batch() -> None:
    """The decode estimate is the median of a bucket's last `decode_window` decode passes: a burst of slow ones
    (host-clock timings while the server thread was busy) shorter than half the window leaves it; an EMA would have
    taken it to ~2.5x. And a smaller batch never reads more than a larger measured one."""
    t = StepCostTracker(decode_window=32)
    for _ in range(40):
        t.observe_forward(9.5 * MS, 0.0, tokens=50, decode=True)
    for _ in range(10):
        t.observe_forward(40 * MS, 0.0, tokens=50, decode=True)
    assert t(50) == pytest.approx(9.5 * MS)
    ema = 9.5 * MS
    for _ in range(10):
        ema = 0.1 * 40 * MS + 0.9 * ema
    assert ema > 2.5 * 9.5 * MS  # what the EMA (alpha 0.1) read after the same burst
    # a longer run of slow passes is what the batch costs now: the median follows
    for _ in range(10):
        t.observe_forward(40 * MS, 0.0, tokens=50, decode=True)
    assert t(50) == pytest.approx(40 * MS)
    # 100 sequences measured at 11 ms: 50 sequences read at most that
    t.observe_forward(11 * MS, 0.0, tokens=100, decode=True)
    assert t(50) == pytest.approx(11 * MS) and t(100) == pytest.approx(11 * MS)
    assert t(300) == pytest.approx(11 * MS)  # beyond every measured bucket: the nearest below
    with pytest.raises(ValueError, match="decode_window"):
        StepCostTracker(decode_window=0)


def test_read_excess_is_measured_reads_per_expected_read_over_a_window() -> None:
    t = StepCostTracker(read_window=4, max_excess=10.0)
    assert t.read_excess() == 1.0  # no pass with experts out yet
    # one expert out, expected 0.28 reads a decode pass, read at every pass (the H200's Qwen1.5 cell)
    for _ in range(4):
        t.observe_reads(0.28, 1)
    assert t.read_excess() == pytest.approx(5.0 / 2.12)
    for _ in range(4):  # the window forgets: the estimate caught up
        t.observe_reads(1.0, 1)
    assert t.read_excess() == pytest.approx(1.0)
    for _ in range(4):  # read less than expected: never below the estimate
        t.observe_reads(3.0, 1)
    assert t.read_excess() == 1.0
    for _ in range(4):
        t.observe_reads(0.0, 30)
    assert t.read_excess() == 10.0  # the cap
    assert t.offload_cost_factor() == 10.0  # no copies, no host tier: the reads' factor alone
    with pytest.raises(ValueError, match="expected >= 0"):
        t.observe_reads(-0.1, 1)
    with pytest.raises(ValueError, match="read_window"):
        StepCostTracker(read_window=0)
