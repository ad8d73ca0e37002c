"""The paper's adjuster rules with exact numbers, nomination across layers, limits, prefix and hysteresis."""

from __future__ import annotations

import numpy as np
import pytest

from rimuru.experts.adjuster import (
    AdjusterConfig,
    AdjusterState,
    AdjustPlan,
    PaperAdjuster,
    decide,
    shortfall_mid_pages,
)

CFG = AdjusterConfig()


def state(R: int, F: int, resident: list[int], probs: np.ndarray, limit: int | list[int] = 99) -> AdjusterState:
    """`resident[l]` = size of layer l's resident prefix of its ranking."""
    rankings = np.argsort(-probs, axis=1, kind="stable")
    return AdjusterState(shortfall_mid_pages=R, free_mid_pages=F,
                         resident=[frozenset(rankings[layer, :k].tolist()) for layer, k in enumerate(resident)],
                         probabilities=probs, rankings=rankings, offload_limit=limit)


def uniform(L: int, E: int) -> np.ndarray:
    return np.full((L, E), 1.0 / E)


# Two layers, 4 experts. Layer 0 ranking [2, 0, 3, 1]; layer 1 ranking [1, 3, 2, 0].
P = np.array([[0.30, 0.05, 0.50, 0.15],
              [0.04, 0.60, 0.16, 0.20]])


def test_rule_counts_exact() -> None:
    assert CFG.num_evict(8, 0) == 3  # ceil((8 + 1) / 3)
    assert CFG.num_evict(1, 30) == 1  # short wins over many free pages
    assert CFG.num_evict(0, 1) == 1
    assert CFG.num_evict(0, 2) == 0
    assert CFG.num_grow(0, 20) == 3  # floor(11 / 3)
    assert CFG.num_grow(0, 100) == 5  # capped
    assert CFG.num_grow(0, 11) == 0  # floor(2 / 3)
    assert CFG.num_grow(0, 12) == 1
    assert CFG.num_grow(0, 9) == 0
    assert CFG.num_grow(4, 20) == 0  # never grow while short


def test_short_by_8_evicts_3_least_popular() -> None:
    plan = decide(state(8, 0, [60] * 4, np.tile(np.linspace(1, 2, 60) / np.linspace(1, 2, 60).sum(), (4, 1))), CFG)
    # uniform across layers, expert 0 least popular in each: ties go to the layer with most residents, then index
    assert plan == AdjustPlan(evict=[(0, 0), (1, 0), (2, 0)])


def test_evict_picks_global_minimum_and_repeats_a_layer() -> None:
    # nominees: layer 0 -> expert 1 (0.05), layer 1 -> expert 0 (0.04)
    plan = decide(state(8, 0, [4, 4], P), CFG)
    # 0.04 (1,0), 0.05 (0,1), then layer 0's next = 3 (0.15) beats layer 1's next = 2 (0.16)
    assert plan.evict == [(1, 0), (0, 1), (0, 3)]
    assert plan.grow == []


def test_low_free_evicts_one_and_band_does_nothing() -> None:
    assert decide(state(0, 1, [4, 4], P), CFG).evict == [(1, 0)]
    assert decide(state(0, 5, [4, 4], P), CFG).is_empty
    assert decide(state(0, 2, [4, 4], P), CFG).is_empty
    assert decide(state(0, 9, [2, 2], P), CFG).is_empty


def test_grow_20_free_takes_3_most_popular_non_resident() -> None:
    # layer 0 resident {2}, layer 1 resident {1}; non-resident best: layer 0 -> 0 (0.30), layer 1 -> 3 (0.20)
    plan = decide(state(0, 20, [1, 1], P), CFG)
    assert plan.grow == [(0, 0), (1, 3), (1, 2)]  # 0.30, 0.20, then layer 1's 0.16 beats layer 0's 0.15
    assert plan.evict == []


