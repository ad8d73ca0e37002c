"""Popularity: ranking file round trip and errors, synthetic routers, EMA estimate and re-rank hysteresis."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rimuru.experts.popularity import (
    ExpertPopularity,
    OnlinePopularity,
    OnlinePopularityConfig,
    PopularityFileError,
)

P = np.array([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]])


def test_rankings_most_popular_first_ties_by_id() -> None:
    pop = ExpertPopularity("m", P, num_prompts=7, date="2026-01-01")
    assert pop.ranking(0) == [1, 3, 2, 0]
    assert pop.ranking(1) == [0, 1, 2, 3]
    assert (pop.num_layers, pop.num_experts) == (2, 4)


def test_file_round_trip(tmp_path) -> None:
    pop = ExpertPopularity("qwen", P, num_prompts=500, date="2026-11-30T00:00:00+00:00")
    path = tmp_path / "r.json"
    pop.save(path)
    data = json.loads(path.read_text())
    assert data["num_layers"] == 2 and data["num_experts"] == 4 and data["num_prompts"] == 500
    back = ExpertPopularity.load(path, num_layers=2, num_experts=4)
    assert back.model == "qwen" and back.date == pop.date and back.num_prompts == 500
    assert np.array_equal(back.probabilities, P)
    assert np.array_equal(back.rankings, pop.rankings)


def _write(tmp_path, **over) -> str:
    data = ExpertPopularity("m", P, num_prompts=3, date="d").to_json()
    data.update(over)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(("over", "msg"), [
    ({"probabilities": [[0.5, 0.5], [0.2, 0.3, 0.5]]}, "different numbers of experts"),
    ({"probabilities": [[0.5, 0.6, 0.0, 0.0], [0.25] * 4]}, "layer 0: probabilities sum to 1.100000"),
    ({"probabilities": [[-0.1, 0.6, 0.5, 0.0], [0.25] * 4]}, "layer 0: probabilities must be finite and >= 0"),
    ({"probabilities": [["a", 0.5, 0.5, 0.0], [0.25] * 4]}, "numbers only"),
    ({"probabilities": []}, "non-empty list"),
    ({"num_experts": 5}, "header says 2 layers x 5 experts"),
    ({"num_prompts": -1}, "num_prompts must be a non-negative integer"),
])
def test_file_errors(tmp_path, over, msg) -> None:
    with pytest.raises(PopularityFileError, match=msg):
        ExpertPopularity.load(_write(tmp_path, **over))


def test_file_errors_missing_key_wrong_model_bad_json(tmp_path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"model": "m", "probabilities": [[1.0]]}))
    missing = r"missing keys \['num_layers', 'num_experts', 'num_prompts', 'date'\]"
    with pytest.raises(PopularityFileError, match=missing):
        ExpertPopularity.load(path)
    with pytest.raises(PopularityFileError, match="for 2 MoE layers x 4 experts, the model has 24 x 60"):
        ExpertPopularity.load(_write(tmp_path), num_layers=24, num_experts=60)
    path.write_text("{")
    with pytest.raises(PopularityFileError, match="not valid JSON"):
        ExpertPopularity.load(path)
    with pytest.raises(PopularityFileError, match="does not exist"):
        ExpertPopularity.load(tmp_path / "nope.json")


def test_uniform_and_zipf() -> None:
    u = ExpertPopularity.uniform("m", 3, 8)
    assert np.allclose(u.probabilities, 1 / 8) and u.ranking(2) == list(range(8))
    z = ExpertPopularity.zipf("m", 3, 8, exponent=1.0, seed=0)
    h8 = sum(1 / r for r in range(1, 9))
    for layer in range(3):
        ranked = z.probabilities[layer, z.rankings[layer]]
        assert np.allclose(ranked, [1 / (r * h8) for r in range(1, 9)])
    assert not np.array_equal(z.rankings[0], z.rankings[1])  # a permutation per layer
    assert np.array_equal(ExpertPopularity.zipf("m", 3, 8, 1.0, seed=0).rankings, z.rankings)  # seeded
    assert np.array_equal(ExpertPopularity.from_routing("m", "zipf:1.0", 3, 8, seed=0).probabilities,
                          z.probabilities)
    assert np.allclose(ExpertPopularity.from_routing("m", "zipf:0", 3, 8, seed=0).probabilities, 1 / 8)
    with pytest.raises(ValueError, match="unknown routing"):
        ExpertPopularity.from_routing("m", "pareto", 3, 8, seed=0)


def test_ema_update_exact() -> None:
    prior = ExpertPopularity("m", np.array([[0.5, 0.3, 0.2]]))
    online = OnlinePopularity(prior, OnlinePopularityConfig(decay=0.5, prior_weight=10.0, rerank_margin=0.25))
    online.update(np.array([[0, 0, 10]]))
    online.update(np.array([[0, 0, 10]]))
    # counts: 0.5 * [0, 0, 10] + [0, 0, 10] = [0, 0, 15]; the prior [5, 3, 2] is added, never decayed
    assert np.allclose(online.counts, [[0.0, 0.0, 15.0]])
    assert np.allclose(online.smoothed_counts(), [[5.0, 3.0, 17.0]])
    assert np.allclose(online.estimate().probabilities, [[5 / 25, 3 / 25, 17 / 25]])
    with pytest.raises(ValueError, match="shape"):
        online.update(np.zeros((2, 3)))


def test_an_expert_never_routed_keeps_a_share_of_its_prior() -> None:
    # however long the traffic avoids experts 0 and 1, their estimate stays at prior_weight * p / (window + prior):
    # the decayed counts of 10 a step sum to 10 / (1 - 0.5) = 20, the prior to 10
    prior = ExpertPopularity("m", np.array([[0.5, 0.3, 0.2]]))
    online = OnlinePopularity(prior, OnlinePopularityConfig(decay=0.5, prior_weight=10.0))
    for _ in range(2000):
        online.update(np.array([[0, 0, 10]]))
    assert np.allclose(online.probabilities(), [[5 / 30, 3 / 30, 22 / 30]])
    # without a prior weight the estimate is the decayed counts alone (and uniform before any count)
    bare = OnlinePopularity(prior, OnlinePopularityConfig(decay=0.5, prior_weight=0.0))
    assert np.allclose(bare.probabilities(), 1 / 3)
    bare.update(np.array([[0, 0, 10]]))
    assert np.allclose(bare.probabilities(), [[0.0, 0.0, 1.0]])


def test_rerank_only_when_order_changed_materially() -> None:
    prior = ExpertPopularity("m", np.array([[0.5, 0.3, 0.2], [0.4, 0.35, 0.25]]))
    online = OnlinePopularity(prior, OnlinePopularityConfig(decay=1.0, prior_weight=100.0, rerank_margin=0.25))
    # layer 1: expert 1 overtakes expert 0 by 10 % (38.5 vs 35) -> noise, no re-rank
    online.update(np.array([[0, 0, 0], [0, 3.5, 0]]))
    online.counts[1, 0] -= 5  # 35 vs 38.5
    assert online.stale_layers() == []
    assert online.maybe_rerank() == []
    assert online.rankings[1].tolist() == [0, 1, 2]
    # layer 0: expert 2 reaches 20 + 30 = 50 > 1.25 * 30 (expert 1, ranked above it) -> re-rank layer 0 only
    online.update(np.array([[0, 0, 30], [0, 0, 0]]))
    assert online.maybe_rerank() == [0]
    assert online.rankings[0].tolist() == [0, 2, 1]  # 50, 50 -> tie by id; then 30
    assert online.rankings[1].tolist() == [0, 1, 2]
    assert online.num_reranks == 1
    assert online.maybe_rerank() == []  # stable once re-ranked


def test_traffic_shift_reranks_after_decay() -> None:
    prior = ExpertPopularity("m", np.array([[0.7, 0.2, 0.1]]))
    online = OnlinePopularity(prior, OnlinePopularityConfig(decay=0.9, prior_weight=10.0, rerank_margin=0.25))
    shifted = np.array([[1.0, 2.0, 7.0]])  # 10 routed per step, expert 2 now the hottest
    # after n steps, x = 1 - 0.9^n: counts 10 x [1, 2, 7] plus the prior [7, 2, 1]:
    # e0 = 7 + 10x, e1 = 2 + 20x, e2 = 1 + 70x, towards [17, 22, 71]
    reranks = []
    for n in range(1, 40):
        online.update(shifted)
        if online.maybe_rerank():
            reranks.append((n, online.rankings[0].tolist()))
    # n=1 (x=0.1):   e2 = 8    > 1.25 * e1 = 5                   -> [0, 2, 1]
    # n=2 (x=0.19):  e2 = 14.3 > 1.25 * e0 = 11.1                -> [2, 0, 1]
    # n=22 (x=0.90): e1 = 20.03 > 1.25 * e0 = 20.02              -> [2, 1, 0], the shifted traffic's order
    assert reranks == [(1, [0, 2, 1]), (2, [2, 0, 1]), (22, [2, 1, 0])]


def test_observe_looks_for_stale_layers_every_rerank_interval_updates() -> None:
    # expert 2 overtakes both others at the first update; the re-rank waits for the rerank_interval-th update
    prior = ExpertPopularity("m", np.array([[0.5, 0.3, 0.2]]))
    online = OnlinePopularity(prior, OnlinePopularityConfig(decay=1.0, prior_weight=100.0, rerank_interval=3))
    hot = np.array([[0.0, 0.0, 100.0]])
    assert online.observe(hot) == [] and online.observe(hot) == []
    assert online.rankings[0].tolist() == [0, 1, 2] and online.stale_layers() == [0]
    assert online.observe(hot) == [0] and online.rankings[0].tolist() == [2, 0, 1]
    assert online.num_updates == 3 and online.num_reranks == 1
    with pytest.raises(ValueError, match="rerank_interval must be >= 1"):
        OnlinePopularityConfig(rerank_interval=0)


def test_probabilities_are_kept_until_the_next_update() -> None:
    online = OnlinePopularity(ExpertPopularity("m", np.array([[0.5, 0.3, 0.2]])),
                              OnlinePopularityConfig(decay=0.5, prior_weight=10.0))
    first = online.probabilities()
    assert online.probabilities() is first and not first.flags.writeable
    online.update(np.array([[0, 0, 10]]))
    second = online.probabilities()
    assert second is not first and np.allclose(second, [[5 / 20, 3 / 20, 12 / 20]])
    assert np.allclose(first, [[0.5, 0.3, 0.2]])  # the earlier answer is not overwritten
