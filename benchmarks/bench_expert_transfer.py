"""Expert loads over PCIe: throughput against a plain pinned copy, and how much hides behind compute.

    python benchmarks/bench_expert_transfer.py --output-json benchmarks/results/expert_transfer_h200.json

Qwen1.5-MoE-A2.7B shapes (d=2048, f=1408, E=60, top-4, bf16: 17.3 MB per expert). Everything goes
through the engine's own pieces: HostExpertStore (pinned), ExpertLoader (copy stream, two load
buffers of 16 slots) and the paged fused MoE kernel.

1. Ceiling: one large pinned host->device copy on the loader's copy stream (GB/s).
2. Expert loads: 1..16 whole experts into a load buffer (3 page copies each + the table update), GB/s
   against the ceiling, and the host time to issue them.
3. Overlap: a decode-like layer loop on the compute stream (attention-sized GEMMs for q/k/v/o + the
   fused MoE of T tokens over resident experts), alone, with n experts loaded per layer on the copy
   stream at the same time, and the loads alone. hidden = 1 - (both - compute) / loads: the share of
   the copy time that costs nothing because it ran behind compute.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rimuru.experts.cache import ExpertCache  # noqa: E402
from rimuru.experts.host_store import HostExpertStore  # noqa: E402
from rimuru.experts.loader import ExpertLoader  # noqa: E402
from rimuru.experts.residency import BUFFER_OWNER, EXPERT, ExpertResidency  # noqa: E402
from rimuru.kernels.fused_moe import fused_moe  # noqa: E402
from rimuru.memory.geometry import PageGeometry  # noqa: E402
from rimuru.memory.pass_fence import PassFence  # noqa: E402
from rimuru.memory.pool import PagePool  # noqa: E402
from rimuru.model_spec import ModelSpec  # noqa: E402

PRESET = "qwen1.5-moe-a2.7b"
PINNED_H2D_GBPS = 55.0  # a plain pinned host-to-device copy on the H200 (docs/benchmarks.md)
SLOTS = 16  # load-buffer slots (expert_offload_limit)
LAYERS = 2  # MoE layers in the host store: buffers alternate between them


def commit() -> str:
    if os.environ.get("RIMURU_COMMIT"):
        return os.environ["RIMURU_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def timed(fn, stream: torch.cuda.Stream, reps: int) -> list[float]:
    """Milliseconds of fn() measured by events on `stream`, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return out


def plain_copy_gbps(stream: torch.cuda.Stream, reps: int, nbytes: int = 1 << 30) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def copy() -> None:
        with torch.cuda.stream(stream):
            dev.copy_(host, non_blocking=True)

    return nbytes / statistics.median(timed(copy, stream, reps)) / 1e6


