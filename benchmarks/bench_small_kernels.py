"""The small fused kernels against the torch op sequences they replace, at Qwen1.5-MoE shapes.

    PYTHONPATH=. python benchmarks/bench_small_kernels.py --output-json benchmarks/results/small_kernels_h200.json

Shapes: hidden 2048, 16 q / 16 kv heads x 128, 60 experts top-4 (no renormalisation), shared expert 5632,
bf16; T tokens per step. Every op is timed as a CUDA-graph replay (`us`, the GPU time: what a captured
decode step pays) and called eagerly back to back (`eager_us`: launches included), for the torch sequence
and for the fused kernel, over rotated input sets. `GB/s` is the bytes the op must move (inputs read once,
outputs written once) over the fused time, against the H200's 4.26 TB/s; at small T these ops are
launch/latency-bound, so the kernel count and the graph time are the numbers that matter there.

The MoE's alignment (kernels/moe_align.py: one program up to 4,096 assignments, the chunked launches past it, so
T = 4096 at top-4 takes the chunked path) is timed against its torch ops the same way.

The last lines add the ops up per decode step of the 24-layer model: per layer two add+norms, routing,
rotary, the MoE alignment, the shared expert's SiLU-and-mul and its gated combine; per step the first input norm,
cos/sin and the final add+norm.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    TIMING_NOTE,
    metadata,
    print_header,
    rotation_sets,
    table_cell,
    time_op,
    write_json,
    write_markdown,
)
from rimuru.kernels.activation import (  # noqa: E402
    sigmoid_mul_add_reference,
    sigmoid_mul_add_triton,
    silu_and_mul_reference,
    silu_and_mul_triton,
)
from rimuru.kernels.fused_moe import _tile_config  # noqa: E402
from rimuru.kernels.moe_align import moe_align, moe_align_torch  # noqa: E402
from rimuru.kernels.rmsnorm import (  # noqa: E402
    fused_add_rms_norm_reference,
    fused_add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from rimuru.kernels.rotary import (  # noqa: E402
    apply_rotary,
    apply_rotary_qk_triton,
    cos_sin_reference,
    cos_sin_triton,
)
from rimuru.kernels.router import route_topk_reference, route_topk_triton  # noqa: E402
from rimuru.models.rotary import RotaryEmbedding  # noqa: E402

HBM_GBPS = 4260.0
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 16, 16, 128
EXPERTS, TOP_K, SHARED_F = 60, 4, 5632
LAYERS = 24
ROPE_THETA = 1e6
EPS = 1e-6
TOKENS = [1, 16, 64, 256, 4096]
# Calls per decode step of the 24-layer model.
PER_STEP = {"rms_norm": 1, "fused_add_rms_norm": 2 * LAYERS, "route_topk": LAYERS, "silu_and_mul": LAYERS,
            "sigmoid_mul_add": LAYERS, "cos_sin": 1, "rotary_qk": LAYERS, "moe_align": LAYERS}


@dataclass(frozen=True)
class Op:
    """One op at one T: inputs() -> a fresh random argument tuple; torch_fn(*args) and fused_fn(*args)
    compute the same thing; nbytes: what the op must read and write."""

    name: str
    inputs: Callable[[], tuple]
    torch_fn: Callable
    fused_fn: Callable
    nbytes: int


def make_ops(T: int, dtype: torch.dtype, dev: str = "cuda") -> list[Op]:
    e = torch.tensor([], dtype=dtype).element_size()
    w_norm = torch.ones(HIDDEN, dtype=dtype, device=dev) + 0.01 * torch.randn(HIDDEN, device=dev).to(dtype)
    bias = torch.zeros(EXPERTS, device=dev)
    inv_freq = RotaryEmbedding(HEAD_DIM, ROPE_THETA).inv_freq(torch.device(dev))
    half = HEAD_DIM // 2

    def rnd(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, device=dev) * scale).to(dtype)

    def qk() -> tuple[Tensor, ...]:
        qkv = rnd(T, (HEADS + 2 * KV_HEADS) * HEAD_DIM)  # q and k are strided views of the projection
        q = qkv[:, : HEADS * HEAD_DIM].view(T, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(T, KV_HEADS, HEAD_DIM)
        cos, sin = cos_sin_reference(torch.randint(0, 4096, (T,), device=dev), inv_freq, dtype)
        return q, k, cos, sin

    def torch_rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def torch_add_norm(x: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
        return fused_add_rms_norm_reference(x, r, w_norm, EPS)

    block_m = _tile_config(T * TOP_K / EXPERTS).block_m  # the fused MoE's M tile at this T

    def align(fn: Callable) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
        def run(ids: Tensor) -> tuple[Tensor, Tensor]:
            a = fn(ids, EXPERTS, block_m)
            return a.sorted_ids, a.block_end
        return run

    return [
        Op("rms_norm", lambda: (rnd(T, HIDDEN),), lambda x: rms_norm_reference(x, w_norm, EPS),
           lambda x: rms_norm_triton(x, w_norm, EPS), 2 * T * HIDDEN * e + HIDDEN * e),
        Op("fused_add_rms_norm", lambda: (rnd(T, HIDDEN), rnd(T, HIDDEN)), torch_add_norm,
           lambda x, r: fused_add_rms_norm_triton(x, r, w_norm, EPS), 4 * T * HIDDEN * e + HIDDEN * e),
        Op("route_topk", lambda: (rnd(T, EXPERTS, scale=2.0),),
           lambda lg: route_topk_reference(lg, bias, TOP_K, False),
           lambda lg: route_topk_triton(lg, bias, TOP_K, False),
           T * EXPERTS * e + EXPERTS * 4 + T * TOP_K * (4 + 8)),
        Op("silu_and_mul", lambda: (rnd(T, SHARED_F, scale=3.0), rnd(T, SHARED_F)), silu_and_mul_reference,
           silu_and_mul_triton, 3 * T * SHARED_F * e),
        Op("sigmoid_mul_add", lambda: (rnd(T, 1, scale=3.0), rnd(T, HIDDEN), rnd(T, HIDDEN)),
           sigmoid_mul_add_reference, sigmoid_mul_add_triton, T * e + 3 * T * HIDDEN * e),
        Op("cos_sin", lambda: (torch.randint(0, 4096, (T,), device=dev),),
           lambda p: cos_sin_reference(p, inv_freq, dtype), lambda p: cos_sin_triton(p, inv_freq, dtype),
           T * 8 + half * 4 + 2 * T * half * e),
        Op("rotary_qk", qk, torch_rotary_qk, apply_rotary_qk_triton,
           2 * T * (HEADS + KV_HEADS) * HEAD_DIM * e + 2 * T * half * e),
        Op("moe_align", lambda: (torch.randint(0, EXPERTS, (T, TOP_K), device=dev),), align(moe_align_torch),
           align(moe_align), T * TOP_K * (8 + 4) + EXPERTS * (block_m + 1) * 4),
    ]  # fmt: skip


def count_kernels(fn: Callable[[], Any]) -> int | None:
    """CUDA kernels one call launches (torch profiler); None where the profiler is unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - the count is informative only
        return None


