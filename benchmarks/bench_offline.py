"""Offline throughput: N ShareGPT-length requests submitted at once to `LLM`, one engine per mode.

Every mode runs in this one process on identical requests (prompt token ids and output lengths from
ShareGPT, counted with the Qwen vocabulary; EOS ignored, as vLLM's throughput benchmark does), so the
rows are comparable side by side. Per mode it reports output tokens/s, requests/s, peak running
requests, forward steps, preemptions and expert traffic, and keeps the per-step series (running,
waiting, KV pages) for plots.

    PYTHONPATH=. python benchmarks/bench_offline.py --model qwen1.5-moe-a2.7b --load-format dummy \
        --gpu-memory-budget 32GiB --modes static --num-prompts 500 --output-json out.json

`--profile-steps N` adds the step profiler's report (per step kind: host phases, GPU forward time, expert
waits, kernel counts) to each row as `step_profile` and prints its table; timing marks cost ~1 us each.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import metadata  # noqa: E402
from rimuru import LLM, SamplingParams  # noqa: E402
from rimuru.bench.workload import load_tokenizer, sample_sharegpt  # noqa: E402


def warm_up(llm: LLM, vocab: int) -> None:
    """Compiles the kernels for small and large batches before the clock starts."""
    g = torch.Generator().manual_seed(0)
    most = llm.engine.max_model_len - 25
    prompts = [{"prompt_token_ids": torch.randint(10, vocab - 10, (min(n, most),), generator=g).tolist()}
               for n in (7, 33, 130, 600, 2000)]
    llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))


def run_mode(mode: str, args: argparse.Namespace, requests: list[Any]) -> dict[str, Any]:
    engine_args = dict(device=args.device, dtype=args.dtype, gpu_memory_budget=args.gpu_memory_budget,
                       offload_mode=mode, load_format=args.load_format, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                       enforce_eager=args.enforce_eager)
    if mode != "static":
        engine_args.update(resident_experts=args.resident_experts, expert_offload_limit=args.expert_offload_limit)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_args)
    start_s = time.perf_counter() - t0
    engine = llm.engine
    warm_up(llm, engine.spec.vocab_size)
    before = engine.stats()
    too_long = [r for r in requests if len(r.prompt_token_ids) + r.output_len > engine.max_model_len]
    if too_long:
        raise SystemExit(f"{len(too_long)} requests exceed max_model_len={engine.max_model_len}")
    for i, r in enumerate(requests):
        engine.add_request(f"b{i}", r.prompt_token_ids,
                           SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=1.0))
    engine.step_metrics.clear()
    out_tokens = 0
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        if args.profile_steps and steps == args.profile_start:
            engine.enable_step_profiler(args.profile_steps, trace_steps=args.profile_trace_steps)
        outs = engine.step()
        steps += 1
        out_tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    if torch.cuda.is_available():
        print(f"{mode}: CUDA memory reserved at peak {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB "
              f"(budget {engine.config.budget_bytes / 2**30:.2f} GiB)", flush=True)
    timeline = engine.step_metrics.timeline()
    t_start = timeline["t"][0] - timeline["step_time_s"][0] if timeline["t"] else 0.0
    timeline["t"] = [round(t - t_start, 4) for t in timeline["t"]]
    row = {
        "mode": mode,
        "engine_start_s": round(start_s, 2),
        "elapsed_s": round(elapsed, 3),
        "requests": len(requests),
        "output_tokens": out_tokens,
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tok_per_s": round(out_tokens / elapsed, 1),
        "requests_per_s": round(len(requests) / elapsed, 3),
        "forward_steps": after["forward_steps"] - before["forward_steps"],
        "peak_running": max(timeline["running"]),
        "peak_waiting": max(timeline["waiting"]),
        "graph_steps": sum(timeline["cuda_graph"]),
        "expert_evictions": after["expert_evictions"] - before["expert_evictions"],
        "expert_grows": after["expert_grows"] - before["expert_grows"],
        "expert_bytes_loaded": after["expert_bytes_loaded"] - before["expert_bytes_loaded"],
        "prefetch_hits": after["prefetch_hits"] - before["prefetch_hits"],
        "prefetch_misses": after["prefetch_misses"] - before["prefetch_misses"],
        "preemptions": after["preemptions"] - before["preemptions"],
        "kv_pages_total": after["kv_pages_free"] + after["kv_pages_used"],
        "kv_tokens": (after["kv_pages_free"] + after["kv_pages_used"]) // max(1, engine.kv.num_layers)
        * engine.config.block_size,
        "resident_experts": after["resident_experts"],
        "total_experts": after["total_experts"],
        "budget_split": engine.budget_split,
        # what the process really holds on the GPU (weights, pool, activations, graph pools) against the budget
        "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None,
        "gpu_memory_budget_bytes": engine.config.budget_bytes,
        "stats_after": after,
        "timeline": timeline,
    }
    if engine.profiler is not None:
        row["step_profile"] = engine.profiler.report()
        print(f"step profile, {mode} mode (steps {args.profile_start}..{args.profile_start + args.profile_steps - 1}):")
        print(engine.profiler.table(), flush=True)
    assert after["kv_pages_used"] == 0, "pages leaked"
    del llm, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen1.5-moe-a2.7b", help="preset name or model directory")
    ap.add_argument("--modes", default="static")
    ap.add_argument("--num-prompts", type=int, default=500)
    ap.add_argument("--gpu-memory-budget", default="32GiB")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--resident-experts", type=float, default=None)
    ap.add_argument("--expert-offload-limit", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the Qwen vocabulary)")
    ap.add_argument("--max-total-len", type=int, default=2048, help="drop ShareGPT pairs longer than this")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="profile N steps of the measured run (rimuru/engine/step_profiler.py): host phases, GPU "
                    "forward time, expert waits, kernel counts per step kind; written to each row's step_profile")
    ap.add_argument("--profile-start", type=int, default=0, help="first profiled step of the measured run")
    ap.add_argument("--profile-trace-steps", type=int, default=1,
                    help="steps of each kind whose kernels torch.profiler counts (CUDA; left out of the time means)")
    ap.add_argument("--output-json", required=True)
    ap.add_argument("--plot", default=None, help="PNG of the memory split and running/waiting over time")
    args = ap.parse_args()

    requests = sample_sharegpt(load_tokenizer(args.tokenizer), args.num_prompts, seed=args.seed,
                               max_total_len=args.max_total_len, max_prompt_len=min(1024, args.max_total_len // 2))
    meta = metadata("offline_throughput", model=args.model, config=vars(args))
    rows = []
    for mode in args.modes.split(","):
        rows.append(run_mode(mode.strip(), args, requests))
        # written after every mode, so a run cut short by a time limit keeps what it measured
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps({**meta, "rows": rows}, indent=1))
    if args.plot:
        from rimuru.sim.plot import plot_timelines

        plot_timelines({r["mode"]: r for r in rows}, args.plot, f"{args.model}, {args.gpu_memory_budget}, "
                       f"{args.num_prompts} ShareGPT requests at once ({meta['device']})", xlabel="time (s)")
    print(f"{'mode':8} {'out tok/s':>10} {'req/s':>7} {'steps':>6} {'peak run':>8} {'preempt':>7} "
          f"{'kv tokens':>9} {'experts':>9} {'elapsed s':>9}")
    for r in rows:
        print(f"{r['mode']:8} {r['output_tok_per_s']:>10} {r['requests_per_s']:>7} {r['forward_steps']:>6} "
              f"{r['peak_running']:>8} {r['preemptions']:>7} {r['kv_tokens']:>9} "
              f"{r['resident_experts']:>4}/{r['total_experts']:<4} {r['elapsed_s']:>9}")
    print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
