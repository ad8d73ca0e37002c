"""Paged fused MoE vs the same kernel on contiguous weights vs torch grouped_mm, on identical inputs.

    python benchmarks/bench_fused_moe.py --output-json benchmarks/results/fused_moe_h200.json \
        --output-md benchmarks/results/fused_moe_h200.md

Per (model shape, token count): median time (triton.testing.do_bench), achieved HBM GB/s (weights of
the activated experts + activations in/out) and TFLOP/s against the measured H200 ceilings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_model(name: str, tokens: list[int], rep_ms: int, seed: int) -> list[dict]:
    from triton.testing import do_bench

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
        hidden = torch.randn(T, d, device=dev, dtype=dtype, generator=g)
        logits = torch.rand(T, E, device=dev, generator=g)  # uniform random routing
        w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).float()
        args = (hidden, w, ids)
        kernels = {
            "paged": lambda a=args: fused_moe(*a, view, table, f),
            "contiguous": lambda a=args: fused_moe_contiguous(*a, w13, w2),
        }
        if has_grouped:
            kernels["grouped_mm"] = lambda a=args: grouped_mm_moe(*a, w13, w2)
        ref = kernels["paged"]()
        for kname, fn in kernels.items():  # correctness on these exact inputs before timing
            out = fn()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 2e-2, f"{name} T={T}: {kname} differs from paged by {err:.3g}"
        active = int(torch.unique(ids).numel())
        bytes_moved = active * 3 * f * d * 2 + 2 * T * d * 2  # weights of activated experts + in/out
        flops = 2 * T * k * 3 * f * d
        times = {
            kn: do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median") for kn, fn in kernels.items()
        }
        row = {"model": name, "d": d, "f": f, "E": E, "k": k, "tokens": T, "active_experts": active}
        for kn, ms in times.items():
            us = ms * 1e3
            row[f"{kn}_us"] = round(us, 2)
            row[f"{kn}_GBps"] = round(bytes_moved / us / 1e3, 1)
            row[f"{kn}_TFLOPs"] = round(flops / us / 1e6, 2)
        row["paged_vs_contiguous_pct"] = round(100 * (times["paged"] / times["contiguous"] - 1), 2)
        row["paged_minus_contiguous_us"] = round((times["paged"] - times["contiguous"]) * 1e3, 2)
        if has_grouped:
            row["paged_vs_grouped_mm_pct"] = round(100 * (times["paged"] / times["grouped_mm"] - 1), 2)
        row["paged_pct_of_copy_bw"] = round(100 * row["paged_GBps"] / COPY_GBPS, 1)
        row["paged_pct_of_bf16_peak"] = round(100 * row["paged_TFLOPs"] / BF16_TFLOPS, 1)
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


HEADER = (
    f"{'model':<18} {'T':>6} {'paged us':>9} {'contig us':>9} {'gmm us':>9} {'p-c %':>7} {'p-c us':>7} "
    f"{'p/gmm %':>8} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} {'%peak':>6}"
)


def format_row(r: dict) -> str:
    gmm = r.get("grouped_mm_us", float("nan"))
    vs = r.get("paged_vs_grouped_mm_pct", float("nan"))
    return (
        f"{r['model']:<18} {r['tokens']:>6} {r['paged_us']:>9.1f} {r['contiguous_us']:>9.1f} {gmm:>9.1f} "
        f"{r['paged_vs_contiguous_pct']:>7.2f} {r['paged_minus_contiguous_us']:>7.2f} {vs:>8.1f} "
        f"{r['paged_GBps']:>7.0f} {r['paged_pct_of_copy_bw']:>6.1f} {r['paged_TFLOPs']:>8.1f} "
        f"{r['paged_pct_of_bf16_peak']:>6.1f}"
    )


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    cols = [
        ("model", "model"), ("tokens", "T"), ("paged_us", "paged µs"), ("contiguous_us", "contig µs"),
        ("grouped_mm_us", "grouped_mm µs"), ("paged_vs_contiguous_pct", "paged vs contig %"),
        ("paged_minus_contiguous_us", "paged − contig µs"), ("paged_vs_grouped_mm_pct", "paged vs gmm %"),
        ("paged_GBps", "paged GB/s"), ("paged_pct_of_copy_bw", "% of 4.26 TB/s"),
        ("paged_TFLOPs", "paged TFLOP/s"), ("paged_pct_of_bf16_peak", "% of 779 TFLOP/s"),
    ]  # fmt: skip
    lines = [
        f"# Fused MoE kernel: {meta['device']}, {meta['date']}",
        "",
        f"commit `{meta['git_commit']}`, torch {meta['torch']}, triton {meta['triton']}; command: `{meta['command']}`",
        "",
        "| " + " | ".join(h for _, h in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(str(r.get(key, "")) for key, _ in cols) + " |" for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="*", type=int, default=TOKENS)
    ap.add_argument("--rep-ms", type=int, default=60, help="do_bench measurement time per kernel")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", type=Path, default=None)
    ap.add_argument("--output-md", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused_moe needs a CUDA GPU")
    import triton

    meta = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "ceilings": {"copy_GBps": COPY_GBPS, "bf16_TFLOPs": BF16_TFLOPS},
        "bytes": "weights of activated experts (3*f*d*2 each) + hidden in + out (bf16)",
    }
    print(f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  commit {meta['git_commit'][:10]}")
    print(HEADER)
    rows = []
    for name in args.models:
        rows += bench_model(name, args.tokens, args.rep_ms, args.seed)
        torch.cuda.empty_cache()
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    if args.output_md:
        write_markdown(args.output_md, meta, rows)


if __name__ == "__main__":
    main()