def _same(a: Any, b: Any) -> bool:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _max_diff(a: Any, b: Any) -> float:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return max((x.double() - y.double()).abs().max().item() if x.numel() else 0.0 for x, y in zip(a, b, strict=True))


def measure(op: Op, T: int) -> dict[str, Any]:
    sets = [op.inputs() for _ in range(rotation_sets(op.nbytes))]
    row: dict[str, Any] = {"op": op.name, "T": T}
    for key, fn in (("torch", op.torch_fn), ("fused", op.fused_fn)):
        timing, outs = time_op([lambda a=a, fn=fn: fn(*a) for a in sets])
        if outs[0] is not None and not _same(outs[0], fn(*sets[0])):
            raise RuntimeError(f"{op.name} T={T} {key}: graph replay differs from an eager call")
        row[f"{key}_us"] = None if timing.graph_us is None else round(timing.graph_us, 2)
        row[f"{key}_eager_us"] = round(timing.eager_us, 2)
        row[f"{key}_kernels"] = count_kernels(lambda fn=fn: fn(*sets[0]))
        if timing.graph_error:
            row[f"{key}_graph_error"] = timing.graph_error
    # ids of routing may order exact ties differently; everything else is within an ulp or the same bits.
    fused_out, torch_out = op.fused_fn(*sets[0]), op.torch_fn(*sets[0])
    row["bit_exact"] = _same(fused_out, torch_out)
    row["max_abs_diff"] = _max_diff(fused_out, torch_out) if op.name != "route_topk" else None
    if row["fused_us"] and row["torch_us"]:
        row["speedup"] = round(row["torch_us"] / row["fused_us"], 2)
        row["gbps"] = round(op.nbytes / row["fused_us"] / 1e3, 1)
        row["pct_hbm"] = round(100 * row["gbps"] / HBM_GBPS, 1)
    return row


