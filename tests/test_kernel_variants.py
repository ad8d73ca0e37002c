"""A new batch shape builds no new Triton kernel variant: the launchers at two shapes that differ in per-step counts,
the block table's width and the alignment of per-layer index rows (a layer's row of an [L, B] array starts at
l*B*itemsize bytes) ask Triton's binder for the same variant of every kernel. Without that, an eager step meeting a
new shape waits for a compile (engine/kernel_warmup.py, kernels/kernel_builds.py). Runs on the CPU: the keys come
from Triton's own binder, nothing is compiled or run (rimuru/testing/kernel_variants.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rimuru.kernels import causal_conv1d_update as conv_mod  # noqa: E402
from rimuru.kernels import fused_moe as moe_mod  # noqa: E402
from rimuru.kernels import gated_delta_decode as delta_mod  # noqa: E402
from rimuru.kernels import moe_align as align_mod  # noqa: E402
from rimuru.kernels import paged_attention as attn_mod  # noqa: E402
from rimuru.kernels import rotary as rotary_mod  # noqa: E402
from rimuru.testing.kernel_variants import recorded_variants  # noqa: E402

HQ, HKV, D, BLOCK, PAGES = 4, 2, 16, 4, 8


def _variants(launch, *kernels) -> dict[str, set[str]]:
    with recorded_variants(*kernels) as records:
        launch()
    out: dict[str, set[str]] = {}
    for name, key in records:
        out.setdefault(name, set()).add(key)
    return out


def _same_variants(launch_a, launch_b, *kernels) -> None:
    a, b = _variants(launch_a, *kernels), _variants(launch_b, *kernels)
    assert a, "no kernel was launched"
    assert a == b


def _row(rows: torch.Tensor, layer: int) -> torch.Tensor:
    return rows[layer]  # a view at layer * row bytes: 16-byte aligned or not, by the shape


def _attention(batch: int, width: int, layer: int, query_len: int):
    def launch() -> None:
        T = batch * query_len
        q = torch.randn(T, HQ, D)
        kv = torch.zeros(PAGES, 2, BLOCK, HKV, D)
        tables = torch.zeros(3, batch, width, dtype=torch.int32)
        qsl = torch.arange(0, T + 1, query_len, dtype=torch.int32)
        lens = torch.full((batch,), query_len, dtype=torch.int32)
        attn_mod.paged_attention_triton(q, kv, _row(tables, layer), qsl, lens, 0.25, query_len, query_len)
    return launch


@pytest.mark.parametrize("query_len", [1, 40])
def test_paged_attention_one_variant_per_launch_plan(query_len):
    a = dict(batch=5, width=3, layer=1)  # row at 60 bytes, stride 3
    b = dict(batch=7, width=16, layer=0)  # row at 0 bytes, stride 16
    plan = [attn_mod.plan_launch(s["batch"], HQ, HKV, D, BLOCK, query_len, attn_mod._num_sms(torch.device("cpu")),
                                 elem_size=4) for s in (a, b)]
    assert plan[0] == plan[1], "the two shapes must share a launch plan (its tiles are constexprs)"
    assert query_len > 16 or plan[0].num_splits > 1  # the decode shapes take the split path and its merge kernel
    _same_variants(_attention(**a, query_len=query_len), _attention(**b, query_len=query_len),
                   attn_mod._paged_attention_kernel, attn_mod._merge_splits_kernel)


def _kv_write(tokens: int, layer: int, fused_rotary: bool):
    def launch() -> None:
        q, k, v = torch.randn(tokens, HQ, D), torch.randn(tokens, HKV, D), torch.randn(tokens, HKV, D)
        kv = torch.zeros(PAGES, 2, BLOCK, HKV, D)
        slots = _row(torch.arange(3 * tokens, dtype=torch.int64).reshape(3, tokens) % (PAGES * BLOCK), layer)
        if fused_rotary:
            cos, sin = torch.randn(tokens, D // 2), torch.randn(tokens, D // 2)
            rotary_mod.rotary_write_kv_triton(q, k, v, cos, sin, kv, slots)
        else:
            attn_mod.write_kv_triton(k, v, kv, slots)
    return launch


@pytest.mark.parametrize("fused_rotary", [True, False])
def test_kv_writes_one_variant_for_any_slot_row(fused_rotary):
    # 5 tokens: layer 1's slot row starts at 40 bytes; 8 tokens: layer 0's at 0
    _same_variants(_kv_write(5, 1, fused_rotary), _kv_write(8, 0, fused_rotary),
                   rotary_mod._rotary_write_kv_kernel, attn_mod._write_kv_kernel)


def _moe(tokens: int, layer: int, experts: int = 8, top_k: int = 2, f: int = 32):
    def launch() -> None:
        g = torch.Generator().manual_seed(tokens)
        hidden = torch.randn(tokens, D, generator=g)
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, generator=g)
        view = torch.zeros(3 * experts, f * D)
        tables = torch.arange(2 * experts * 3, dtype=torch.int32).reshape(2, experts, 3) % (3 * experts)
        moe_mod.fused_moe_triton(hidden, weights, ids, view, _row(tables, layer), f)
    return launch


def test_fused_moe_one_variant_per_tile_tier():
    # 8 tokens x top-2 = 16 assignments (divisible by 16), 5 x 2 = 10: the same tile tier (<= 16 rows an expert)
    _same_variants(_moe(8, 0), _moe(5, 1), moe_mod._gate_up_kernel, moe_mod._down_kernel,
                   align_mod._moe_align_single_kernel)


def test_chunked_alignment_one_variant_per_chunk_power_of_two():
    # 5,000 and 6,000 assignments: 5 and 6 chunks of 1,024, one power of two (8) for the scan's loops
    def launch(n: int):
        return lambda: align_mod._moe_align_chunked(torch.randint(0, 60, (n, 1)), 60, 32)
    assert align_mod.chunked_variant(5000) == align_mod.chunked_variant(6000)
    _same_variants(launch(5000), launch(6000), align_mod._moe_align_count_kernel, align_mod._moe_align_scan_kernel,
                   align_mod._moe_align_scatter_kernel)


def _state_kernels(batch: int, layer: int):
    hk, hv, dk, dv, conv_dim, width = 1, 2, 16, 32, 24, 4

    def launch() -> None:
        pages = _row(torch.arange(2 * batch, dtype=torch.int64).reshape(2, batch) % PAGES, layer)
        has_state = torch.ones(batch, dtype=torch.bool)
        q, k = torch.randn(batch, hk, dk), torch.randn(batch, hk, dk)
        v, g, beta = torch.randn(batch, hv, dv), torch.randn(batch, hv), torch.rand(batch, hv)
        ssm = torch.zeros(PAGES, hv, dk, dv)
        delta_mod.gated_delta_decode_triton(q, k, v, g, beta, ssm, pages, has_state, qk_scale=dk ** -0.5)
        x, conv, weight = torch.randn(batch, conv_dim), torch.zeros(PAGES, conv_dim, width - 1), torch.randn(
            conv_dim, width)
        conv_mod.causal_conv1d_update_triton(x, conv, weight, pages, has_state)
    return launch


def test_state_kernels_one_variant_for_any_page_row():
    cpu_sms = delta_mod._num_sms(torch.device("cpu"))
    assert delta_mod.block_v(3, 2, 16, 32, cpu_sms) == delta_mod.block_v(4, 2, 16, 32, cpu_sms)  # one tile width
    # 3 sequences: layer 1's page row starts at 24 bytes; 4: layer 0's at 0
    _same_variants(_state_kernels(3, 1), _state_kernels(4, 0), delta_mod._gated_delta_decode_kernel,
                   conv_mod._causal_conv1d_update_kernel)


def test_recorder_sees_what_the_kernels_still_specialise_on():
    """The check can fail: a model constant the kernels do specialise on (the K/V head dim's layout: kv_cache's
    strides) gives another variant, so equal keys above are the opt-outs' doing, not a recorder that sees nothing."""
    def launch(kv_heads: int):
        def run() -> None:
            k = v = torch.randn(4, kv_heads, D)
            attn_mod.write_kv_triton(k, v, torch.zeros(PAGES, 2, BLOCK, kv_heads, D), torch.arange(4))
        return run
    a = _variants(launch(HKV), attn_mod._write_kv_kernel)
    b = _variants(launch(3), attn_mod._write_kv_kernel)
    assert a and b and a != b
