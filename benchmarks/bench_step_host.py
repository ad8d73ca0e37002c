"""Host overhead of one engine step: the Python work around the model, per step, on a tiny model.

A tiny random MoE checkpoint (rimuru.testing) serves many short requests at once, so that the forward
pass is small and the engine's own work (scheduling, batch preparation, sampling glue, outputs) shows.
Per step it measures the wall time of `LLMEngine.step()` and, through hooks, the time inside the model
(forward + logits) and inside the sampler; the rest is host overhead:

    host_us  = step wall - model (forward + logits) - sampler       (per step, median and mean)

Two workloads: `sampled_ids` is bench_offline's (token-id prompts, temperature 1.0, EOS ignored, no
tokenizer, like a preset with dummy weights); `greedy_text` adds incremental detokenisation and greedy
sampling (a server with a tokenizer). On a GPU the same script measures the same split (model time is
then launch time, the GPU runs ahead until the sampler's token read).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_step_host.py --output-json out.json
    PYTHONPATH=. .venv/bin/python benchmarks/bench_step_host.py --cprofile 25   # top functions by own time
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import metadata  # noqa: E402
from rimuru import LLM, SamplingParams  # noqa: E402
from rimuru.testing import make_tiny_checkpoint  # noqa: E402

WORKLOADS = ("sampled_ids", "greedy_text")


class _Clock:
    """Accumulates seconds spent inside wrapped calls (the model and the sampler)."""

    def __init__(self) -> None:
        self.model_s = 0.0
        self.sampler_s = 0.0


def _instrument(llm: LLM, clock: _Clock, sync: bool) -> None:
    runner = llm.engine.runner
    model = runner.model
    t0: list[float] = [0.0]

    def done() -> float:
        if sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def pre(_m: Any, _a: Any) -> None:
        t0[0] = time.perf_counter()

    def post(_m: Any, _a: Any, _o: Any) -> None:
        clock.model_s += done() - t0[0]

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post)
    logits_fn = model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        out = logits_fn(hidden)
        clock.model_s += done() - t
        return out

    model.compute_logits = compute_logits  # type: ignore[method-assign]
    sampler = runner.sampler

    class TimedSampler:
        def __getattr__(self, name: str) -> Any:
            return getattr(sampler, name)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = sampler(*args, **kwargs)
            clock.sampler_s += done() - t
            return out

    runner.sampler = TimedSampler()  # type: ignore[assignment]


def _requests(n: int, seed: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, 25, (n,), generator=g).tolist()
    outs = torch.randint(16, 49, (n,), generator=g).tolist()
    return [(torch.randint(3, 290, (p,), generator=g).tolist(), o) for p, o in zip(lens, outs, strict=True)]


def run_workload(ckpt: Path, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(str(ckpt), device=args.device, gpu_memory_budget=args.gpu_memory_budget,
              max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager)
    engine = llm.engine
    if workload == "sampled_ids":
        engine.tokenizer = None  # as bench_offline on a preset: no tokenizer, no detokenisation
        temperature = 1.0
    else:
        temperature = 0.0
    # warm-up (allocator, kernels), then the measured run on the same requests
    reqs = _requests(args.num_requests, args.seed)
    for i, (p, _) in enumerate(reqs[:16]):
        engine.add_request(f"w{i}", p, SamplingParams(max_tokens=4, ignore_eos=True, temperature=temperature))
    while engine.has_unfinished_requests():
        engine.step()
    clock = _Clock()
    sync = engine.device.type == "cuda"
    _instrument(llm, clock, sync)
    for i, (p, o) in enumerate(reqs):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=o, ignore_eos=True, temperature=temperature,
                                                      seed=None))
    profiler = cProfile.Profile() if args.cprofile else None
    step_prof = engine.enable_step_profiler(1_000_000, trace_steps=0)  # the phase split (~1 us a mark)
    steps: list[dict[str, float]] = []
    tokens = 0
    t_run = time.perf_counter()
    while engine.has_unfinished_requests():
        m0, s0 = clock.model_s, clock.sampler_s
        if profiler is not None:
            profiler.enable()
        t = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - t
        if profiler is not None:
            profiler.disable()
        tokens += len(outs)
        model, sampler = clock.model_s - m0, clock.sampler_s - s0
        steps.append({"wall": wall, "model": model, "sampler": sampler, "host": wall - model - sampler})
    elapsed = time.perf_counter() - t_run
    assert engine.stats()["kv_pages_used"] == 0
    if profiler is not None:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(args.cprofile)
        print(buf.getvalue())

    def us(key: str) -> dict[str, float]:
        xs = [s[key] * 1e6 for s in steps]
        return {"median": round(statistics.median(xs), 1), "mean": round(statistics.fmean(xs), 1)}

    phases = None
    if step_prof.records:
        rep = step_prof.report()
        phases = {"all": rep["all"]["host_ms"], **{k: v["host_ms"] for k, v in rep["kinds"].items()}}
    return {
        "workload": workload,
        "requests": len(reqs),
        "steps": len(steps),
        "outputs": tokens,
        "elapsed_s": round(elapsed, 3),
        "step_wall_us": us("wall"),
        "model_us": us("model"),
        "sampler_us": us("sampler"),
        "host_us": us("host"),
        "host_share": round(sum(s["host"] for s in steps) / sum(s["wall"] for s in steps), 3),
        "step_profiler_host_ms": phases,  # mean ms per step and phase (forward includes the model on the CPU)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen2_moe")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gpu-memory-budget", default="256MiB")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=3, help="runs per workload; the run with the lowest host "
                    "median is kept (the least disturbed by other processes)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cprofile", type=int, default=0, help="print the top N functions by own time")
    ap.add_argument("--baseline-json", default=None, help="an earlier output of this script, kept as 'before'")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    meta = metadata("step_host_overhead", config=vars(args))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(args.arch, Path(tmp) / args.arch, seed=3)
        for workload in args.workloads.split(","):
            runs = [run_workload(ckpt, workload.strip(), args) for _ in range(max(1, args.repeats))]
            rows.append(min(runs, key=lambda r: r["host_us"]["median"]))
    print(f"{'workload':12} {'steps':>6} {'wall us':>9} {'model us':>9} {'sampler us':>10} {'host us':>8} "
          f"{'host mean':>9}")
    for r in rows:
        print(f"{r['workload']:12} {r['steps']:>6} {r['step_wall_us']['median']:>9} {r['model_us']['median']:>9} "
              f"{r['sampler_us']['median']:>10} {r['host_us']['median']:>8} {r['host_us']['mean']:>9}")
    result: dict[str, Any] = {**meta, "rows": rows}
    if args.baseline_json:
        before = json.loads(Path(args.baseline_json).read_text())
        result["before"] = before
        result["host_us_median_before_after"] = {
            r["workload"]: [b["host_us"]["median"], r["host_us"]["median"]]
            for r in rows for b in before["rows"] if b["workload"] == r["workload"]}
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
