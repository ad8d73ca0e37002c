"""How many whole mid pages the KV of finished requests gives back (grows of experts need whole mid pages).

The simulator's pool for a model and budget, every expert resident (static's layout), requests of ShareGPT-like
prompt lengths (50-400 tokens, seeded) allocated and decoded block by block through the KV manager until the step
limit; then half of the running requests finish. Prints the whole free-or-reclaimable mid pages before and after,
and how many mid pages' worth of KV pages the finished requests held. The pool does not fill here (no reclaim, no
preemption): a trial of the allocator's placement alone.

    python benchmarks/kv_mid_page_reuse.py [--model qwen1.5-moe-a2.7b] [--budget 32GiB] [--steps 1500]
"""

from __future__ import annotations

import argparse
import random

from rimuru.config import parse_bytes
from rimuru.engine.kv_cache_manager import KV, KVCacheManager
from rimuru.engine.request import Request
from rimuru.engine.sampling_params import SamplingParams
from rimuru.experts.residency import EXPERT
from rimuru.memory.allocator import PageAllocator
from rimuru.model_spec import load_model_spec
from rimuru.sim.simulator import SimConfig, plan_memory


def trial(model: str, budget: str, steps: int, prefix_caching: bool, seed: int = 0) -> None:
    spec = load_model_spec(model)
    mem = plan_memory(spec, SimConfig(mode="static", budget_bytes=parse_bytes(budget)))
    alloc = PageAllocator(mem.geometry, mem.num_huge_pages)
    alloc.allocate_mid(EXPERT, spec.num_moe_layers * spec.num_experts * 3)  # 3 mid pages an expert
    kv = KVCacheManager(alloc, len(spec.attention_layer_ids), 16, enable_prefix_caching=prefix_caching)
    rnd = random.Random(seed)
    pending = []
    for i in range(90):
        n = rnd.randint(50, 400)
        pending.append(Request(request_id=str(i), seq_id=i, prompt=None,
                               prompt_token_ids=[(i * 1_000_003 + j) % 2**31 for j in range(n)],
                               params=SamplingParams(max_tokens=400, ignore_eos=True), max_tokens=400,
                               eos_token_id=None, arrival_time=0.0))
    live: list[Request] = []
    for _ in range(steps):
        if pending and rnd.random() < 0.3:
            r = pending.pop()
            if kv.allocate(r, r.num_tokens):
                r.num_computed_tokens = r.num_tokens
                live.append(r)
        for r in live:
            if kv.allocate(r, 1):
                r.num_computed_tokens += 1
                r.output_token_ids.append(0)
    used = kv.pages_in_use
    before = alloc.mid_capacity(EXPERT)
    rnd.shuffle(live)
    for r in live[: len(live) // 2]:
        kv.free(r)
    spm = alloc.geometry.smalls_per_mid(KV, EXPERT)
    print(f"prefix caching {'on ' if prefix_caching else 'off'}: {len(live)} running, {used} KV pages, whole mid "
          f"pages {before}; half finished: whole mid pages {alloc.mid_capacity(EXPERT)} of the "
          f"{(used - kv.pages_in_use) // spm} their KV pages fill")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen1.5-moe-a2.7b")
    p.add_argument("--budget", default="32GiB")
    p.add_argument("--steps", type=int, default=1500)
    a = p.parse_args()
    for pc in (True, False):
        trial(a.model, a.budget, a.steps, pc)


if __name__ == "__main__":
    main()
