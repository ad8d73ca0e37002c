"""Host->device copy bandwidth of every visible GPU, alone and all at once.

    python benchmarks/bench_pcie_concurrency.py --output-json $OUT/pcie-concurrency.json

Why: on a machine with several GPUs, two benchmark servers can run side by side, one per GPU, only if
their PCIe traffic does not share a link (an offloading server copies experts every step). If the
concurrent bandwidth per GPU stays near the alone figure, the links are independent.

Each GPU gets its own pinned host buffer and copy stream; 'together' starts every GPU's copies from one
thread per GPU behind a barrier and times each on its own events.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import metadata, print_header  # noqa: E402


def copy_gbps(host: torch.Tensor, dev: torch.Tensor, stream: torch.cuda.Stream, reps: int,
              barrier: threading.Barrier | None = None) -> float:
    """GB/s of `reps` copies host -> dev on `stream` (one warm-up first)."""
    with torch.cuda.device(dev.device), torch.cuda.stream(stream):
        dev.copy_(host, non_blocking=True)
        stream.synchronize()
        if barrier is not None:
            barrier.wait()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            dev.copy_(host, non_blocking=True)
        end.record(stream)
        end.synchronize()
        return reps * host.numel() * host.element_size() / (start.elapsed_time(end) / 1e3) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="buffer size per GPU")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    n = torch.cuda.device_count()
    meta = metadata("pcie_concurrency", gpus=n, mib=args.mib, reps=args.reps)
    print_header(meta)
    numel = args.mib << 19  # bf16 elements
    hosts = [torch.empty(numel, dtype=torch.bfloat16).pin_memory() for _ in range(n)]
    devs = [torch.empty(numel, dtype=torch.bfloat16, device=f"cuda:{i}") for i in range(n)]
    streams = [torch.cuda.Stream(device=i) for i in range(n)]
    alone = [copy_gbps(hosts[i], devs[i], streams[i], args.reps) for i in range(n)]
    together = [0.0] * n
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        together[i] = copy_gbps(hosts[i], devs[i], streams[i], args.reps, barrier)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"{'gpu':>4} {'alone GB/s':>11} {'together GB/s':>14} {'ratio':>6}")
    for i in range(n):
        print(f"{i:>4} {alone[i]:>11.1f} {together[i]:>14.1f} {together[i] / alone[i]:>6.2f}")
    if args.output_json:
        args.output_json.write_text(json.dumps({**meta, "alone_gbps": alone, "together_gbps": together}, indent=1))


if __name__ == "__main__":
    main()
