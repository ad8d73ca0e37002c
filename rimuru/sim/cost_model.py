"""Step time of one forward pass without a GPU: a roofline for compute plus PCIe copies of offloaded experts.

    compute = combine(FLOPs / (peak_flops * flops_efficiency), HBM bytes / (hbm_bandwidth * bandwidth_efficiency))
              + layer_overhead * transformer layers
    combine = max (the roofline: compute and memory traffic overlap) or + (`compute_plus_memory`, the form the H200
              profile is fitted in, rimuru/sim/calibration.py: kernels of a step are each bound by one or the other)
    copies  = PCIe bytes / pcie_bandwidth
    step    = step_overhead + compute + max(0, copies - copy_overlap * compute) + piecewise
    piecewise = piecewise_overhead_per_layer * MoE layers when any expert is offloaded (the engine then replays
                piecewise CUDA graphs, cut at every MoE layer, instead of whole ones), else 0
  direct access (offload_access="direct": the MoE kernel reads activated offloaded experts in host memory):
    reads   = activated offloaded experts' bytes / pcie_bandwidth, inside the kernel: not hidden behind compute
              (benchmarks/bench_direct_host_moe.py: each routed host-read expert adds its full read time)
    step    = step_overhead + compute + reads + max(0, grow copies - copy_overlap * compute); whole graphs, so no
              piecewise overhead

FLOPs: 2 per weight per token for every non-embedding weight a token passes through (attention, shared
expert, router, its top-k routed experts; lm_head only for rows that are sampled) plus attention scores
and values (4 * heads * head_dim per (query, key) pair, causal within a prefill chunk).
HBM bytes: every non-expert weight once per step, every *activated resident* expert once, the KV cache
the step attends over, and the KV it writes.
Activated experts: with p[l, e] the routing share (a popularity), one token picks expert e with
probability q = min(1, top_k * p); among T tokens it is activated with probability 1 - (1 - q)^T, summed
over experts for the expected count. Activated experts that are not resident cross PCIe every step
(the load buffers hold them only for their layer), as do experts grown this step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rimuru.model_spec import ModelSpec, dtype_bytes

# Per MoE layer, what a pass with experts offloaded (piecewise CUDA graphs) costs beyond one with every expert
# resident (whole graphs), as the engine measured it on the H200 (Qwen1.5-MoE at 10 req/s: GPU forward 7.24 against
# static's 5.45 ms over 24 MoE layers; static's figure is in
# benchmarks/results/2026-11-29-serve-qwen1.5-32gib-uniform-static-h200.json). The engine measures its own at
# start-up; the simulator's H200 profile uses this figure.
H200_PIECEWISE_OVERHEAD_PER_LAYER_S = 75e-6

# The fixed term of the simulated engine's workspace bound (engine/setup.workspace_bytes): kernel scratch, cuBLAS
# workspaces, kernel images, the graphs' pool and fragmentation, from the engine's probes on the H200
# (benchmarks/probe_workspace.py, Qwen1.5-MoE, 256 sequences: 1,620 MB at T = 4096 and 1,492 MB at T = 2048, ~62 kB
# per token on ~1.36 GB; with the bound's 83 kB per token this covers both; tests/test_engine.py holds it to every
# committed probe). The engine itself measures its workspace at start-up; the simulator has no GPU to measure.
H200_WORKSPACE_SCRATCH = 896 * 2**20


@dataclass(frozen=True)
class HardwareConfig:
    name: str = "h200"
    # bf16 dense GEMM and device-to-device copy, measured on the H200 (the `ceilings` of
    # benchmarks/results/2026-11-29-fused-moe-h200.json)
    peak_flops: float = 779e12
    hbm_bandwidth: float = 4.26e12
    # the roofline's shares of peak (the defaults; the h200 profile below replaces them with its fit)
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    # pinned host-to-device, measured on the H200 (55 GB/s plain, 47-53 through the loader:
    # benchmarks/results/2026-11-29-expert-transfer-h200.json)
    pcie_bandwidth: float = 55e9
    copy_overlap: float = 1.0  # copies hide behind this share of compute (1: a perfect side stream)
    step_overhead_s: float = 0.0  # per-step launch / scheduling time (CUDA graphs: ~0)
    layer_overhead_s: float = 0.0  # per transformer layer and pass, whatever its size (small kernels, latencies)
    compute_plus_memory: bool = False  # compute = FLOP time + byte time (fitted profiles) instead of their max
    # per MoE layer, a pass with experts offloaded (piecewise graphs) against one with all resident (whole graphs)
    piecewise_overhead_per_layer_s: float = H200_PIECEWISE_OVERHEAD_PER_LAYER_S
    workspace_scratch_bytes: int = H200_WORKSPACE_SCRATCH  # the workspace bound's fixed term
    # hybrid models, per linear-attention (gated DeltaNet) layer and pass, beyond what the roofline terms price: its
    # kernels in every pass (conv, recurrence, gated norm), and in a pass with prefill rows the eager stretch that
    # runs its prefill sequences between two pieces of the mixed graph (host-bound: fla's chunk launches)
    linear_layer_s: float = 0.0
    linear_prefill_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("peak_flops", "hbm_bandwidth", "flops_efficiency", "bandwidth_efficiency", "pcie_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.copy_overlap <= 1.0:
            raise ValueError(f"copy_overlap must be in [0, 1], got {self.copy_overlap}")
        for name in ("step_overhead_s", "layer_overhead_s", "piecewise_overhead_per_layer_s", "linear_layer_s",
                     "linear_prefill_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


HARDWARE = {
    # fitted to 24 kinds of static passes served on the H200 (Qwen1.5-MoE and Qwen3-30B shapes, uniform and zipf
    # routing): 4 % rms error, 10 % at most, where the roofline above missed by 24 % rms (mixed passes by ~40 %);
    # fitted on Qwen1.5 alone it predicts Qwen3's passes within 7 %. benchmarks/calibrate_simulator.py,
    # benchmarks/results/2026-12-01-sim-calibration-static-steps-h200.json (sim/calibration.py says why a sum)
    # The linear-attention terms (hybrid models), fitted on top to the two kinds of Qwen3.5-35B-A3B static passes of
    # one served point (two passes, two terms: an exact solve, no check): benchmarks/calibrate_simulator.py
    # --linear-layers, benchmarks/results/2026-12-07-sim-calibration-linear-layers-qwen3.5-35b-h200.json
    "h200": HardwareConfig(flops_efficiency=0.3459, bandwidth_efficiency=1.475, layer_overhead_s=115.1e-6,
                           compute_plus_memory=True, linear_layer_s=165.8e-6, linear_prefill_s=1.477e-3),
    # fitted to 38 passes served on an H100 80GB HBM3, static mode: every all-resident decode batch group of the step
    # profiler (Qwen1.5-MoE uniform at 20/40/60 req/s, Qwen3-30B zipf 1.0 at 8 req/s) on its own, and the mixed
    # kinds' means: 3.6 % rms error, 18 % at most (a Qwen3 mixed pass). Decode by batch group, not the decode kind's
    # mean: a pass's time is concave in the batch, so a mean time at the mean batch reads low (16-21 % at 20+).
    # benchmarks/results/2026-12-07-sim-calibration-static-steps-by-batch-h100.json. The shares are of the H200's
    # measured ceilings above (the H100's were not measured; a step's time depends only on the products), and the
    # PCIe bandwidth, piecewise overhead and workspace term are the H200 host's: not measured on the H100's. The
    # linear-attention terms, fitted on top to 10 Qwen3.5-35B-A3B static passes (8 decode batch groups, 2 mixed kinds,
    # 4 and 8 req/s): 4.2 % rms, 11 % at most, where the profile without them missed by 31 % rms (mixed passes by
    # 61-64 %); benchmarks/results/2026-12-07-sim-calibration-linear-layers-qwen3.5-35b-h100.json
    "h100": HardwareConfig(name="h100", flops_efficiency=0.4881, bandwidth_efficiency=0.7718, layer_overhead_s=78.39e-6,
                           compute_plus_memory=True, linear_layer_s=66.46e-6, linear_prefill_s=1.446e-3),
    # RTX 5090 as the paper ran it (CUDA graphs off): 1.79 TB/s GDDR7, 209.5 TFLOP/s dense bf16, PCIe 5.0;
    # eager launch overhead 32 ms/step = our H200's eager TPOT (40 ms) minus its CUDA-graph TPOT (7.8 ms).
    # eager: no graphs, so no piecewise overhead either
    "rtx5090": HardwareConfig(name="rtx5090", peak_flops=209.5e12, hbm_bandwidth=1.79e12, step_overhead_s=0.032,
                              piecewise_overhead_per_layer_s=0.0),
}


@dataclass(frozen=True)
class StepCost:
    time_s: float
    compute_s: float
    copy_s: float
    flops: float
    hbm_bytes: float
    pcie_bytes: float
    activated_experts: float  # expected, all layers
    offloaded_activated: float  # expected, all layers
    piecewise_s: float = 0.0  # the piecewise-graph overhead in time_s (experts offloaded)
    read_s: float = 0.0  # direct access: the kernel's reads of offloaded experts over PCIe, in time_s


class CostModel:
    def __init__(self, spec: ModelSpec, probabilities: np.ndarray, hardware: HardwareConfig,
                 dtype: str = "bfloat16") -> None:
        self.spec = spec
        self.hw = hardware
        el = dtype_bytes(dtype)
        h = spec.hidden_size
        embed = spec.vocab_size * h
        lm_head = embed  # tied or not, the head is a [vocab, hidden] GEMM
        self.lm_head_params = lm_head
        # weights every token passes through, except the embedding lookup, lm_head and routed experts
        self.dense_params = spec.non_expert_params() - embed - (0 if spec.tie_word_embeddings else lm_head)
        self.expert_params = 3 * spec.expert_matrix_numel  # one routed expert
        self.expert_bytes = self.expert_params * el
        self.non_expert_bytes = spec.non_expert_bytes(dtype)
        self.kv_bytes_per_token = spec.kv_bytes_per_token(dtype)
        self.attn_width = spec.num_attention_heads * spec.head_dim
        self.num_attn_layers = len(spec.attention_layer_ids)
        # hybrid models: every scheduled sequence reads and writes its whole state once per step, and each token
        # updates and reads every linear layer's [Hv, dk, dv] state (about 6 flops per element: decay, S^T k,
        # the rank-1 update, S^T q)
        self.state_bytes_per_request = spec.state_bytes_per_request(dtype)
        self.num_linear_layers = len(spec.linear_layer_ids)
        self.state_flops_per_token = 6.0 * len(spec.linear_layer_ids) * (
            spec.linear_num_value_heads * spec.linear_key_head_dim * spec.linear_value_head_dim)
        self.top_k = spec.num_experts_per_tok
        self.q = np.minimum(1.0, self.top_k * np.asarray(probabilities, dtype=np.float64))  # [L, E]
        self._log_miss = np.log1p(-np.minimum(self.q, 1.0 - 1e-12))  # log(1 - q), finite

    def activation(self, num_tokens: int) -> np.ndarray:
        """[L, E]: probability that each expert is routed to by at least one of `num_tokens` tokens."""
        return -np.expm1(num_tokens * self._log_miss)

    def step(self, chunks: Sequence[tuple[int, int]], num_sampled: int, resident: np.ndarray,
             grown: int = 0, direct: bool = False) -> StepCost:
        """`chunks`: (tokens computed before, new tokens) per scheduled sequence; `resident`: [L, E] bool;
        `direct`: offloaded experts are read by the kernel in host memory, not copied first."""
        T = sum(n for _, n in chunks)
        pairs = sum(n * (start + (n + 1) / 2) for start, n in chunks)  # causal (query, key) pairs
        context = sum(start + n for start, n in chunks)
        act = self.activation(T)
        activated = float(act.sum())
        offloaded = float(act[~resident].sum())
        flops = 2.0 * T * (self.dense_params + self.spec.num_moe_layers * self.top_k * self.expert_params)
        flops += 2.0 * num_sampled * self.lm_head_params
        flops += 4.0 * self.attn_width * pairs * self.num_attn_layers + T * self.state_flops_per_token
        hbm = (self.non_expert_bytes + (activated - offloaded) * self.expert_bytes
               + context * self.kv_bytes_per_token + T * self.kv_bytes_per_token
               + 2 * len(chunks) * self.state_bytes_per_request)
        pcie = (offloaded + grown) * self.expert_bytes
        hw = self.hw
        flop_s = flops / (hw.peak_flops * hw.flops_efficiency)
        byte_s = hbm / (hw.hbm_bandwidth * hw.bandwidth_efficiency)
        compute = ((flop_s + byte_s) if hw.compute_plus_memory else max(flop_s, byte_s)) \
            + hw.layer_overhead_s * self.spec.num_hidden_layers
        if self.num_linear_layers:
            prefill = any(n > 1 for _, n in chunks)
            compute += self.num_linear_layers * (hw.linear_layer_s + (hw.linear_prefill_s if prefill else 0.0))
        read = offloaded * self.expert_bytes / hw.pcie_bandwidth if direct else 0.0
        copy = (grown * self.expert_bytes if direct else pcie) / hw.pcie_bandwidth
        piecewise = self.piecewise_overhead_s if not (direct or resident.all()) else 0.0
        time = hw.step_overhead_s + compute + read + max(0.0, copy - hw.copy_overlap * compute) + piecewise
        return StepCost(time_s=time, compute_s=compute, copy_s=copy, flops=flops, hbm_bytes=hbm, pcie_bytes=pcie,
                        activated_experts=activated, offloaded_activated=offloaded, piecewise_s=piecewise,
                        read_s=read)

    @property
    def piecewise_overhead_s(self) -> float:
        """What a pass with any expert offloaded costs beyond one with all resident (whole model)."""
        return self.hw.piecewise_overhead_per_layer_s * self.spec.num_moe_layers