TABLE_HEADER = (f"{'op':20} {'T':>5} {'torch us':>9} {'fused us':>9} {'x':>6} {'torch eager':>11} "
                f"{'fused eager':>11} {'kernels':>8} {'GB/s':>7} {'%HBM':>5} {'exact':>5}")


def format_row(r: dict[str, Any]) -> str:
    def cell(key: str, fmt: str, width: int) -> str:
        return table_cell(r, key, fmt, width)

    kernels = f"{r.get('torch_kernels')}->{r.get('fused_kernels')}"
    return (f"{r['op']:20} {r['T']:>5} {cell('torch_us', '.2f', 9)} {cell('fused_us', '.2f', 9)} "
            f"{cell('speedup', '.2f', 6)} {cell('torch_eager_us', '.1f', 11)} {cell('fused_eager_us', '.1f', 11)} "
            f"{kernels:>8} {cell('gbps', '.0f', 7)} {cell('pct_hbm', '.1f', 5)} {str(r['bit_exact']):>5}")


def per_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sum over one decode step of the 24-layer model, per T."""
    out = []
    for T in sorted({r["T"] for r in rows}):
        at = [r for r in rows if r["T"] == T]
        total: dict[str, Any] = {"op": "per_step_total", "T": T}
        for key in ("torch_us", "fused_us", "torch_eager_us", "fused_eager_us", "torch_kernels", "fused_kernels"):
            vals = [(r.get(key), PER_STEP[r["op"]]) for r in at]
            total[key] = None if any(v is None for v, _ in vals) else round(sum(v * n for v, n in vals), 1)
        if total["torch_us"] and total["fused_us"]:
            total["speedup"] = round(total["torch_us"] / total["fused_us"], 2)
        total["bit_exact"] = all(r["bit_exact"] for r in at)
        out.append(total)
    return out


MD_COLS = [
    ("op", "op"), ("T", "T"), ("torch_us", "torch µs (graph)"), ("fused_us", "fused µs (graph)"),
    ("speedup", "speed-up"), ("torch_eager_us", "torch µs (eager)"), ("fused_eager_us", "fused µs (eager)"),
    ("torch_kernels", "torch kernels"), ("fused_kernels", "fused kernels"), ("gbps", "fused GB/s"),
    ("pct_hbm", "% of 4.26 TB/s"), ("bit_exact", "same bits"), ("max_abs_diff", "max abs diff"),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--output-md", type=Path, default=None)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_small_kernels needs a CUDA GPU")
    dtype = getattr(torch, opts.dtype)
    meta = metadata(
        "small_kernels", timing=TIMING_NOTE, dtype=opts.dtype, ceilings=dict(hbm_gbps=HBM_GBPS),
        shapes=dict(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, experts=EXPERTS, top_k=TOP_K,
                    shared_intermediate=SHARED_F, layers=LAYERS),
        per_step_calls=PER_STEP,
    )  # fmt: skip
    print_header(meta)
    print(TABLE_HEADER, flush=True)
    rows = []
    for T in opts.tokens:
        torch.manual_seed(T)
        for op in make_ops(T, dtype):
            rows.append(measure(op, T))
            print(format_row(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    totals = per_step(rows)
    print(f"\nper decode step ({LAYERS} layers; calls per step: {PER_STEP})")
    for r in totals:
        print(format_row(r))
    write_json(opts.output_json, meta, rows + totals)
    write_markdown(opts.output_md, "Small fused kernels vs torch", meta, MD_COLS, rows + totals)


if __name__ == "__main__":
    main()
