"""Bulk allocate + free of small (KV) pages as the scheduler does it; prints microseconds per page.

    .venv/bin/python benchmarks/bench_allocator.py --output-json benchmarks/results/<date>-allocator-cpu.json

Scenarios (Qwen1.5-MoE-A2.7B geometry: KV page 128 KiB = 1/44 of an expert page; 32 GiB pool):
  prefill  one request allocates `--prefill-pages` pages at once (2,000 tokens x 24 layers / 16 = 3,000;
           the default 6,000 is a 4,000-token prompt), then frees them.
  decode   `--decode-requests` running requests each allocate one block for every attention layer per step
           (24 pages), interleaved, for `--decode-steps` steps; then every request frees its pages.
  churn    decode steps where a random tenth of the requests finish and new ones prefill 480 pages (320 tokens).
Target: under 1 us per page for allocate + free.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rimuru.bench.cli import git_commit as source_commit
from rimuru.memory import PageAllocator, PageGeometry
from rimuru.model_spec import load_model_spec


def timed(fn: Callable[[], int], repeats: int) -> float:
    """Best of `repeats` runs of fn (which returns how many pages it moved), in microseconds per page."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        pages = fn()
        best = min(best, (time.perf_counter() - t0) / pages * 1e6)
    return best


def bench_prefill(a: PageAllocator, pages: int, repeats: int) -> dict[str, float]:
    held: list[int] = []

    def alloc() -> int:
        held[:] = a.allocate_small("kv", pages, owner="prefill")
        return pages

    def free() -> int:
        a.free_small("kv", held)
        return pages

    t_alloc = t_free = float("inf")
    for _ in range(repeats):
        t_alloc = min(t_alloc, timed(alloc, 1))
        t_free = min(t_free, timed(free, 1))
    return {"alloc_us_per_page": t_alloc, "free_us_per_page": t_free, "total_us_per_page": t_alloc + t_free}


def bench_decode(a: PageAllocator, requests: int, steps: int, layers: int, repeats: int) -> dict[str, float]:
    held: dict[int, list[int]] = {}

    def run_steps() -> int:
        held.clear()
        for _ in range(steps):
            for r in range(requests):
                held.setdefault(r, []).extend(a.allocate_small("kv", layers, owner=r))
        return requests * steps * layers

    def free_all() -> int:
        for ids in held.values():
            a.free_small("kv", ids)
        return requests * steps * layers

    t_alloc = t_free = float("inf")
    for _ in range(repeats):
        t_alloc = min(t_alloc, timed(run_steps, 1))
        t_free = min(t_free, timed(free_all, 1))
    return {"alloc_us_per_page": t_alloc, "free_us_per_page": t_free, "total_us_per_page": t_alloc + t_free}


def bench_churn(a: PageAllocator, requests: int, steps: int, layers: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    held: dict[int, list[int]] = {r: a.allocate_small("kv", 480, owner=r) for r in range(requests)}
    next_id = requests
    pages = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        for r in rng.sample(sorted(held), requests // 10):  # a tenth finish ...
            ids = held.pop(r)
            a.free_small("kv", ids)
            pages += len(ids)
            held[next_id] = a.allocate_small("kv", 480, owner=next_id)  # ... and new ones prefill
            pages += 480
            next_id += 1
        for r, ids in held.items():
            ids.extend(a.allocate_small("kv", layers, owner=r))
            pages += layers
    elapsed = time.perf_counter() - t0
    stats = a.stats()
    for ids in held.values():
        a.free_small("kv", ids)
    a.check_invariants()
    return {"us_per_page_moved": elapsed / pages * 1e6, "pages_moved": pages,
            "trapped_bytes_at_end": stats.trapped_bytes}


def git_commit() -> str:
    return source_commit() or "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen1.5-moe-a2.7b")
    ap.add_argument("--pool-gib", type=float, default=32.0)
    ap.add_argument("--prefill-pages", type=int, default=6000)
    ap.add_argument("--decode-requests", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", type=Path, default=None)
    args = ap.parse_args()

    spec = load_model_spec(args.model)
    g = PageGeometry.for_model(spec)
    num_huge = int(args.pool_gib * 2**30) // g.huge_size
    layers = len(spec.attention_layer_ids)

    results = {
        "prefill": bench_prefill(PageAllocator(g, num_huge), args.prefill_pages, args.repeats),
        "decode": bench_decode(PageAllocator(g, num_huge), args.decode_requests, args.decode_steps, layers,
                               args.repeats),
        "churn": bench_churn(PageAllocator(g, num_huge), args.decode_requests, args.decode_steps, layers,
                             args.seed),
    }

    print(f"{args.model}: {g.describe()}; pool {num_huge} huge pages ({num_huge * g.huge_size / 2**30:.1f} GiB)")
    print(f"{'scenario':<34} {'alloc us/page':>14} {'free us/page':>13} {'total us/page':>14}")
    for name, label in (("prefill", f"prefill {args.prefill_pages} pages at once"),
                        ("decode", f"decode {args.decode_requests} req x {layers} pages")):
        r = results[name]
        print(f"{label:<34} {r['alloc_us_per_page']:>14.3f} {r['free_us_per_page']:>13.3f} "
              f"{r['total_us_per_page']:>14.3f}")
    c = results["churn"]
    print(f"{'churn (finish + prefill + decode)':<34} {'':>14} {'':>13} {c['us_per_page_moved']:>14.3f}")

    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "benchmark": "allocator",
            "device": f"cpu: {cpu_name()}",
            "cpu_count": os.cpu_count(),
            "load_average_1m_at_end": os.getloadavg()[0],  # other jobs on the machine inflate the times
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "model": args.model,
            "geometry": g.describe(),
            "num_huge_pages": num_huge,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "results": results,
        }
        args.output_json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
