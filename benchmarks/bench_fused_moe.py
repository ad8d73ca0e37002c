"""Paged fused MoE vs the same kernel on contiguous weights vs torch grouped_mm, on identical inputs.

    PYTHONPATH=. python benchmarks/bench_fused_moe.py --output-json benchmarks/results/fused_moe_h200.json \
        --output-md benchmarks/results/fused_moe_h200.md

Per (model shape, token count) and per implementation: the whole op (alignment + both GEMMs + top-k
sum) captured in a CUDA graph and replayed (`*_us`, the GPU time: achieved HBM GB/s and TFLOP/s are
computed from it against the measured H200 ceilings), and the same op called eagerly back to back
(`*_eager_us`: what an un-captured caller pays, host launch overhead included). Routing is rotated over
several input sets at small T so the activated experts' weights are not re-read from L2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    TIMING_NOTE,
    metadata,
    print_header,
    rotation_sets,
    time_op,
    timing_fields,
    write_json,
    write_markdown,
)
from rimuru.kernels.fused_moe import fused_moe, fused_moe_contiguous  # noqa: E402

COPY_GBPS = 4260.0  # measured device-to-device copy ceiling, GB/s
BF16_TFLOPS = 779.0  # measured bf16 GEMM ceiling
MODELS = {  # name: (hidden d, moe_intermediate f, experts E, top-k)
    "Qwen1.5-MoE-A2.7B": (2048, 1408, 60, 4),
    "Qwen3-30B-A3B": (2048, 768, 128, 8),
    "Qwen3.5-35B-A3B": (2048, 512, 256, 8),
}
TOKENS = [1, 16, 64, 256, 1024, 4096, 16384]


def grouped_mm_moe(hidden: Tensor, w: Tensor, ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """The same MoE with torch.nn.functional.grouped_mm (CUTLASS on sm90): gather, 2 grouped GEMMs, scatter."""
    T, d = hidden.shape
    k = ids.shape[1]
    E, two_f, _ = w13.shape
    f = two_f // 2
    flat = ids.reshape(-1)  # [n]
    order = torch.argsort(flat, stable=True)  # [n] assignments sorted by expert
    counts = torch.zeros(E, dtype=torch.int32, device=hidden.device)
    counts.index_add_(0, flat.int(), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] group ends
    x = hidden[order // k]  # [n, d]
    gu = torch.nn.functional.grouped_mm(x, w13.transpose(1, 2), offs=offs)  # [n, 2f]
    act = torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]  # [n, f]
    y = torch.nn.functional.grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [n, d]
    y = y * w.reshape(-1)[order, None].to(y.dtype)
    per_assign = torch.empty_like(y).index_copy_(0, order, y)  # back to assignment order
    return per_assign.view(T, k, d).sum(1)


def rel_err(out: Tensor, ref: Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_model(name: str, tokens: list[int], seed: int) -> list[dict]:
    d, f, E, k = MODELS[name]
    dtype, dev = torch.bfloat16, "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    # Pool with 3E expert pages in shuffled order among spare pages; contiguous copies of the same weights.
    num_pages = 3 * E + 16
    view = torch.randn(num_pages, f * d, device=dev, dtype=dtype, generator=g) * d**-0.5
    table = torch.randperm(num_pages, device=dev, generator=g)[: 3 * E].view(E, 3).int()
    w13 = torch.cat([view[table[:, 0]].view(E, f, d), view[table[:, 1]].view(E, f, d)], dim=1).contiguous()
    w2 = view[table[:, 2]].view(E, d, f).contiguous()
    has_grouped = hasattr(torch.nn.functional, "grouped_mm")
    if not has_grouped:
        print(f"torch {torch.__version__} has no torch.nn.functional.grouped_mm: that column is skipped")
    rows = []
    for T in tokens:
        # Bytes of one call if all E experts were hit: an upper bound that sizes the rotation.
        est_bytes = min(E, T * k) * 3 * f * d * 2 + 2 * T * d * 2
        sets = []
        for _ in range(rotation_sets(est_bytes)):
            hidden = torch.randn(T, d, device=dev, dtype=dtype, generator=g)
            logits = torch.rand(T, E, device=dev, generator=g)  # uniform random routing
            w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
            sets.append((hidden, (w / w.sum(-1, keepdim=True)).float(), ids))
        kernels = {
            "paged": [lambda a=a: fused_moe(*a, view, table, f) for a in sets],
            "contiguous": [lambda a=a: fused_moe_contiguous(*a, w13, w2) for a in sets],
        }
        if has_grouped:
            kernels["grouped_mm"] = [lambda a=a: grouped_mm_moe(*a, w13, w2) for a in sets]
        refs = [fn() for fn in kernels["paged"]]
        for kname, fns in kernels.items():  # correctness on these exact inputs before timing
            err = rel_err(fns[0](), refs[0])
            assert err < 2e-2, f"{name} T={T}: {kname} differs from paged by {err:.3g}"
        active = statistics.mean(int(torch.unique(a[2]).numel()) for a in sets)
        bytes_moved = active * 3 * f * d * 2 + 2 * T * d * 2  # weights of activated experts + in/out
        flops = 2 * T * k * 3 * f * d
        floor_us = max(bytes_moved / COPY_GBPS / 1e3, flops / BF16_TFLOPS / 1e6)
        row = {"model": name, "d": d, "f": f, "E": E, "k": k, "tokens": T, "active_experts": active,
               "input_sets": len(sets), "floor_us": round(floor_us, 2)}  # fmt: skip
        times = {}
        for kname, fns in kernels.items():
            timing, outs = time_op(fns)
            for i, out in enumerate(outs):  # the captured op computes what the eager op computes
                if out is None:
                    continue
                expect = refs[i] if kname == "paged" else fns[i]()
                if kname == "grouped_mm":
                    assert rel_err(out, expect) < 1e-3, f"{name} T={T}: {kname} graph replay differs"
                else:
                    assert torch.equal(out, expect), f"{name} T={T}: {kname} graph replay differs from eager"
            row.update(timing_fields(kname, timing))
            row[f"{kname}_ops_per_graph"] = timing.ops_per_graph
            times[kname] = timing.graph_us if timing.graph_us is not None else timing.eager_us
        for kn, us in times.items():
            row[f"{kn}_GBps"] = round(bytes_moved / us / 1e3, 1)
            row[f"{kn}_TFLOPs"] = round(flops / us / 1e6, 2)
        row["paged_vs_contiguous_pct"] = round(100 * (times["paged"] / times["contiguous"] - 1), 2)
        row["paged_minus_contiguous_us"] = round(times["paged"] - times["contiguous"], 2)
        if has_grouped:
            row["paged_vs_grouped_mm_pct"] = round(100 * (times["paged"] / times["grouped_mm"] - 1), 2)
        row["paged_pct_of_copy_bw"] = round(100 * row["paged_GBps"] / COPY_GBPS, 1)
        row["paged_pct_of_bf16_peak"] = round(100 * row["paged_TFLOPs"] / BF16_TFLOPS, 1)
        row["paged_over_floor"] = round(times["paged"] / floor_us, 2)
        row["paged_eager_over_graph"] = round(row["paged_eager_us"] / times["paged"], 2)
        rows.append(row)
        print(format_row(row), flush=True)
        del sets, kernels, refs
    return rows


HEADER = (
    f"{'model':<18} {'T':>6} {'paged us':>9} {'eager us':>9} {'contig us':>9} {'gmm us':>9} {'gmm eag':>9} "
    f"{'p-c %':>7} {'p-c us':>7} {'p/gmm %':>8} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} {'%peak':>6} {'/floor':>6}"
)


def _f(r: dict, key: str, fmt: str) -> str:
    v = r.get(key)
    return format(v, fmt) if v is not None else "-"


def format_row(r: dict) -> str:
    return (
        f"{r['model']:<18} {r['tokens']:>6} {_f(r, 'paged_us', '9.1f'):>9} {_f(r, 'paged_eager_us', '9.1f'):>9} "
        f"{_f(r, 'contiguous_us', '9.1f'):>9} {_f(r, 'grouped_mm_us', '9.1f'):>9} "
        f"{_f(r, 'grouped_mm_eager_us', '9.1f'):>9} {_f(r, 'paged_vs_contiguous_pct', '7.2f'):>7} "
        f"{_f(r, 'paged_minus_contiguous_us', '7.2f'):>7} {_f(r, 'paged_vs_grouped_mm_pct', '8.1f'):>8} "
        f"{r['paged_GBps']:>7.0f} {r['paged_pct_of_copy_bw']:>6.1f} {r['paged_TFLOPs']:>8.1f} "
        f"{r['paged_pct_of_bf16_peak']:>6.1f} {r['paged_over_floor']:>6.2f}"
    )


MD_COLS = [
    ("model", "model"), ("tokens", "T"), ("paged_us", "paged µs (graph)"), ("paged_eager_us", "paged µs (eager)"),
    ("contiguous_us", "contig µs (graph)"), ("contiguous_eager_us", "contig µs (eager)"),
    ("grouped_mm_us", "grouped_mm µs (graph)"), ("grouped_mm_eager_us", "grouped_mm µs (eager)"),
    ("paged_vs_contiguous_pct", "paged vs contig %"), ("paged_minus_contiguous_us", "paged − contig µs"),
    ("paged_vs_grouped_mm_pct", "paged vs gmm %"), ("paged_GBps", "paged GB/s"),
    ("paged_pct_of_copy_bw", "% of 4.26 TB/s"), ("paged_TFLOPs", "paged TFLOP/s"),
    ("paged_pct_of_bf16_peak", "% of 779 TFLOP/s"), ("floor_us", "floor µs"), ("paged_over_floor", "paged / floor"),
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="*", type=int, default=TOKENS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", type=Path, default=None)
    ap.add_argument("--output-md", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused_moe needs a CUDA GPU")
    meta = metadata(
        "fused_moe", timing=TIMING_NOTE,
        ceilings={"copy_GBps": COPY_GBPS, "bf16_TFLOPs": BF16_TFLOPS},
        bytes="weights of activated experts (3*f*d*2 each, mean over input sets) + hidden in + out (bf16)",
        floor="max(bytes / copy ceiling, flops / bf16 ceiling)",
    )
    print_header(meta)
    print(HEADER)
    rows = []
    for name in args.models:
        rows += bench_model(name, args.tokens, args.seed)
        torch.cuda.empty_cache()
    write_json(args.output_json, meta, rows)
    write_markdown(args.output_md, "Fused MoE kernel", meta, MD_COLS, rows)


if __name__ == "__main__":
    main()
