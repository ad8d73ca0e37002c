"""Experts read by the MoE kernel straight from pinned host memory (direct host access) against copying them first.

    PYTHONPATH=. python benchmarks/bench_direct_host_moe.py --output-json benchmarks/results/direct-host-moe-h200.json

One Qwen3-30B-A3B MoE layer (d 2048, f 768, 128 experts, top-8, bf16). Per token count T and per number m of the
routed experts that are named by host rows (fused_moe's `host_rows`): the paged fused MoE captured in a CUDA graph
(`direct_us`), beside the same call with every expert in pool pages (`resident_us`) and the copy of those m experts
host -> device that the copying path would make first (`copy_us`, pinned, one stream). `direct_extra_us` is what
reading the m experts over PCIe added to the kernel; `direct_gbps` the bytes of the m experts over it. Input sets
are rotated, each with other routed experts on the host, so the host rows are not served from L2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import TIMING_NOTE, metadata, print_header, time_op, write_json  # noqa: E402
from rimuru.kernels.fused_moe import fused_moe, host_row_code  # noqa: E402

D, F, E, K = 2048, 768, 128, 8
SETS = 8


def make_sets(T: int, m: int, view: torch.Tensor, host: torch.Tensor, seed: int) -> list[dict]:
    """SETS independent inputs; in each, m of the routed experts are named by their host rows."""
    g = torch.Generator().manual_seed(seed)
    sets = []
    for s in range(SETS):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, K]
        w = torch.rand(T, K, generator=g)
        w = w / w.sum(-1, keepdim=True)
        table = torch.arange(3 * E, dtype=torch.int32).view(E, 3)  # expert e in pages 3e .. 3e+2
        routed = torch.unique(ids).tolist()
        on_host = [routed[(s * m + i) % len(routed)] for i in range(min(m, len(routed)))]
        for e in on_host:
            table[e] = torch.tensor([host_row_code(e, j) for j in range(3)], dtype=torch.int32)
        sets.append({"hidden": (torch.randn(T, D, generator=g) / 4).to(torch.bfloat16).cuda(), "w": w.cuda(),
                     "ids": ids.cuda(), "table": table.cuda(), "host_experts": on_host,
                     "resident_table": torch.arange(3 * E, dtype=torch.int32, device="cuda").view(E, 3)})
    return sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,8,32,64,256,1024")
    ap.add_argument("--host-experts", default="0,1,2,4,8")
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    meta = metadata("bench_direct_host_moe", shape={"d": D, "f": F, "experts": E, "top_k": K},
                    timing=TIMING_NOTE)
    print_header(meta)
    g = torch.Generator().manual_seed(0)
    view = (torch.randn(3 * E, F * D, generator=g) / D**0.5).to(torch.bfloat16)  # the pool's expert pages
    host = view.clone().pin_memory()  # host rows: row 3e + j = page 3e + j, byte-identical
    view = view.cuda()
    expert_bytes = 3 * F * D * 2
    scratch = torch.empty(8 * 3, F * D, dtype=torch.bfloat16, device="cuda")  # copy destination for up to 8
    rows = []
    print(f"{'T':>5} {'m':>3} {'resident us':>12} {'direct us':>10} {'extra us':>9} {'GB/s':>6} {'copy us':>8}")
    for T in (int(t) for t in args.tokens.split(",")):
        for m in (int(x) for x in args.host_experts.split(",")):
            sets = make_sets(T, m, view, host, seed=T * 31 + m)
            direct, out_direct = time_op([lambda s=s: fused_moe(s["hidden"], s["w"], s["ids"], view, s["table"], F,
                                                                host) for s in sets])
            resident, out_res = time_op([lambda s=s: fused_moe(s["hidden"], s["w"], s["ids"], view,
                                                               s["resident_table"], F, host) for s in sets])
            for a, b in zip(out_direct, out_res, strict=True):
                assert a is None or b is None or torch.equal(a, b), "host rows and pages disagree"
            n_host = len(sets[0]["host_experts"])
            copy_us = None
            if n_host:
                def copy(s: dict) -> None:
                    for i, e in enumerate(s["host_experts"]):
                        scratch[3 * i: 3 * i + 3].copy_(host[3 * e: 3 * e + 3], non_blocking=True)
                copy_us = time_op([lambda s=s: copy(s) for s in sets])[0].graph_us
            timed = direct.graph_us is not None and resident.graph_us is not None
            extra = direct.graph_us - resident.graph_us if timed else None
            gbps = None if not n_host or not extra or extra <= 0 else n_host * expert_bytes / (extra * 1e3)
            row = {"tokens": T, "host_experts": n_host, "resident_us": resident.graph_us, "direct_us": direct.graph_us,
                   "direct_extra_us": extra, "direct_gbps": gbps, "copy_us": copy_us, "expert_bytes": expert_bytes}
            rows.append(row)
            fmt = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
            print(f"{T:>5} {n_host:>3} {fmt(resident.graph_us):>12} {fmt(direct.graph_us):>10} {fmt(extra):>9} "
                  f"{fmt(gbps):>6} {fmt(copy_us):>8}")
    write_json(args.output_json, meta, rows)


if __name__ == "__main__":
    main()
