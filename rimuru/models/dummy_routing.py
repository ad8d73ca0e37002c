"""A seeded skewed router for dummy (random) weights: each expert receives a chosen share of the routed assignments.

Random weights route nearly uniformly; real MoE routers do not, and offloading gains depend on the skew. Given
target shares s[l, e] (each layer sums to 1; e.g. `ExpertPopularity.zipf`: the expert of popularity rank r gets a
share proportional to r^-S), every MoE layer's router is made to realise them:

    logits  = G(gate(x))  + b          G: the random logits made standard Gumbel, per expert
    ids     = top-k(logits)            (softmax weights of the same logits, as before)

G(z) = -log(-log(Phi(z / sigma_e))), with Phi the normal CDF and sigma_e = ||gate.weight[e]||: the router's input is
the output of an RMSNorm with unit weights (RMS 1), so a dummy gate row's logit over varied tokens is close to
N(0, sigma_e^2), Phi of it close to uniform, and G of that standard Gumbel. Top-k of Gumbel noise plus b is
sampling k experts without replacement with weights exp(b) (the Gumbel-top-k trick). The bias b is fitted so that
the expected share of each expert among all k x T picks equals the target (`fit_topk_bias`).

Why not simply add the log of the shares to the raw logits: Gaussian logits have light tails, so an expert 4
log-units behind the leaders is almost never picked. With Qwen1.5-MoE's 60 experts and S = 1.0 such a router's
realised shares fall off about as r^-1.7 at the head and faster in the tail (the coldest expert gets ~0.02 % of
the picks against the 0.36 % the flag promises; benchmarks/dummy_router_shares.py, results in
benchmarks/results/2026-11-29-dummy-router-shares-cpu.json), and on the H200 it routes the 240 coldest experts
~4 times per decode step of ~100 tokens, where r^-1 predicts ~200.

No top-k router can give an expert more than 1/k of the picks (a token picks it at most once): target shares
above 1/k are capped there and the rest rescaled (`cap_shares`), e.g. Qwen3-30B-A3B (top-8 of 128) at S = 1.0.
"""

from __future__ import annotations

import numpy as np
import torch

from rimuru.models.causal_lm import MoECausalLM


def cap_shares(shares: np.ndarray, top_k: int) -> np.ndarray:
    """Per layer (rows of [L, E]): the shares with every one above 1/top_k set to 1/top_k and the others scaled up
    to keep the sum 1 (repeated until none exceeds the cap)."""
    s = np.array(shares, dtype=np.float64)
    cap = 1.0 / top_k
    for row in s:
        fixed = np.zeros(row.shape, dtype=bool)
        while (row > cap + 1e-12).any():
            fixed |= row > cap
            row[fixed] = cap
            free = ~fixed
            if row[free].sum() <= 0:  # nothing left to scale up: the capped experts take what they can
                break
            row[free] *= (1.0 - cap * fixed.sum()) / row[free].sum()
    return s


def fit_topk_bias(shares: np.ndarray, top_k: int, samples: int = 1 << 15, iterations: int = 30,
                  seed: int = 0) -> np.ndarray:
    """Log-weights b [L, E] such that top-k of (standard Gumbel noise + b) picks each expert with the (capped)
    target share. Fixed point b <- b + log(target / realised), the realised shares estimated on `samples` Gumbel
    draws (the same draws every iteration, so the fit converges instead of chasing noise). Layers whose sorted
    shares are equal (a power law over a permutation of the experts) share one fit."""
    L, E = np.shape(shares)
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be in [1, {E}]")
    target = cap_shares(shares, top_k)
    order = np.argsort(-target, axis=1, kind="stable")  # per layer: expert ids, largest share first
    sorted_rows = np.take_along_axis(target, order, axis=1)
    unique, which = np.unique(sorted_rows, axis=0, return_inverse=True)
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(samples, E, generator=g).clamp_(1e-7, 1.0 - 1e-7)
    gumbel = -torch.log(-torch.log(u))  # [N, E]
    fitted = np.empty_like(unique)
    floor = 0.5 / (samples * top_k)  # an expert never picked in the draws counts as half a pick
    for row, shares_row in enumerate(unique):
        t = torch.from_numpy(shares_row).float().clamp_min(1e-12)
        b = torch.log(t)
        for _ in range(iterations):
            ids = torch.topk(gumbel + b, top_k, dim=1).indices
            realised = torch.bincount(ids.reshape(-1), minlength=E).float() / (samples * top_k)
            b += torch.log(t / realised.clamp_min(floor))
            b -= b.max()
        fitted[row] = b.double().numpy()
    bias = np.empty_like(target)
    np.put_along_axis(bias, order, fitted[which.reshape(-1)], axis=1)
    return bias


def set_dummy_routing(model: MoECausalLM, shares: np.ndarray, seed: int = 0) -> None:
    """Makes every MoE layer of a dummy-weight model route with the target shares [L_moe, E] (module docstring).
    Call after the gates hold their random weights."""
    layers = model.moe_blocks()
    if not layers or np.shape(shares) != (len(layers), layers[0].router_bias.shape[0]):
        raise ValueError(f"routing shares {np.shape(shares)} do not match {len(layers)} MoE layers")
    bias = fit_topk_bias(shares, layers[0].top_k, seed=seed)
    with torch.no_grad():
        for layer, m in enumerate(layers):
            m.router_bias.copy_(torch.from_numpy(bias[layer]).float())
            m.router_noise_scale.copy_(m.gate.weight.float().norm(dim=1).clamp_min(1e-6))  # a zero row: no 0 / 0
            m.gumbel_routing = True