def build(num_resident: int) -> tuple[ModelSpec, ExpertCache, ExpertLoader]:
    cfg = dict(ModelSpec.from_preset(PRESET).hf_config)
    cfg["num_hidden_layers"] = LAYERS
    spec = ModelSpec.from_hf_config(cfg)
    dtype, dev = torch.bfloat16, torch.device("cuda")
    geo = PageGeometry.for_model(spec, dtype=dtype)
    pages = LAYERS * num_resident * 3 + 2 * SLOTS * 3
    pool = PagePool(geo, (pages // geo.mids_per_huge(EXPERT) + 2) * geo.huge_size, dev)
    residency = ExpertResidency(pool.allocator, spec.num_moe_layers, spec.num_experts)
    cache = ExpertCache(residency, pool.expert_view(dtype), dev)
    cache.make_prefix_resident(num_resident)
    store = HostExpertStore(LAYERS, spec.num_experts, spec.moe_intermediate_size, spec.hidden_size, dtype, pin=True)
    store.fill_random(seed=0, device=dev)
    cache.load_from_store(store)
    buf_pages = pool.allocator.allocate_mid(EXPERT, 2 * SLOTS * 3, owner=BUFFER_OWNER)
    return spec, cache, ExpertLoader(cache, store, buf_pages, SLOTS, PassFence(dev))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--overlap-experts", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--layers", type=int, default=24, help="layers in the overlap loop (Qwen1.5-MoE has 24)")
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    spec, cache, loader = build(num_resident=60)  # all resident for the compute; buffers filled on top
    d, f, E, k = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.num_experts_per_tok
    expert_bytes = loader.store.expert_bytes
    cs = loader.copy_stream
    results: dict = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.UTC).isoformat(),
                     "commit": commit(), "command": " ".join([sys.executable, *sys.argv]), "model": PRESET,
                     "expert_bytes": expert_bytes, "torch": torch.__version__}

    # 1. the ceiling: one plain large pinned copy, same stream
    ceiling = plain_copy_gbps(cs, max(3, args.reps // 4))
    results["plain_pinned_h2d_gbps"] = ceiling
    print(f"plain pinned H2D, 1 GiB: {ceiling:.1f} GB/s (H200: ~{PINNED_H2D_GBPS:.0f})")

    # 2. whole-expert loads through the loader
    state = {"layer": 0}

    def load_n(n: int) -> None:
        # as the provider does: fence the buffer whose "layer" was queued since the last call, then refill
        # the other one (the copy stream waits until the compute queued two layers ago is done)
        loader.fence_consumed()
        layer = state["layer"] = (state["layer"] + 1) % LAYERS
        buf = loader.claim(layer)
        loader.load(buf, list(range(n)), keep=set(), prefetch=True)
        buf.consumed = True

    rows = []
    print(f"\n{'experts':>8} {'MB':>8} {'ms':>8} {'GB/s':>8} {'% plain':>8} {'issue us':>9}")
    for n in (1, 2, 4, 8, 16):
        times = timed(lambda n=n: load_n(n), cs, args.reps)
        ms = statistics.median(times)
        t0 = time.perf_counter()
        load_n(n)
        issue_us = (time.perf_counter() - t0) * 1e6
        torch.cuda.synchronize()
        gbps = n * expert_bytes / ms / 1e6
        rows.append({"experts": n, "bytes": n * expert_bytes, "ms": ms, "gbps": gbps,
                     "fraction_of_plain": gbps / ceiling, "issue_us": issue_us})
        print(f"{n:>8} {n * expert_bytes / 1e6:>8.1f} {ms:>8.3f} {gbps:>8.1f} {100 * gbps / ceiling:>7.1f}% "
              f"{issue_us:>9.0f}")
    results["expert_loads"] = rows

    # 3. overlap with a decode-like layer loop
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv_w = torch.randn(d, (16 + 2 * 16) * 128, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    o_w = torch.randn(16 * 128, d, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    table = cache.tables[0]
    overlap = []
    print(f"\n{'tokens':>7} {'experts/layer':>13} {'compute ms':>11} {'loads ms':>9} {'both ms':>8} {'hidden':>7}")
    for T in args.tokens:
        x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, generator=g)
        probs = torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1)
        w, ids = torch.topk(probs, k, -1)

        def layers(x: torch.Tensor = x, w: torch.Tensor = w, ids: torch.Tensor = ids, n: int = 0) -> None:
            h = x
            for _ in range(args.layers):
                if n:
                    load_n(n)  # the next layer's experts on the copy stream while this layer computes
                h = (h @ qkv_w)[:, : 16 * 128] @ o_w  # attention-sized projections
                h = fused_moe(h, w, ids, cache.expert_view, table, f)
            if n:
                torch.cuda.current_stream().wait_stream(cs)  # the end event waits for the last copy too

        t_compute = statistics.median(timed(layers, torch.cuda.current_stream(), args.reps))
        for n in args.overlap_experts:
            def loads(n: int = n) -> None:
                for _ in range(args.layers):
                    load_n(n)

            t_loads = statistics.median(timed(loads, cs, args.reps))
            t_both = statistics.median(timed(lambda n=n: layers(n=n), torch.cuda.current_stream(), args.reps))
            hidden = 1 - max(0.0, t_both - t_compute) / t_loads
            overlap.append({"tokens": T, "experts_per_layer": n, "layers": args.layers, "compute_ms": t_compute,
                            "loads_ms": t_loads, "both_ms": t_both, "hidden_fraction": hidden})
            print(f"{T:>7} {n:>13} {t_compute:>11.3f} {t_loads:>9.3f} {t_both:>8.3f} {100 * hidden:>6.1f}%")
    results["overlap"] = overlap
    results["counters"] = vars(loader.counters)
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.output_json}")


if __name__ == "__main__":
    main()
