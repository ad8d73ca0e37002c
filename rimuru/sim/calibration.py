"""The simulator's step time fitted to passes measured on a GPU.

The cost model (cost_model.py) turns a pass into FLOPs, HBM bytes and a number of transformer layers. A fitted
profile prices them as a sum,

    time = FLOPs / (peak_flops * flops_efficiency) + HBM bytes / (hbm_bandwidth * bandwidth_efficiency)
           + layer_overhead_s * layers

(`compute_plus_memory`): a step's kernels are each bound by one or the other, and every layer costs launches and
small kernels whatever the batch. The three coefficients come from a least-squares fit of the relative error over
measured passes (`StepSample`: the batch of a step kind of a served point, and the GPU time of its forward pass, as
the step profiler reports them). They are what fits, not what the hardware promises: a bandwidth efficiency above 1
says the model counts more bytes than the passes read (activations in L2, expert reads of kernels that overlap).
benchmarks/calibrate_simulator.py reads serve_sweep files into samples and writes the fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from rimuru.model_spec import ModelSpec
from rimuru.sim.cost_model import CostModel, HardwareConfig


@dataclass(frozen=True)
class StepSample:
    """One measured kind of pass: `chunks` (tokens computed before, new tokens) per sequence, as cost_model.step
    takes them, every expert resident."""

    spec: ModelSpec
    probabilities: np.ndarray  # [L, E] the routing shares the pass saw
    chunks: tuple[tuple[int, int], ...]
    num_sampled: int
    measured_s: float
    label: str = ""


def decode_chunks(num_seqs: float, context: float) -> tuple[tuple[int, int], ...]:
    """A decode pass of `num_seqs` sequences with `context` tokens each already computed."""
    return ((max(0, round(context)), 1),) * max(1, round(num_seqs))


def mixed_chunks(num_tokens: float, num_seqs: float, context: float) -> tuple[tuple[int, int], ...]:
    """A mixed pass of `num_tokens` tokens over `num_seqs` sequences: one prefill chunk, the others decoding."""
    decoding = max(0, round(num_seqs) - 1)
    return decode_chunks(decoding, context)[:decoding] + ((0, max(1, round(num_tokens) - decoding)),)


def _terms(sample: StepSample, base: HardwareConfig) -> tuple[float, float, float]:
    """(FLOPs at peak, bytes at full bandwidth, layers): the pass's time is their dot product with (1 / flops
    efficiency, 1 / bandwidth efficiency, layer overhead)."""
    cost = CostModel(sample.spec, sample.probabilities, base).step(
        list(sample.chunks), sample.num_sampled, np.ones(sample.probabilities.shape, dtype=bool))
    return cost.flops / base.peak_flops, cost.hbm_bytes / base.hbm_bandwidth, float(sample.spec.num_hidden_layers)


def fit_step_time(samples: Sequence[StepSample], base: HardwareConfig) -> tuple[HardwareConfig, np.ndarray]:
    """`base` with flops_efficiency, bandwidth_efficiency and layer_overhead_s fitted to `samples` (the sum form),
    and the fitted profile's time of each sample. Raises ValueError when the samples cannot fix three positive
    coefficients (too few, or a fit that would give a term a negative price)."""
    if len(samples) < 3:
        raise ValueError(f"a step-time fit needs at least 3 measured passes, got {len(samples)}")
    terms = np.array([_terms(s, base) for s in samples])  # [n, 3]
    measured = np.array([s.measured_s for s in samples])
    if (measured <= 0).any():
        raise ValueError("measured pass times must be positive")
    target = measured - base.step_overhead_s  # the per-step overhead stays as the profile has it
    weight = 1.0 / measured  # least squares on the relative error
    coef, *_ = np.linalg.lstsq(terms * weight[:, None], target * weight, rcond=None)
    if (coef <= 0).any():
        raise ValueError(f"the fit gives a non-positive price to a term (1/flops_eff, 1/bandwidth_eff, layer s): "
                         f"{coef.tolist()}; measure passes of more different sizes")
    fitted = replace(base, flops_efficiency=float(1.0 / coef[0]), bandwidth_efficiency=float(1.0 / coef[1]),
                     layer_overhead_s=float(coef[2]), compute_plus_memory=True)
    return fitted, terms @ coef + base.step_overhead_s


def fit_linear_layer_terms(samples: Sequence[StepSample], base: HardwareConfig) -> tuple[HardwareConfig, np.ndarray]:
    """`base` with linear_layer_s and linear_prefill_s fitted to a hybrid model's passes (its other terms kept: they
    are fitted to attention-only models' passes), and the fitted profile's time of each sample. What `base` leaves
    unpriced per linear-attention layer is the mean residual of the pure-decode samples (linear_layer_s), and beyond
    it that of the samples with prefill rows (linear_prefill_s). Raises ValueError without samples of both kinds, or
    where a term would come out negative."""
    bare = replace(base, linear_layer_s=0.0, linear_prefill_s=0.0)

    def cost(s: StepSample, hw: HardwareConfig) -> float:
        return CostModel(s.spec, s.probabilities, hw).step(
            list(s.chunks), s.num_sampled, np.ones(s.probabilities.shape, dtype=bool)).time_s

    decode, prefill = [], []
    for s in samples:
        n = len(s.spec.linear_layer_ids)
        if not n:
            raise ValueError(f"{s.label or 'a sample'}: not a hybrid model's pass")
        residual = (s.measured_s - cost(s, bare)) / n
        (prefill if any(k > 1 for _, k in s.chunks) else decode).append(residual)
    if not decode or not prefill:
        raise ValueError(f"the linear-layer terms need decode passes and passes with prefill rows, got {len(decode)} "
                         f"and {len(prefill)}")
    layer = float(np.mean(decode))
    stretch = float(np.mean(prefill)) - layer
    if layer < 0 or stretch < 0:
        raise ValueError(f"the fit gives a negative linear-layer term (per layer {layer:.3g} s, prefill "
                         f"{stretch:.3g} s)")
    fitted = replace(base, linear_layer_s=layer, linear_prefill_s=stretch)
    return fitted, np.array([cost(s, fitted) for s in samples])

