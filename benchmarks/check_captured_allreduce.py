"""Whether torch.distributed's NCCL all-reduce can live inside a CUDA graph the way a tensor-parallel engine would
use it, on the GPUs of one host: the check that decides how Rimuru captures its collectives.

    python benchmarks/check_captured_allreduce.py --world-size 2 --output-json $OUT/captured-allreduce.json

A decode pass of a tensor-parallel model makes two all-reduces a layer. Each rank here captures a graph of
`--layers` layers (a matmul, then an all-reduce of its output, as a row-parallel projection does) and then, as
serving would: replays it `--replays` times with new inputs, checking every `--check-every`-th replay's result
against the same math done eagerly; runs eager all-reduces between replays (the steps that no graph covers); reads
a value back to the host after each replay (the sampled tokens' readback); and finally destroys the process group.
Each phase has a deadline (`--timeout-s`): a hang, the failure that reports of captured c10d collectives describe
(pytorch/pytorch#115388: `destroy_process_group` after a capture), ends the check with the phase named instead of
blocking the machine. The result: per phase ok / error / hung, the replay time against the same layers run eagerly,
and the NCCL and torch versions. `NCCL_P2P_DISABLE=1` measures the GPUs as two consumer cards on PCIe would talk.

The engine's plan (docs/architecture.md, "Not built yet"): if every phase passes, the captured passes call
torch.distributed as the eager ones do; if a phase hangs or fails, the graphs get a communicator of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import metadata, print_header  # noqa: E402

PHASES = ("init", "capture", "replay", "eager_between", "destroy")


def _layers(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """Row-parallel layers: each rank's partial product, summed over ranks. x [T, d] -> [T, d]."""
    for w in weights:
        x = x @ w
        dist.all_reduce(x)
        x = x / x.norm(dim=-1, keepdim=True).clamp(min=1e-6)  # keeps the values in range over many layers
    return x


def _worker(rank: int, args: argparse.Namespace, port: int, results: mp.Queue) -> None:
    """Puts ("phase", rank, name) as each phase starts and ("report", rank, dict) at the end."""
    report: dict[str, object] = {"rank": rank}
    phase = "init"

    def start(name: str) -> str:
        results.put(("phase", rank, name))
        return name

    start(phase)
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=args.world_size, device_id=torch.device("cuda", rank))
        dev = torch.device("cuda", rank)
        g = torch.Generator(device=dev).manual_seed(1234 + rank)  # each rank its own shard
        weights = [torch.randn(args.hidden, args.hidden, device=dev, generator=g) * args.hidden**-0.5
                   for _ in range(args.layers)]
        static_x = torch.zeros(args.tokens, args.hidden, device=dev)
        inputs = torch.Generator(device=dev).manual_seed(99)  # the same inputs on every rank, as serving's are
        report["init"] = "ok"

        phase = start("capture")
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up on the capture stream (NCCL's and cuBLAS's lazy set-up)
                _layers(static_x, weights)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            static_out = _layers(static_x, weights)
        torch.cuda.synchronize(dev)
        report["capture"] = "ok"

        phase = start("replay")
        worst = 0.0
        for i in range(args.replays):
            static_x.copy_(torch.randn(args.tokens, args.hidden, device=dev, generator=inputs))
            graph.replay()
            if i % args.check_every == 0:
                want = _layers(static_x.clone(), weights)
                worst = max(worst, float((static_out - want).abs().max()))
            float(static_out[0, 0])  # a host readback after every replay, as the sampled tokens' is
        report["replay"] = "ok"
        report["max_abs_diff_vs_eager"] = worst

        phase = start("eager_between")
        for _ in range(args.replays // 10):
            graph.replay()
            _layers(static_x.clone(), weights)  # a step no graph covers, between two replays
        torch.cuda.synchronize(dev)
        report["eager_between"] = "ok"

        torch.cuda.synchronize(dev)
        start = time.perf_counter()
        for _ in range(args.timing_reps):
            graph.replay()
        torch.cuda.synchronize(dev)
        report["graph_ms"] = (time.perf_counter() - start) / args.timing_reps * 1e3
        start = time.perf_counter()
        for _ in range(args.timing_reps):
            _layers(static_x, weights)
        torch.cuda.synchronize(dev)
        report["eager_ms"] = (time.perf_counter() - start) / args.timing_reps * 1e3
        del graph

        phase = start("destroy")
        dist.destroy_process_group()
        report["destroy"] = "ok"
    except Exception:  # the phase that failed, with its traceback, for the report
        report[phase] = "error"
        report["error"] = traceback.format_exc(limit=6)
    results.put(("report", rank, report))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=96, help="all-reduces per graph (Qwen3-30B-A3B decode: 96)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--replays", type=int, default=10_000)
    p.add_argument("--check-every", type=int, default=500)
    p.add_argument("--timing-reps", type=int, default=200)
    p.add_argument("--timeout-s", type=float, default=240.0, help="deadline of the whole check")
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--output-json", type=Path)
    args = p.parse_args()
    if torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"needs {args.world_size} CUDA GPUs, found {torch.cuda.device_count()}")
    meta = metadata("check_captured_allreduce", world_size=args.world_size, layers=args.layers, tokens=args.tokens,
                    hidden=args.hidden, replays=args.replays, nccl=".".join(map(str, torch.cuda.nccl.version())),
                    nccl_p2p_disable=os.environ.get("NCCL_P2P_DISABLE"))
    print_header(meta)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, args.port, results), daemon=True)
             for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + args.timeout_s
    reports: dict[int, dict[str, object]] = {}
    last_phase: dict[int, str] = {}
    while len(reports) < args.world_size and time.monotonic() < deadline:
        try:
            kind, rank, value = results.get(timeout=1.0)
        except queue.Empty:
            if not any(proc.is_alive() for proc in procs):
                break
            continue
        if kind == "phase":
            last_phase[rank] = value
        else:
            reports[rank] = value
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for rank in range(args.world_size):
        if rank not in reports:  # no report in time: the phase it was in hung (or the process died there)
            reports[rank] = {"rank": rank, last_phase.get(rank, "init"): "hung-or-died"}
    ranks = [reports[r] for r in range(args.world_size)]
    passed = all(all(r.get(ph) == "ok" for ph in PHASES) for r in ranks)
    for r in ranks:
        phases = " ".join(f"{ph}={r.get(ph, '-')}" for ph in PHASES)
        timing = ""
        if "graph_ms" in r:
            timing = (f"; {args.layers} all-reduces: graph {r['graph_ms']:.3f} ms, eager {r['eager_ms']:.3f} ms; "
                      f"max diff against eager {r['max_abs_diff_vs_eager']:.2e}")
        print(f"rank {r['rank']}: {phases}{timing}")
        if "error" in r:
            print(r["error"])
    print("captured all-reduce:", "every phase passed" if passed else "FAILED (see the phases above)")
    if args.output_json:
        args.output_json.write_text(json.dumps({**meta, "passed": passed, "ranks": ranks}, indent=1))
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
