"""Host time of one KV compaction (engine/kv_compaction.py) on a pool shaped like a busy multi-turn server.

Qwen1.5-MoE-A2.7B geometry (a KV page of 128 KiB = 1/44 of an expert page, 24 attention layers, blocks of 16
tokens) over `--mid-pages` mid pages (3,600: ~20 GiB of KV). Rounds of requests of 200-3,000 tokens fill the pool
and two thirds of them end, their full blocks left in the prefix cache, until every mid page is split and the pages
of the requests still running (`--running`) lie scattered; then `--compactions` compactions in a row, each asked
for 8 mid pages and at most 8 mid pages' worth of KV pages, as the engine asks when grows wait (sources released
after each, as at the end of the step that copies them). Prints the median and worst host time and the pages moved;
with `--runner-grids` the requests' grids come as int32 arrays, as the engine passes the runner's.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_kv_compaction.py --output-json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import metadata, print_header, write_json  # noqa: E402
from rimuru import SamplingParams  # noqa: E402
from rimuru.engine.kv_cache_manager import KV, KVCacheManager  # noqa: E402
from rimuru.engine.kv_compaction import MAX_MID_PAGES_MOVED, compact_kv  # noqa: E402
from rimuru.engine.request import Request  # noqa: E402
from rimuru.experts.residency import EXPERT  # noqa: E402
from rimuru.memory.allocator import PageAllocator  # noqa: E402
from rimuru.memory.geometry import PageGeometry  # noqa: E402

KV_PAGE = 131072  # bytes: 16 tokens x (K, V) x 16 heads x 128 dims x bf16
SMALLS_PER_MID = 44
LAYERS = 24
BLOCK = 16


def busy_pool(mid_pages: int, running: int, seed: int) -> tuple[PageAllocator, KVCacheManager, list[Request]]:
    geo = PageGeometry.custom(mid_sizes={EXPERT: KV_PAGE * SMALLS_PER_MID}, small_sizes={KV: KV_PAGE})
    alloc = PageAllocator(geo, mid_pages)
    kv = KVCacheManager(alloc, num_attention_layers=LAYERS, block_size=BLOCK, enable_prefix_caching=True)
    rng = np.random.default_rng(seed)
    live: list[Request] = []
    n = 0
    params = SamplingParams(max_tokens=8)

    def admit(tokens: int) -> bool:
        nonlocal n
        r = Request(request_id=f"r{n}", seq_id=n, prompt=None, prompt_token_ids=list(range(n * 10_000, n * 10_000
                    + tokens)), params=params, max_tokens=8, eos_token_id=None)
        n += 1
        if not kv.allocate(r, tokens):
            return False
        r.num_computed_tokens = tokens
        live.append(r)
        return True

    for _ in range(6):
        while admit(int(rng.integers(200, 3000))):
            pass
        for r in [live[j] for j in rng.permutation(len(live))[: len(live) * 2 // 3]]:
            kv.free(r)
            live.remove(r)
    while len(live) > running:
        kv.free(live.pop(int(rng.integers(len(live)))))
    return alloc, kv, live


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mid-pages", type=int, default=3600)
    ap.add_argument("--running", type=int, default=30)
    ap.add_argument("--compactions", type=int, default=20)
    ap.add_argument("--runner-grids", action="store_true", help="grids as int32 arrays, as the engine passes them")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json")
    args = ap.parse_args()
    meta = metadata("bench_kv_compaction")
    print_header(meta)
    alloc, kv, running = busy_pool(args.mid_pages, args.running, args.seed)
    offsets, _ = alloc.split_parents(KV, EXPERT)

    def as_array(r: Request) -> np.ndarray:
        return np.asarray(r.kv_pages, dtype=np.int32)

    class RunnerGrids:  # the arrays the runner built for the last pass, by seq_id
        arrays: dict[int, np.ndarray] = {}

        def page_grid(self, r: Request) -> np.ndarray | None:
            return self.arrays.get(r.seq_id)

        def grid_renamed(self, r: Request, grid: np.ndarray) -> None:
            self.arrays[r.seq_id] = grid.astype(np.int32)

    runner = RunnerGrids()

    times, moved = [], []
    for _ in range(args.compactions):
        if args.runner_grids:
            runner.arrays = {r.seq_id: as_array(r) for r in running}
        t0 = time.perf_counter()
        moves = compact_kv(kv, running, EXPERT, MAX_MID_PAGES_MOVED, MAX_MID_PAGES_MOVED * SMALLS_PER_MID,
                           hold=True, grids=runner if args.runner_grids else None)
        times.append(time.perf_counter() - t0)
        moved.append(len(moves) if moves is not None else 0)
        alloc.release_held()
        alloc.complete_forward()
    alloc.check_invariants()
    kv.check()
    row = {"mid_pages": args.mid_pages, "split_mid_pages": int(offsets.size), "running": len(running),
           "running_kv_pages": sum(len(r.kv_pages) for r in running) * LAYERS, "runner_grids": args.runner_grids,
           "compactions": args.compactions, "median_ms": round(statistics.median(times) * 1e3, 3),
           "max_ms": round(max(times) * 1e3, 3), "pages_moved_mean": round(statistics.fmean(moved), 1)}
    print(f"{row['split_mid_pages']} split mid pages, {row['running']} running requests holding "
          f"{row['running_kv_pages']} KV pages: compaction median {row['median_ms']} ms, max {row['max_ms']} ms, "
          f"{row['pages_moved_mean']} pages moved on average")
    write_json(Path(args.output_json) if args.output_json else None, meta, [row])


if __name__ == "__main__":
    main()
