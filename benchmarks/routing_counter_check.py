"""Do the elastic runtime's routing counts say what the router picks? Qwen1.5-MoE shapes, dummy weights.

    N=48 M=150 PYTHONPATH=. python3 benchmarks/routing_counter_check.py graphs|eager BUDGET   (MODEL, N, M: env)

N random-token prompts of 100-1,000 tokens, M greedy tokens each, through the offline API in elastic mode. The counts
the routing counter hands the elastic core (`ElasticCore.observe_routing`) are summed over the run: per layer, how
many experts got none, and the least and most any got (shares of the layer's picks). `eager` also hooks the router
(`SparseMoE.route`) and compares its picks with the counter's totals; `graphs` (the default serving path: CUDA graphs,
async scheduling) reports the counter's side only, since graph replays do not run Python hooks. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import rimuru.models.moe as moe
from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in ("graphs", "eager"):
        raise SystemExit("usage: routing_counter_check.py graphs|eager BUDGET   (e.g. graphs 32GiB)")
    mode, budget = sys.argv[1], sys.argv[2]
    eager = mode == "eager"
    hook = []
    if eager:
        route = moe.SparseMoE.route

        def hooked(self, x):  # type: ignore[no-untyped-def]
            w, ids = route(self, x)
            hook.append((self.moe_idx, ids.detach().clone()))
            return w, ids

        moe.SparseMoE.route = hooked  # type: ignore[method-assign]
    llm = LLM(os.environ.get("MODEL", "qwen1.5-moe-a2.7b"), load_format="dummy", gpu_memory_budget=budget,
              offload_mode="elastic", enforce_eager=eager)
    core = llm.engine.runtime.core
    raw = np.zeros(core.popularity.counts.shape)
    steps = [0]
    observe = core.observe_routing

    def observed(routed: np.ndarray) -> None:
        raw[:] += routed
        steps[0] += 1
        observe(routed)

    core.observe_routing = observed  # type: ignore[method-assign]
    hook.clear()
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 150000, size=int(rng.integers(100, 1000))).tolist()}
               for _ in range(int(os.environ.get("N", "64")))]
    out = llm.generate(prompts, SamplingParams(max_tokens=int(os.environ.get("M", "200")), temperature=0.0,
                                               ignore_eos=True))
    st = llm.stats()
    total = np.maximum(raw.sum(1), 1)
    res = {"mode": mode, "steps_observed": steps[0], "evictions": st.get("expert_evictions"),
           "counter_total": float(raw.sum()), "zero_experts_per_layer": (raw == 0).sum(1).tolist(),
           "min_share_per_layer": (raw.min(1) / total).round(5).tolist(),
           "max_share_per_layer": (raw.max(1) / total).round(4).tolist()}
    if eager:
        picks = np.zeros_like(raw)
        for layer, ids in hook:
            picks[layer] += np.bincount(ids.reshape(-1).cpu().numpy(), minlength=raw.shape[1])
        res["hook_total"] = float(picks.sum())
        res["hook_zero_experts_per_layer"] = (picks == 0).sum(1).tolist()
        res["max_abs_diff_counter_vs_hook"] = float(np.abs(picks - raw).max())
    res["distinct_tokens_first4"] = [len(set(o.outputs[0].token_ids)) for o in out[:4]]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
