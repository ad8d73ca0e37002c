"""The hot memory-bound kernels load global memory 16 bytes at a time (checked in their PTX, on the CPU).

A reshape of the computed page offsets can hide their divisibility from Triton: decode attention then loads K
and V one bf16 element per instruction and runs at ~35 % of HBM bandwidth on the H200
(benchmarks/results/2026-11-29-tune-paged-attention-h200.json). Nothing else fails in that case: the results
stay right.
These tests compile the kernels for sm_90 with Triton's own compiler (no GPU needed) and read the
load widths from the PTX.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from rimuru.kernels import fused_moe, paged_attention  # noqa: E402
from rimuru.testing.ptx import compile_ptx, global_load_bytes  # noqa: E402

ATTENTION_SIG = {
    "q_ptr": "*bf16", "kv_ptr": "*bf16", "block_table_ptr": "*i32", "query_start_loc_ptr": "*i32",
    "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
    "q_tile_start_ptr": "*i32", "scale_log2": "fp32", "num_tokens": "i32", "num_seqs": "i32",
    "stride_q_t": "i32", "stride_q_h": "i32", "stride_kv_page": "i32", "stride_kv_kind": "i32",
    "stride_kv_slot": "i32", "stride_kv_head": "i32", "stride_bt_b": "i32", "stride_o_t": "i32", "stride_o_h": "i32",
}  # fmt: skip
# What the launcher specialises for Qwen1.5-MoE's cache (16 KV heads x 128 dims, 16-token pages).
ATTENTION_DIVISIBLE = {n for n in ATTENTION_SIG if n.endswith("_ptr") or n.startswith("stride")}


def _attention_ptx(plan: paged_attention.LaunchPlan, tile_map: bool, num_splits: int) -> str:
    consts = dict(NUM_Q_HEADS=16, GROUP=1, HEAD_DIM=128, D_PAD=plan.d_pad, BLOCK_Q=plan.block_q,
                  BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_SIZE=16, NUM_SPLITS=num_splits,
                  DOT_PRECISION="tf32", TILE_MAP=tile_map, SEARCH_STEPS=9 if tile_map else 0)
    return compile_ptx(paged_attention._paged_attention_kernel, ATTENTION_SIG, consts, ATTENTION_DIVISIBLE,
                       num_warps=plan.num_warps, num_stages=plan.num_stages)


@pytest.mark.parametrize("case", ["decode", "decode-split", "tile-map"])
def test_paged_attention_loads_kv_in_16_byte_vectors(case: str) -> None:
    if case == "tile-map":
        plan = paged_attention.plan_launch(1, 16, 16, 128, 16, paged_attention.TILE_MAP_QUERY_LEN, 132)
    else:
        plan = paged_attention.plan_launch(32 if case == "decode" else 4, 16, 16, 128, 16, 1, 132)
    splits = 1 if case == "tile-map" else plan.num_splits
    assert (splits > 1) == (case == "decode-split")
    widths = global_load_bytes(_attention_ptx(plan, case == "tile-map", splits))
    # K and V tiles: [block_n, 128] bf16 each, 16 bytes per load -> block_n * 128 * 2 * 2 / 16 per tile,
    # spread over the program's threads; what must not appear is a 2-byte (one bf16) load.
    assert widths[2] == 0, f"one-element K/V loads in the PTX: {dict(widths)}"
    assert widths[16] >= 2 * plan.block_n * 128 * 2 // 16 // (32 * plan.num_warps), dict(widths)


@pytest.mark.parametrize("host", [False, True], ids=["pages", "host-rows"])
@pytest.mark.parametrize("kernel", ["gate_up", "down"])
def test_fused_moe_loads_weights_in_16_byte_vectors(kernel: str, host: bool) -> None:
    sig = {"a_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "table_ptr": "*i32", "sorted_ptr": "*i32",
           "block_end_ptr": "*i32"}
    if kernel == "gate_up":
        sig |= {"out_ptr": "*bf16", "n": "i32", "top_k": "i32", "num_experts": "i32", "num_pid_m": "i32",
                "stride_a": "i32"}
        fn, block_n = fused_moe._gate_up_kernel, 32
    else:
        sig |= {"weight_ptr": "*fp32", "out_ptr": "*bf16", "n": "i32", "num_experts": "i32", "num_pid_m": "i32"}
        fn, block_n = fused_moe._down_kernel, 32
    cfg = fused_moe._tile_config(1.0)  # decode: few rows per expert, weights streamed
    consts = dict(F=1408, D=2048, PAGED=True, HOST=host, BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
                  BLOCK_E=64, GROUP_M=cfg.group_m)
    divisible = {n for n in sig if n.endswith("_ptr") or n == "stride_a"}
    widths = global_load_bytes(compile_ptx(fn, sig, consts, divisible, cfg.num_warps, cfg.num_stages))
    assert widths[2] == 0, dict(widths)
    assert widths[16] > 0, dict(widths)
