"""Paged attention on the GPU: decode GB/s and prefill TFLOP/s against the H200's ceilings.

    PYTHONPATH=. python benchmarks/bench_paged_attention.py --output-json benchmarks/results/paged_attention_h200.json

Decode is memory-bound: the headline is achieved HBM bandwidth over the K/V bytes it must read
(ceiling: 4.26 TB/s measured D2D). Prefill is compute-bound: causal FLOPs per second (ceiling:
779 TFLOP/s bf16 GEMM), next to torch SDPA (flash backend) on contiguous K/V of the same shape.
Times (`us`) are CUDA-graph replays of the op (attention + split merge), rotated over input sets
so small K/V is not re-read from L2; `eager_us` is the same op called back to back from Python,
host launch overhead included.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    TIMING_NOTE,
    metadata,
    print_header,
    rotation_sets,
    time_op,
    write_json,
    write_markdown,
)
from rimuru.kernels.paged_attention import paged_attention_triton, plan_launch  # noqa: E402

HBM_GBPS = 4260.0
BF16_TFLOPS = 779.0
BLOCK_SIZE = 16
MODELS = {  # name: (q heads, kv heads, head_dim)
    "qwen1.5-moe": (16, 16, 128),
    "qwen3-30b-a3b": (32, 4, 128),
}
DECODE_BATCHES = [1, 4, 16, 64, 256]
DECODE_CONTEXTS = [128, 512, 1024, 4096]
PREFILL_CHUNKS = [512, 1024, 2048, 4096]


def make_inputs(q_len: int, seq_len: int, batch: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> tuple:
    """Every sequence: q_len new tokens at the end of seq_len context, on shuffled pages."""
    blocks = -(-seq_len // BLOCK_SIZE)
    num_pages = batch * blocks
    kv_cache = torch.randn(num_pages, 2, BLOCK_SIZE, hkv, d, device="cuda", dtype=dtype)  # [P, 2, bs, Hkv, D]
    block_table = torch.randperm(num_pages, device="cuda", dtype=torch.int32).view(batch, blocks)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * q_len  # [B + 1]
    seq_lens = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    q = torch.randn(batch * q_len, hq, d, device="cuda", dtype=dtype)  # [T, Hq, D]
    return q, kv_cache, block_table, qsl, seq_lens, d**-0.5, q_len, seq_len


def timed(shape: tuple, nbytes: int) -> tuple[float, float]:
    """(graph us, eager us) of paged_attention_triton over rotated sets of make_inputs(*shape)."""
    sets = [make_inputs(*shape) for _ in range(rotation_sets(nbytes))]
    timing, outs = time_op([lambda a=a: paged_attention_triton(*a) for a in sets])
    if timing.graph_us is None:
        raise RuntimeError(f"paged attention could not be captured in a CUDA graph: {timing.graph_error}")
    assert torch.equal(outs[0], paged_attention_triton(*sets[0])), "graph replay differs from an eager call"
    return timing.graph_us, timing.eager_us


def causal_flops(q_len: int, seq_len: int, hq: int, d: int) -> float:
    # Row i of the chunk sees (seq_len - q_len + i + 1) keys: QK^T and PV, 2 FLOPs per MAC each.
    ctx = seq_len - q_len
    keys = q_len * ctx + q_len * (q_len + 1) / 2
    return 4.0 * d * hq * keys


def run(dtype: torch.dtype) -> list[dict]:
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    elem = torch.tensor([], dtype=dtype).element_size()
    for model, (hq, hkv, d) in MODELS.items():
        for batch in DECODE_BATCHES:
            for ctx in DECODE_CONTEXTS:
                kv_bytes = batch * ctx * hkv * d * 2 * elem
                io_bytes = 2 * batch * hq * d * elem  # q in, out
                us, eager_us = timed((1, ctx, batch, hq, hkv, d, dtype), kv_bytes)
                gbps = (kv_bytes + io_bytes) / us / 1e3
                splits = plan_launch(batch, hq, hkv, d, BLOCK_SIZE, 1, sms, elem).num_splits
                rows.append(dict(
                    phase="decode", model=model, batch=batch, context=ctx, q_len=1, us=us, eager_us=eager_us,
                    splits=splits, gbps=gbps, pct_hbm=100 * gbps / HBM_GBPS,
                ))  # fmt: skip
                print(format_row(rows[-1]), flush=True)
        for chunk in PREFILL_CHUNKS:
            for ctx in (0, 4096) if chunk in (512, 2048) else (0,):
                kv_bytes = (ctx + chunk) * hkv * d * 2 * elem
                us, eager_us = timed((chunk, ctx + chunk, 1, hq, hkv, d, dtype), kv_bytes)
                flops = causal_flops(chunk, ctx + chunk, hq, d)
                row = dict(
                    phase="prefill", model=model, batch=1, context=ctx, q_len=chunk, us=us, eager_us=eager_us,
                    tflops=flops / us / 1e6, pct_peak=100 * flops / us / 1e6 / BF16_TFLOPS,
                )  # fmt: skip
                if ctx == 0:
                    # SDPA flash on contiguous K/V (heads expanded for GQA: flash wants equal heads).
                    q = torch.randn(1, hq, chunk, d, device="cuda", dtype=dtype)  # [1, Hq, L, D]
                    k = torch.randn(1, hq, chunk, d, device="cuda", dtype=dtype)
                    v = torch.randn_like(k)

                    def sdpa(q=q, k=k, v=v) -> torch.Tensor:  # noqa: ANN001
                        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                    timing, _ = time_op([sdpa])
                    sdpa_us = timing.graph_us if timing.graph_us is not None else timing.eager_us
                    row.update(sdpa_us=sdpa_us, sdpa_eager_us=timing.eager_us, sdpa_tflops=flops / sdpa_us / 1e6,
                               vs_sdpa=us / sdpa_us)  # fmt: skip
                rows.append(row)
                print(format_row(row), flush=True)
        torch.cuda.empty_cache()
    return rows


def _cell(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "-"


TABLE_HEADER = (
    f"{'model':14} {'phase':7} {'B':>4} {'ctx':>5} {'q_len':>5} {'us':>8} {'eager us':>8} {'splits':>6} "
    f"{'GB/s':>7} {'%HBM':>5} {'TFLOP/s':>8} {'%peak':>5} {'sdpa us':>8} {'ours/sdpa':>9}"
)


def format_row(r: dict) -> str:
    head = (
        f"{r['model']:14} {r['phase']:7} {r['batch']:>4} {r['context']:>5} {r['q_len']:>5} "
        f"{r['us']:>8.1f} {r['eager_us']:>8.1f}"
    )
    cells = [
        f"{_cell(r, 'splits', 'd'):>6}", f"{_cell(r, 'gbps', '.0f'):>7}", f"{_cell(r, 'pct_hbm', '.1f'):>5}",
        f"{_cell(r, 'tflops', '.1f'):>8}", f"{_cell(r, 'pct_peak', '.1f'):>5}",
        f"{_cell(r, 'sdpa_us', '.1f'):>8}", f"{_cell(r, 'vs_sdpa', '.2f'):>9}",
    ]  # fmt: skip
    return " ".join([head, *cells])


MD_COLS = [
    ("model", "model"), ("phase", "phase"), ("batch", "B"), ("context", "context"), ("q_len", "q_len"),
    ("us", "µs (graph)"), ("eager_us", "µs (eager)"), ("splits", "splits"), ("gbps", "GB/s"),
    ("pct_hbm", "% of 4.26 TB/s"), ("tflops", "TFLOP/s"), ("pct_peak", "% of 779 TFLOP/s"),
    ("sdpa_us", "SDPA flash µs (graph)"), ("vs_sdpa", "ours / SDPA"),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--output-md", type=Path, default=None)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_paged_attention needs a CUDA GPU")
    meta = metadata(
        "paged_attention", timing=TIMING_NOTE, dtype=opts.dtype, block_size=BLOCK_SIZE,
        ceilings=dict(hbm_gbps=HBM_GBPS, bf16_tflops=BF16_TFLOPS),
    )  # fmt: skip
    print_header(meta)
    print(TABLE_HEADER, flush=True)
    rows = run(getattr(torch, opts.dtype))  # prints each row as it is measured
    write_json(opts.output_json, meta, rows)
    write_markdown(opts.output_md, "Paged attention", meta, MD_COLS, rows)


if __name__ == "__main__":
    main()
