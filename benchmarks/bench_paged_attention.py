"""Paged attention on the GPU: decode GB/s and prefill TFLOP/s against the H200's ceilings.

    .venv/bin/python benchmarks/bench_paged_attention.py --output-json results/paged_attention.json

Decode is memory-bound: the headline is achieved HBM bandwidth over the K/V bytes it must read
(ceiling: 4.26 TB/s measured D2D). Prefill is compute-bound: causal FLOPs per second (ceiling:
779 TFLOP/s bf16 GEMM), next to torch SDPA (flash backend) on contiguous K/V of the same shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

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


def bench(fn) -> float:  # noqa: ANN001
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")  # ms


def causal_flops(q_len: int, seq_len: int, hq: int, d: int) -> float:
    # Row i of the chunk sees (seq_len - q_len + i + 1) keys: QK^T and PV, 2 FLOPs per MAC each.
    ctx = seq_len - q_len
    keys = q_len * ctx + q_len * (q_len + 1) / 2
    return 4.0 * d * hq * keys


def run(dtype: torch.dtype) -> list[dict]:
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for model, (hq, hkv, d) in MODELS.items():
        for batch in DECODE_BATCHES:
            for ctx in DECODE_CONTEXTS:
                args = make_inputs(1, ctx, batch, hq, hkv, d, dtype)
                ms = bench(lambda args=args: paged_attention_triton(*args))
                kv_bytes = batch * ctx * hkv * d * 2 * args[0].element_size()
                io_bytes = 2 * args[0].numel() * args[0].element_size()  # q in, out
                gbps = (kv_bytes + io_bytes) / ms / 1e6
                splits = plan_launch(batch, hq, hkv, d, BLOCK_SIZE, 1, sms)["NUM_SPLITS"]
                rows.append(dict(
                    phase="decode", model=model, batch=batch, context=ctx, q_len=1, ms=ms, splits=splits,
                    gbps=gbps, pct_hbm=100 * gbps / HBM_GBPS,
                ))  # fmt: skip
                del args
        for chunk in PREFILL_CHUNKS:
            for ctx in (0, 4096) if chunk in (512, 2048) else (0,):
                args = make_inputs(chunk, ctx + chunk, 1, hq, hkv, d, dtype)
                ms = bench(lambda args=args: paged_attention_triton(*args))
                flops = causal_flops(chunk, ctx + chunk, hq, d)
                row = dict(
                    phase="prefill", model=model, batch=1, context=ctx, q_len=chunk, ms=ms,
                    tflops=flops / ms / 1e9, pct_peak=100 * flops / ms / 1e9 / BF16_TFLOPS,
                )  # fmt: skip
                if ctx == 0:
                    # SDPA flash on contiguous K/V (heads expanded for GQA: flash wants equal heads).
                    q = args[0].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
                    k = torch.randn(1, hq, chunk, d, device="cuda", dtype=dtype)
                    v = torch.randn_like(k)
                    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                        sdpa_ms = bench(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                    row.update(sdpa_ms=sdpa_ms, sdpa_tflops=flops / sdpa_ms / 1e9, vs_sdpa=ms / sdpa_ms)
                rows.append(row)
                del args
        torch.cuda.empty_cache()
    return rows


def _cell(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "-"


def print_table(rows: list[dict]) -> None:
    print(f"{'model':14} {'phase':7} {'B':>4} {'ctx':>5} {'q_len':>5} {'ms':>8} {'splits':>6} "
          f"{'GB/s':>7} {'%HBM':>5} {'TFLOP/s':>8} {'%peak':>5} {'sdpa ms':>8} {'ours/sdpa':>9}")  # fmt: skip
    for r in rows:
        head = f"{r['model']:14} {r['phase']:7} {r['batch']:>4} {r['context']:>5} {r['q_len']:>5} {r['ms']:>8.4f}"
        cells = [
            f"{_cell(r, 'splits', 'd'):>6}", f"{_cell(r, 'gbps', '.0f'):>7}", f"{_cell(r, 'pct_hbm', '.1f'):>5}",
            f"{_cell(r, 'tflops', '.1f'):>8}", f"{_cell(r, 'pct_peak', '.1f'):>5}",
            f"{_cell(r, 'sdpa_ms', '.4f'):>8}", f"{_cell(r, 'vs_sdpa', '.2f'):>9}",
        ]  # fmt: skip
        print(head, *cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_paged_attention needs a CUDA GPU")
    rows = run(getattr(torch, opts.dtype))
    print_table(rows)
    if opts.output_json:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
        report = dict(
            benchmark="paged_attention",
            device=torch.cuda.get_device_name(0),
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            git_commit=commit,
            command=" ".join([sys.executable, *sys.argv]),
            torch=torch.__version__,
            dtype=opts.dtype,
            ceilings=dict(hbm_gbps=HBM_GBPS, bf16_tflops=BF16_TFLOPS),
            rows=rows,
        )
        opts.output_json.parent.mkdir(parents=True, exist_ok=True)
        opts.output_json.write_text(json.dumps(report, indent=2))
        print(f"wrote {opts.output_json}")


if __name__ == "__main__":
    main()
