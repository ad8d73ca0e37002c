"""Where a decode step's time goes, per batch size: wall, GPU forward, and GPU time per kernel category.

For each batch size B, B requests with a `--context`-token prompt are prefilled, then every request decodes
together (one token each per step), so each measured step is a pure decode step of exactly B rows. Per B:

  * `graph`: N engine steps on the CUDA-graph path (step profiler: host phases, wall, GPU forward time);
  * `eager`: the same N steps with the graphs switched off (`runner.graphs = None`);
  * for each path, torch.profiler over `--trace-steps` steps: GPU time per kernel, summed per category
    (attention, fused MoE, MoE align, GEMM, router top-k, elementwise, ...) and the top kernels by time.

    PYTHONPATH=. python benchmarks/bench_decode_step.py --model qwen1.5-moe-a2.7b --load-format dummy \
        --gpu-memory-budget 32GiB --batch-sizes 1,16,64,128 --context 512 --output-json out.json

On the CPU it runs on a tiny checkpoint (`--tiny qwen2_moe`) as a smoke test; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import metadata  # noqa: E402
from rimuru import LLM, SamplingParams  # noqa: E402

# kernel-name substrings -> category, first match wins (Triton kernels carry their function's name)
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("copy", ("Memcpy", "Memset")),
    ("attention", ("paged_attention", "_merge_splits", "attn")),
    ("kv_write", ("write_kv",)),
    ("moe_align", ("align", "_count_tokens", "_scatter_pairs")),
    ("fused_moe", ("fused_moe", "_moe_")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitK", "s16816", "wgmma", "Kernel2")),
    ("small_fused", ("_rms_norm", "_route_topk", "_silu_and_mul", "_sigmoid_mul_add", "_rotary_qk", "_cos_sin")),
    ("topk_sort", ("topk", "sort", "radix", "bitonic", "gatherTopK")),
    ("softmax", ("softmax",)),
    ("reduce", ("reduce", "Reduce")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "Elementwise", "index", "Index", "cat", "Cat")),
)


def category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


def kernel_table(prof: Any, steps: int) -> dict[str, Any]:
    """GPU time per category and the top kernels, per step (µs), from a torch.profiler run of `steps` steps."""
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if not str(getattr(e, "device_type", "")).endswith("CUDA"):
            continue
        us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) or 0.0
        row = per_name[e.name]
        row[0] += us
        row[1] += 1
    cats: dict[str, float] = defaultdict(float)
    for name, (us, _n) in per_name.items():
        cats[category(name)] += us / steps
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:20]
    total = sum(cats.values())
    return {
        "gpu_us_per_step": round(total, 1),
        "kernels_per_step": round(sum(n for _, n in per_name.values()) / steps, 1),
        "category_us_per_step": {k: round(v, 1) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:120], "category": category(n), "us_per_step": round(us / steps, 1),
                         "calls_per_step": round(c / steps, 1)} for n, (us, c) in top],
    }


def run_steps(engine: Any, n: int) -> dict[str, Any]:
    prof = engine.enable_step_profiler(n, trace_steps=0)
    for _ in range(n):
        engine.step()
    rep = prof.report()
    engine.disable_step_profiler()
    kinds = rep["kinds"]
    kind = next(iter(kinds)) if len(kinds) == 1 else f"mixed kinds {list(kinds)}"
    s = rep["all"]
    return {"kind": kind, "steps": s["steps"], "seqs_mean": s["seqs_mean"], "wall_ms": s["wall_ms"],
            "wall_ms_p50": s["wall_ms_p50"], "gpu_forward_ms": s["gpu_forward_ms"], "host_ms": s["host_ms"]}


def trace_steps(engine: Any, n: int) -> dict[str, Any] | str:
    if engine.device.type != "cuda":
        return "unavailable on the CPU"
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
    return kernel_table(prof, n)


def measure_batch(engine: Any, bs: int, args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator().manual_seed(args.seed + bs)
    vocab = engine.spec.vocab_size
    total_steps = 2 * (args.warmup_steps + args.steps + args.trace_steps) + 8
    ctx = min(args.context, engine.max_model_len - total_steps - 2)
    for i in range(bs):
        ids = torch.randint(10, vocab - 10, (ctx,), generator=g).tolist()
        engine.add_request(f"b{bs}-{i}", ids, SamplingParams(max_tokens=total_steps, ignore_eos=True, temperature=0.0))
    sched = engine.scheduler
    prefill_steps = 0
    while sched.waiting or engine._inbox or any(not r.output_token_ids for r in sched.running):
        engine.step()
        prefill_steps += 1
        if prefill_steps > 10_000:
            raise RuntimeError("prefill did not finish")
    if len(sched.running) != bs:
        raise RuntimeError(f"{len(sched.running)} requests running, expected {bs} (KV pool too small?)")
    row: dict[str, Any] = {"batch_size": bs, "context": ctx, "prefill_steps": prefill_steps}
    runner = engine.runner
    graphs = runner.graphs
    for path in ("graph", "eager"):
        if path == "graph" and graphs is None:
            row[path] = "no CUDA graphs (CPU, --enforce-eager or offloading)"
            continue
        runner.graphs = graphs if path == "graph" else None
        for _ in range(args.warmup_steps):
            engine.step()
        timed = run_steps(engine, args.steps)
        timed["kernels"] = trace_steps(engine, args.trace_steps)
        row[path] = timed
    runner.graphs = graphs
    for r in list(sched.running):
        engine.abort_request(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    if engine.kv.pages_in_use:
        raise RuntimeError(f"{engine.kv.pages_in_use} KV pages still in use after the batch")
    return row


def print_row(r: dict[str, Any]) -> None:
    for path in ("graph", "eager"):
        t = r[path]
        if isinstance(t, str):
            print(f"B={r['batch_size']:<4} {path:6} {t}")
            continue
        k = t["kernels"]
        cats = (" ".join(f"{c}={us:.0f}" for c, us in list(k["category_us_per_step"].items())[:7])
                if isinstance(k, dict) else k)
        kern = f"{k['kernels_per_step']:.0f}k {k['gpu_us_per_step'] / 1e3:.2f}ms" if isinstance(k, dict) else "-"
        print(f"B={r['batch_size']:<4} {path:6} wall {t['wall_ms']:8.2f} ms  gpu fwd {t['gpu_forward_ms'] or 0:8.2f} ms"
              f"  prepare {t['host_ms']['prepare']:6.2f}  readback {t['host_ms']['readback']:6.2f}  "
              f"process {t['host_ms']['process']:6.2f}  | {kern} | {cats}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen1.5-moe-a2.7b", help="preset name or model directory")
    ap.add_argument("--tiny", default=None, help="use a tiny random checkpoint of this architecture (CPU smoke)")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--gpu-memory-budget", default="32GiB")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-sizes", default="1,16,64,128")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of every request")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per path")
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--trace-steps", type=int, default=3, help="steps under torch.profiler per path (CUDA)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", required=True)
    args = ap.parse_args()

    meta = metadata("decode_step", model=args.tiny or args.model, config=vars(args))
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            from rimuru.testing import make_tiny_checkpoint

            model, load_format = str(make_tiny_checkpoint(args.tiny, Path(tmp) / args.tiny, seed=3)), "auto"
        else:
            model, load_format = args.model, args.load_format
        llm = LLM(model, device=args.device, gpu_memory_budget=args.gpu_memory_budget, offload_mode="static",
                  load_format=load_format, max_num_seqs=args.max_num_seqs, seed=args.seed)
        engine = llm.engine
        rows = []
        for bs in (int(x) for x in args.batch_sizes.split(",")):
            rows.append(measure_batch(engine, bs, args))
            print_row(rows[-1])
            Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output_json).write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
