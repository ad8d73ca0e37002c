"""The skewed router for dummy weights (models/dummy_routing.py): capped shares, and a bias fit whose Gumbel-top-k
picks realise them, checked on draws independent of the fit's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rimuru.experts.popularity import ExpertPopularity
from rimuru.models.dummy_routing import cap_shares, fit_topk_bias


def realised_shares(bias: np.ndarray, top_k: int, samples: int = 200_000, seed: int = 99) -> np.ndarray:
    """[L, E] share of each expert among the top-k picks of Gumbel noise + bias (torch's own sampling)."""
    L, E = bias.shape
    g = torch.Generator().manual_seed(seed)
    out = np.empty((L, E))
    for layer in range(L):
        gumbel = -torch.log(-torch.log(torch.rand(samples, E, generator=g, dtype=torch.float64).clamp(1e-15, 1)))
        ids = torch.topk(gumbel + torch.from_numpy(bias[layer]), top_k, dim=1).indices
        out[layer] = np.bincount(ids.reshape(-1).numpy(), minlength=E) / (samples * top_k)
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.001, 1.0), min_size=2, max_size=40), st.integers(1, 8))
def test_capped_shares_sum_to_one_and_respect_the_cap(raw: list[float], top_k: int) -> None:
    shares = np.array([raw]) / sum(raw)
    top_k = min(top_k, len(raw))
    capped = cap_shares(shares, top_k)
    assert capped.sum() == pytest.approx(1.0)
    assert (capped <= 1.0 / top_k + 1e-9).all()
    below = capped[0] < 1.0 / top_k - 1e-12  # uncapped experts keep their ratios
    if below.sum() >= 2:
        ratio = capped[0][below] / shares[0][below]
        assert np.allclose(ratio, ratio[0])
    assert capped[0][np.argmax(shares[0])] == pytest.approx(capped.max())  # the most popular stays the most


def test_cap_is_needed_for_qwen3_at_zipf_1() -> None:
    shares = ExpertPopularity.zipf("q3", 1, 128, 1.0, seed=0).probabilities
    assert shares.max() > 1 / 8  # r^-1 gives the top expert 18 %: no top-8 router can
    capped = cap_shares(shares, 8)
    assert capped.max() == pytest.approx(1 / 8) and capped.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("experts, top_k, exponent", [(60, 4, 1.0), (32, 2, 1.2), (16, 1, 0.0)])
def test_fitted_bias_realises_the_shares(experts: int, top_k: int, exponent: float) -> None:
    shares = ExpertPopularity.zipf("m", 3, experts, exponent, seed=1).probabilities  # permuted per layer
    bias = fit_topk_bias(shares, top_k, seed=0)
    got = realised_shares(bias, top_k)
    target = cap_shares(shares, top_k)
    # the fit sees 2^15 draws: a few per cent of noise on the rare experts, less on the popular quarter
    np.testing.assert_allclose(got, target, rtol=0.15)
    head = target >= np.sort(target, axis=1)[:, [-max(1, experts // 4)]]
    np.testing.assert_allclose(got[head], target[head], rtol=0.06)


def test_fitted_bias_of_a_permuted_layer_is_the_permuted_bias() -> None:
    shares = ExpertPopularity.zipf("m", 4, 24, 1.0, seed=3).probabilities
    bias = fit_topk_bias(shares, 2, seed=0)
    order = np.argsort(-shares, axis=1, kind="stable")
    sorted_bias = np.take_along_axis(bias, order, axis=1)
    np.testing.assert_allclose(sorted_bias, np.broadcast_to(sorted_bias[0], sorted_bias.shape))


def test_bad_top_k_is_refused() -> None:
    with pytest.raises(ValueError, match="top_k=9 must be in"):
        fit_topk_bias(np.full((1, 8), 1 / 8), 9)
