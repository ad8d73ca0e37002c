"""The host as an expert tier: its read bandwidth, one expert's time on it by threads and tokens, and the decode
step a model could reach with the tier at a budget.

    python benchmarks/bench_host_experts.py                       # Qwen3-30B-A3B shapes, bf16
    python benchmarks/bench_host_experts.py --threads 1 2 4 8 16 --output-json benchmarks/results/host_experts.json

1. Bandwidth: a STREAM-like read (a sum over 256 MiB), the bound of decode on the host.
2. One expert alone (the engine's host compute: experts/host_compute.py) at 1, 2, 4, 8, 16 tokens for each
   thread count, over a scratch layer of random experts (up to 64, 512 MiB) so the weights come from memory;
   dispatch and combine included. Achieved GB/s at 1 token against the read bandwidth.
3. The spread: m = 1, 2, 4, 8, 16 experts in one call on every thread (the compute deals them to min(m, threads)
   workers), one token each: the call's time, the GB/s it reads and S(m), its speedup over m one-expert calls.
4. Ceiling of a decode step at each budget, for uniform and zipf routing, at batch 1 and the given batch:
   resident experts per layer = what 90 % of (budget - non-expert weights - workspace) holds (the elastic start
   leaves 10 % to KV), the least popular offloaded. Per offloaded expert, routed with probability
   q = 1 - (1 - p)^(B k), by n = B k p / q tokens when routed; the tier's choice (experts/expert_tiers.py, with
   the measured spread) for the typical routed set of each layer, whose host part is the sum of its experts'
   times alone on every core (the spread's baseline) over S(expected host experts). The choice itself runs over
   every offloaded expert as a candidate and so reads S at that count, the cost at the expected routed count:
   an approximation of the engine, which chooses over each step's routed experts. step = copies + max(GPU step,
   host part + layers x round trip); tokens/s = B / step.
   Without the tier: step = GPU step + every routed offloaded expert's copy (copies not hidden).
   The GPU step (--gpu-step-ms) and the round trip are inputs: measure them on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import metadata  # noqa: E402
from rimuru.experts.expert_tiers import TierCosts, choose_host_experts  # noqa: E402
from rimuru.experts.host_compute import HostExpertCompute  # noqa: E402
from rimuru.experts.host_profile import (  # noqa: E402
    NO_SPREAD,
    HostExpertTimes,
    HostSpread,
    cpu_matrix_isa,
    measure_expert_times,
    measure_host_bandwidth,
    measure_spread,
    numa_nodes,
    scratch_compute,
)
from rimuru.experts.popularity import ExpertPopularity  # noqa: E402
from rimuru.model_spec import load_model_spec  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def expert_times_by_threads(compute: HostExpertCompute, threads: list[int]) -> dict[int, HostExpertTimes]:
    before = torch.get_num_threads()
    out = {}
    try:
        for n in threads:
            torch.set_num_threads(n)
            out[n] = measure_expert_times(compute)
    finally:
        torch.set_num_threads(before)
    return out


def ceiling(spec, dtype: torch.dtype, budget: float, probs: np.ndarray, batch: int, times: HostExpertTimes,
            pcie: float, gpu_step_s: float, layer_fixed_s: float, workspace: float,
            spread: HostSpread = NO_SPREAD) -> dict[str, float]:
    """The decode step of the module docstring at `budget` bytes with routing `probs` [L, E]."""
    L, E, k = spec.num_moe_layers, spec.num_experts, spec.num_experts_per_tok
    expert_bytes = 3 * spec.moe_intermediate_size * spec.hidden_size * torch.empty((), dtype=dtype).element_size()
    pool = budget - spec.non_expert_bytes(dtype) - workspace
    resident = int(min(E, max(0, 0.9 * pool // expert_bytes // L)))
    copy_s = expert_bytes / pcie
    costs = TierCosts(copy_s=copy_s, host_s=times, layer_fixed_s=layer_fixed_s, spread=spread)
    host_total = copies_tier = copies_none = host_experts = 0.0
    layers_with_host = 0
    for layer in range(L):
        p = np.sort(probs[layer])[::-1][resident:]  # the offloaded: least popular
        q = -np.expm1(batch * k * np.log1p(-np.clip(p, 0, 1 - 1e-12)))  # routed this step
        n = np.maximum(1.0, batch * k * p / np.maximum(q, 1e-12))  # tokens when routed
        copies_none += float(q.sum()) * copy_s
        # expected per-step cost: the tier's choice for the typical routed set of this layer
        cand = [(i, max(1, round(float(t)))) for i, t in enumerate(n)]
        on_host = set(choose_host_experts(cand, costs))
        routed_on_host = sum(float(q[i]) for i in on_host)
        host_part = sum(float(q[i]) * times(n[i]) for i in on_host) / spread(routed_on_host)
        host_total += host_part
        host_experts += routed_on_host
        layers_with_host += bool(on_host)
        copies_tier += sum(float(q[i]) * copy_s for i in range(len(p)) if i not in on_host)
    host_s = host_total + layers_with_host * layer_fixed_s
    step_tier = copies_tier + max(gpu_step_s, host_s)
    step_none = gpu_step_s + copies_none
    return {"resident_per_layer": resident, "offloaded_per_layer": E - resident,
            "host_experts_per_step": host_experts, "host_s": host_s, "copy_s_with_tier": copies_tier,
            "copy_s_without": copies_none, "tok_s_with_tier": batch / step_tier, "tok_s_without": batch / step_none,
            "host_bound_tok_s": batch / host_s if host_s > 0 else float("inf")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", help="preset name or model directory")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="thread counts to measure (default: 1, 2, 4, ... up to the cores)")
    ap.add_argument("--budgets-gib", type=float, nargs="+", default=[48, 24])
    ap.add_argument("--batch", type=int, default=32, help="the saturating batch, beside batch 1")
    ap.add_argument("--pcie-gbps", type=float, default=52.0, help="expert copy bandwidth (the H200 loader: 47-53)")
    ap.add_argument("--gpu-step-ms", type=float, default=11.0,
                    help="the GPU's decode step with every expert resident (Qwen3-30B-A3B on the H200: ~11 ms)")
    ap.add_argument("--layer-fixed-ms", type=float, default=0.05, help="a layer's activation round trip")
    ap.add_argument("--workspace-gib", type=float, default=2.0)
    ap.add_argument("--output-json", type=Path, default=None)
    args = ap.parse_args()

    spec = load_model_spec(args.model)
    dtype = DTYPES[args.dtype]
    cores = os.cpu_count() or 1
    threads = args.threads or [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= cores]
    bandwidth = measure_host_bandwidth()
    print(f"host: {cores} cores, {numa_nodes()} NUMA node(s), {cpu_matrix_isa()}; read {bandwidth / 1e9:.1f} GB/s")
    # one scratch layer of the model's experts (512 MiB at most) for every measurement, a call spread over every core
    compute = HostExpertCompute(scratch_compute(spec.moe_intermediate_size, spec.hidden_size, dtype).store, cores)
    by_threads = expert_times_by_threads(compute, threads)
    expert_bytes = 3 * spec.moe_intermediate_size * spec.hidden_size * torch.empty((), dtype=dtype).element_size()
    print(f"one expert ({expert_bytes / 1e6:.2f} MB, {args.dtype}), ms by tokens:")
    print("threads " + " ".join(f"{t:>8d}" for t in by_threads[threads[0]].tokens) + "   GB/s@1")
    for n, times in by_threads.items():
        gbs = expert_bytes / times.seconds[0] / 1e9
        print(f"{n:7d} " + " ".join(f"{1e3 * s:8.3f}" for s in times.seconds) + f"   {gbs:6.1f}")
    # one expert alone on every core: the spread's baseline, and what the ceilings divide by it
    alone = by_threads[cores] if cores in by_threads else expert_times_by_threads(compute, [cores])[cores]
    before = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        spread = measure_spread(compute)
    finally:
        torch.set_num_threads(before)
    print(f"experts in one call on {cores} threads, 1 token each:")
    print("experts   call ms   GB/s   speedup over one at a time")
    spread_rows = []
    for m, sp, call_s in zip(spread.experts, spread.speedup, spread.call_seconds, strict=True):
        spread_rows.append({"experts": m, "call_ms": 1e3 * call_s, "gbps": m * expert_bytes / call_s / 1e9,
                            "speedup": sp})
        print(f"{m:7d} {1e3 * call_s:9.3f} {m * expert_bytes / call_s / 1e9:6.1f}   {sp:5.2f}")
    routings = {"uniform": ExpertPopularity.uniform(args.model, spec.num_moe_layers, spec.num_experts).probabilities,
                "zipf:1.0": ExpertPopularity.zipf(args.model, spec.num_moe_layers, spec.num_experts, 1.0,
                                                  seed=0).probabilities}
    if not spread.helps:  # the engine then computes a call's experts one after another (runtime_builders)
        print("spreading is slower here than one after another: the ceilings reckon without it")
    spread = spread.used
    rows = []
    for budget in args.budgets_gib:
        for name, probs in routings.items():
            for batch in (1, args.batch):
                c = ceiling(spec, dtype, budget * 2**30, probs, batch, alone, args.pcie_gbps * 1e9,
                            args.gpu_step_ms / 1e3, args.layer_fixed_ms / 1e3, args.workspace_gib * 2**30, spread)
                rows.append({"budget_gib": budget, "routing": name, "batch": batch, **c})
                print(f"{budget:5.0f} GiB {name:9s} batch {batch:3d}: {c['offloaded_per_layer']:3d} offloaded/layer, "
                      f"{c['host_experts_per_step']:6.0f} host experts/step ({1e3 * c['host_s']:6.2f} ms), copies "
                      f"{1e3 * c['copy_s_with_tier']:6.2f} ms -> {c['tok_s_with_tier']:7.1f} tok/s with the tier, "
                      f"{c['tok_s_without']:7.1f} without")
    if args.output_json is not None:
        args.output_json.write_text(json.dumps({
            **metadata("bench_host_experts"),
            "model": args.model, "dtype": args.dtype, "cores": cores, "numa_nodes": numa_nodes(),
            "matrix_isa": cpu_matrix_isa(), "read_bandwidth": bandwidth, "expert_bytes": expert_bytes,
            "expert_ms": {n: [1e3 * s for s in t.seconds] for n, t in by_threads.items()}, "spread": spread_rows,
            "tokens": list(alone.tokens), "inputs": {k: v for k, v in vars(args).items() if k != "output_json"},
            "ceilings": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
