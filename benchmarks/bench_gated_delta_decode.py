"""One gated DeltaNet layer's decode step on the GPU: the paged kernels against the bytes they must move.

    PYTHONPATH=. python benchmarks/bench_gated_delta_decode.py --output-json benchmarks/results/gdn_decode_h200.json

Shapes from a preset (default qwen3.5-35b-a3b: Hk 16, Hv 32, dk = dv = 128, conv_dim 8,192, kernel 4, hidden
2,048), model dtype bf16; B sequences decode one token each, their states on distinct shuffled pages of a pool.
Per B, three things are timed over rotated input sets (pages and inputs), as CUDA-graph replays (`us`, the GPU
time) and eager calls back to back (`eager_us`, launches included):

    kernels   causal_conv1d_update + gated_delta_decode: the state-moving part of the step. Its bytes: each
              sequence's recurrent state read and written (Hv x dk x dv fp32, 2 MiB each way at 35B) and its conv
              state read and written, plus the small per-token inputs and outputs. GB/s = those bytes / time,
              against the H200's 4.26 TB/s.
    paged     GatedDeltaNet.decode_paged, the whole layer as the engine runs it on CUDA (projections, l2 norms,
              the gated norm and out_proj around the two kernels); its bytes add the layer's weights.
    gather    LinearStateCache.read -> GatedDeltaNet.forward(recurrent=True) -> write: the path the kernels replace
              (gathered copies, the per-token recurrence in torch, scatter). It syncs with the host, so it has no
              graph time; its eager time is what a step paid before.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
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
    timing_fields,
    write_json,
    write_markdown,
)
from rimuru.kernels.causal_conv1d_update import causal_conv1d_update  # noqa: E402
from rimuru.kernels.gated_delta_decode import gated_delta_decode  # noqa: E402
from rimuru.model_spec import load_model_spec  # noqa: E402
from rimuru.models.forward_batch import ForwardBatch  # noqa: E402
from rimuru.models.gated_deltanet import GatedDeltaNet  # noqa: E402
from rimuru.models.state_cache import LinearStateCache  # noqa: E402

DEV = "cuda"
HBM_GBPS = 4260.0
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def make_layer(preset: str, dtype: torch.dtype) -> GatedDeltaNet:
    spec = load_model_spec(preset)
    layer = GatedDeltaNet(spec.hidden_size, spec.linear_num_key_heads, spec.linear_num_value_heads,
                          spec.linear_key_head_dim, spec.linear_value_head_dim, spec.linear_conv_kernel_dim,
                          spec.rms_norm_eps)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("weight") and p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
        layer.A_log.uniform_(-1.0, 0.5)
    return layer.to(device=DEV, dtype=dtype).eval()


def decode_batch(pages: Tensor) -> ForwardBatch:
    """A pure-decode batch of B sequences (one token each, context 100) whose state pages are `pages` [B]."""
    B = pages.shape[0]
    dev = pages.device
    return ForwardBatch(
        input_ids=torch.zeros(B, dtype=torch.int64, device=dev), positions=torch.full((B,), 99, device=dev),
        query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((B,), 100, dtype=torch.int32, device=dev),
        block_tables=torch.zeros(0, B, 1, dtype=torch.int32, device=dev),
        slot_mapping=torch.zeros(0, B, dtype=torch.int64, device=dev),
        logits_indices=torch.arange(B, device=dev), max_query_len=1, max_seq_len=100,
        ssm_pages=pages[None], conv_pages=pages[None],
    )  # fmt: skip


def measure(layer: GatedDeltaNet, B: int, dtype: torch.dtype) -> dict[str, Any]:
    (C, Km1), (Hv, dk, dv) = layer.state_shapes()
    Hk, el = layer.num_k_heads, torch.tensor([], dtype=dtype).element_size()
    hidden = layer.in_proj_qkv.in_features
    ssm_bytes, conv_bytes = Hv * dk * dv * 4, C * Km1 * el  # one sequence's states of this layer
    # per sequence: conv input and output, q and k (fp32), v, g and beta (fp32), o (fp32)
    io_bytes = 2 * C * el + 2 * Hk * dk * 4 + Hv * dv * el + 2 * Hv * 4 + Hv * dv * 4
    state_bytes = 2 * B * (ssm_bytes + conv_bytes)  # both states read and written
    kernel_bytes = state_bytes + B * io_bytes
    weight_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    sets = rotation_sets(kernel_bytes)
    n_pages = sets * B + 1
    ssm = torch.randn(n_pages, Hv, dk, dv, device=DEV) * 0.02
    conv = torch.randn(n_pages, C, Km1, device=DEV).to(dtype)
    perm = torch.randperm(n_pages, device=DEV)
    page_sets = [perm[i * B : (i + 1) * B].contiguous() for i in range(sets)]  # distinct pages per set
    has_state = torch.ones(B, dtype=torch.bool, device=DEV)
    cache = LinearStateCache(ssm, conv, in_place_decode=True)
    gather_cache = LinearStateCache(ssm, conv, in_place_decode=False)
    weight = layer.conv1d.weight.squeeze(1)

    def kernel_inputs() -> tuple[Tensor, ...]:
        x = torch.randn(B, C, device=DEV).to(dtype)
        q = torch.nn.functional.normalize(torch.randn(B, Hk, dk, device=DEV), dim=-1) * dk**-0.5
        k = torch.nn.functional.normalize(torch.randn(B, Hk, dk, device=DEV), dim=-1)
        v = torch.randn(B, Hv, dv, device=DEV).to(dtype)
        g = -torch.rand(B, Hv, device=DEV) * 0.1
        beta = torch.rand(B, Hv, device=DEV)
        return x, q, k, v, g, beta

    inputs = [kernel_inputs() for _ in range(sets)]
    xs = [torch.randn(B, hidden, device=DEV).to(dtype) for _ in range(sets)]
    batches = [decode_batch(p) for p in page_sets]

    def kernels(i: int) -> tuple[Tensor, Tensor]:
        x, q, k, v, g, beta = inputs[i]
        y = causal_conv1d_update(x, conv, weight, page_sets[i], has_state)
        o = gated_delta_decode(q, k, v, g, beta, ssm, page_sets[i], has_state)
        return y, o

    def paged(i: int) -> Tensor:
        return cache.decode(layer, 0, batches[i], xs[i], has_state)

    def gather(i: int) -> Tensor:
        batch = batches[i]
        conv0, ssm0 = gather_cache.read(0, batch)
        out, conv1, ssm1 = layer(xs[i], batch.query_start_loc, conv0, ssm0, has_state, recurrent=True)
        gather_cache.write(0, batch, conv1, ssm1)
        return out

    row: dict[str, Any] = {"B": B, "sets": sets, "state_mb": round(state_bytes / 2**20, 2),
                           "kernel_mb": round(kernel_bytes / 2**20, 2), "weight_mb": round(weight_bytes / 2**20, 2)}
    fns: list[tuple[str, Callable[[int], Any], bool]] = [
        ("kernels", kernels, True), ("paged", paged, True), ("gather", gather, False)]  # gather syncs: eager only
    with torch.no_grad():
        for name, fn, capture in fns:
            timing, _ = time_op([lambda i=i, fn=fn: fn(i) for i in range(sets)], capture=capture)
            row.update(timing_fields(name, timing))
    if row["kernels_us"]:
        row["gbps"] = round(kernel_bytes / row["kernels_us"] / 1e3, 1)
        row["pct_hbm"] = round(100 * row["gbps"] / HBM_GBPS, 1)
    if row["paged_us"]:
        row["paged_gbps"] = round((kernel_bytes + weight_bytes) / row["paged_us"] / 1e3, 1)
        row["speedup_vs_gather_eager"] = round(row["gather_eager_us"] / row["paged_us"], 2)
    return row


HEADER = (f"{'B':>4} {'state MB':>9} {'kernels us':>10} {'GB/s':>7} {'%HBM':>5} {'eager us':>9} {'paged us':>9} "
          f"{'paged eager':>11} {'gather eager':>12} {'x':>6}")


def format_row(r: dict[str, Any]) -> str:
    def cell(key: str, fmt: str, width: int) -> str:
        return table_cell(r, key, fmt, width)

    return (f"{r['B']:>4} {r['state_mb']:>9.1f} {cell('kernels_us', '.1f', 10)} {cell('gbps', '.0f', 7)} "
            f"{cell('pct_hbm', '.1f', 5)} {cell('kernels_eager_us', '.1f', 9)} {cell('paged_us', '.1f', 9)} "
            f"{cell('paged_eager_us', '.1f', 11)} {cell('gather_eager_us', '.1f', 12)} "
            f"{cell('speedup_vs_gather_eager', '.1f', 6)}")


MD_COLS = [
    ("B", "B"), ("state_mb", "state MiB (read + write)"), ("kernels_us", "kernels µs (graph)"), ("gbps", "GB/s"),
    ("pct_hbm", "% of 4.26 TB/s"), ("kernels_eager_us", "kernels µs (eager)"), ("paged_us", "layer µs (graph)"),
    ("paged_eager_us", "layer µs (eager)"), ("gather_eager_us", "gather path µs (eager)"),
    ("speedup_vs_gather_eager", "gather eager / layer graph"),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.5-35b-a3b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=BATCHES)
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--output-md", type=Path, default=None)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gated_delta_decode needs a CUDA GPU")
    dtype = getattr(torch, opts.dtype)
    torch.manual_seed(0)
    layer = make_layer(opts.preset, dtype)
    (C, Km1), (Hv, dk, dv) = layer.state_shapes()
    meta = metadata(
        "gated_delta_decode", timing=TIMING_NOTE, dtype=opts.dtype, preset=opts.preset,
        ceilings=dict(hbm_gbps=HBM_GBPS),
        shapes=dict(num_k_heads=layer.num_k_heads, num_v_heads=Hv, head_k_dim=dk, head_v_dim=dv, conv_dim=C,
                    conv_kernel=Km1 + 1, hidden=layer.in_proj_qkv.in_features),
    )  # fmt: skip
    print_header(meta)
    print(HEADER, flush=True)
    rows = []
    for B in opts.batch_sizes:
        rows.append(measure(layer, B, dtype))
        print(format_row(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    write_json(opts.output_json, meta, rows)
    write_markdown(opts.output_md, f"Gated DeltaNet decode ({opts.preset})", meta, MD_COLS, rows)


if __name__ == "__main__":
    main()