def test_grow_stops_when_everything_is_resident() -> None:
    assert decide(state(0, 100, [4, 3], P), CFG).grow == [(1, 0)]  # layer 1's last, then nothing


def test_layers_at_limit_are_never_nominated() -> None:
    # limit 1 per layer: layer 1 has 1 offloaded already (resident 3 of 4) -> out; layer 0 may give one
    plan = decide(state(30, 0, [4, 3], P, limit=1), CFG)
    assert plan.evict == [(0, 1)]
    # per-layer limits: layer 0 may offload nothing
    plan = decide(state(30, 0, [4, 4], P, limit=[0, 2]), CFG)
    assert plan.evict == [(1, 0), (1, 2)]
    assert decide(state(30, 0, [4, 4], P, limit=0), CFG).is_empty


def test_plans_keep_the_resident_set_a_prefix() -> None:
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(16), size=6)
    ranks = np.argsort(-probs, axis=1, kind="stable")
    counts = [16] * 6
    adj = PaperAdjuster()
    for _ in range(200):
        R = int(rng.integers(0, 12)) if rng.random() < 0.4 else 0
        F = int(rng.integers(0, 30))
        plan = adj.plan(state(R, F, counts, probs, limit=10))
        for layer, e in plan.evict:
            assert ranks[layer, counts[layer] - 1] == e  # the tail of the prefix leaves
            counts[layer] -= 1
        for layer, e in plan.grow:
            assert ranks[layer, counts[layer]] == e  # the next one in the ranking enters
            counts[layer] += 1
        assert all(6 <= c <= 16 for c in counts)


def test_no_flapping_when_free_pages_oscillate_in_the_band() -> None:
    adj = PaperAdjuster()
    counts = [3, 3]
    F = 1
    actions = []
    # F wanders between the thresholds; the only action is the first evict (F=1), which leaves F=4
    for f in [1, 4, 8, 3, 9, 2, 7, 9, 2]:
        F = f
        plan = adj.plan(state(0, F, counts, P))
        actions.append((len(plan.evict), len(plan.grow)))
        for layer, _ in plan.evict:
            counts[layer] -= 1
    assert actions == [(1, 0)] + [(0, 0)] * 8
    # after an eviction frees 3 pages (1 -> 4) and after a grow takes 3 (12 -> 9) nothing else happens
    assert adj.plan(state(0, 1 + 3, counts, P)).is_empty
    assert adj.plan(state(0, 12, counts, P)).grow and adj.plan(state(0, 12 - 3, counts, P)).is_empty


def test_shortfall_conversion() -> None:
    assert shortfall_mid_pages(0, 44) == 0
    assert shortfall_mid_pages(1, 44) == 1
    assert shortfall_mid_pages(44, 44) == 1
    assert shortfall_mid_pages(45, 44) == 2
    assert shortfall_mid_pages(1512, 44) == 35
    with pytest.raises(ValueError):
        shortfall_mid_pages(-1, 44)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="high_free_mid"):
        AdjusterConfig(low_free_mid=5, high_free_mid=6)
    cfg = AdjusterConfig(low_free_mid=0, high_free_mid=3, max_grow_per_step=1)
    assert cfg.num_evict(0, 0) == 0 and cfg.num_grow(0, 100) == 1


def test_reclaimable_experts_bounded_by_limits_and_budget() -> None:
    from rimuru.experts.adjuster import reclaimable_experts

    # per layer up to the limit: 5 + 3 + 0
    assert reclaimable_experts([0, 2, 5], 5, None) == 8
    # an adjuster's bound on the total offloaded (7 out now): 10 leaves 3, 7 or less leaves none
    assert reclaimable_experts([0, 2, 5], 5, 10) == 3
    assert reclaimable_experts([0, 2, 5], 5, 7) == 0 and reclaimable_experts([0, 2, 5], 5, 4) == 0
    # per-layer limits
    assert reclaimable_experts([0, 2, 5], [1, 2, 6], None) == 2
