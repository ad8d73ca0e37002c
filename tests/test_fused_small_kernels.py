"""The small fused kernels (RMSNorm +- residual add, routing, SiLU-and-mul, the shared-expert combine, rotary)
against their torch references: CPU dispatch, the Triton interpreter on the CPU, and CUDA (bit-exact where the
kernel emulates torch's rounding order); the fused residual layout of the decoder against the unfused one."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

import rimuru.kernels.activation as activation
import rimuru.kernels.rmsnorm as rmsnorm
import rimuru.kernels.rotary as rotary
import rimuru.kernels.router as router
from rimuru.kernels.activation import (
    sigmoid_mul_add,
    sigmoid_mul_add_reference,
    silu_and_mul,
    silu_and_mul_reference,
)
from rimuru.kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_gated,
    rms_norm_gated_reference,
    rms_norm_reference,
)
from rimuru.kernels.rotary import (
    apply_rotary,
    apply_rotary_qk,
    cos_sin_reference,
    rotary_write_kv,
    rotary_write_kv_reference,
)
from rimuru.kernels.router import route_topk, route_topk_reference
from rimuru.models.rotary import RotaryEmbedding
from rimuru.testing.triton_interpreter import run_under_interpreter

REPO = Path(__file__).resolve().parents[1]
DTYPES = (torch.float32, torch.bfloat16)
EPS = 1e-6

# ---------------------------------------------------------------------------------------------- helpers


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int, scale: float = 1.0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def ulps(a: Tensor, b: Tensor) -> Tensor:
    """Distance in units in the last place between same-dtype float tensors (0 = same bits)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    int_t, mag = (torch.int32, 0x7FFFFFFF) if a.element_size() == 4 else (torch.int16, 0x7FFF)
    ia, ib = a.contiguous().view(int_t).long(), b.contiguous().view(int_t).long()
    oa = torch.where(ia < 0, -(ia & mag), ia)  # sign-magnitude -> ordered integers
    ob = torch.where(ib < 0, -(ib & mag), ib)
    return (oa - ob).abs()


def assert_ulps(got: Tensor, want: Tensor, max_ulps: int, max_fraction: float = 1.0, what: str = "") -> None:
    d = ulps(got, want)
    frac = (d > 0).float().mean().item() if d.numel() else 0.0
    assert d.numel() == 0 or d.max().item() <= max_ulps, f"{what}: {d.max().item()} ulps (limit {max_ulps})"
    assert frac <= max_fraction, f"{what}: {frac:.2%} of values differ (limit {max_fraction:.2%})"


def assert_same_routing(weights: Tensor, ids: Tensor, logits: Tensor, bias: Tensor, k: int, renorm: bool) -> None:
    """ids equal to the reference's up to ties (the same score at every rank), weights within fp32 noise."""
    w_ref, ids_ref = route_topk_reference(logits, bias, k, renorm)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == ids_ref.shape
    z = logits.float() + bias
    assert torch.equal(z.gather(1, ids), z.gather(1, ids_ref)), "different experts picked"
    assert all(len(set(row)) == k for row in ids.tolist()), "an expert picked twice"
    torch.testing.assert_close(weights, w_ref, rtol=1e-5, atol=1e-7)  # exp and division of another libm


# ---------------------------------------------------------------------------------------------- checks
# Shared by the interpreter run (CPU tensors, exact=False: numpy's exp/cos/sin, not libdevice's) and the
# CUDA tests (exact=True: every kernel that emulates torch's rounding order must give the same bits).

_NORM_SHAPES = [(3, 200), (2, 3, 24), (1, 2048), (5, 33)]
_ROUTE_CASES = [(5, 60, 4, False), (3, 7, 3, True), (4, 130, 8, True), (2, 1, 1, False)]  # T, E, k, renormalize
_ACT_SHAPES = [(3, 1500), (1, 7), (2, 3, 33)]
_ROPE_CASES = [(5, 3, 1, 20, 1e4), (3, 4, 2, 128, 1e6)]  # T, Hq, Hkv, D, theta


def norm_limits(dtype: torch.dtype) -> tuple[int, float]:
    """(max ulps, max fraction differing) of an RMSNorm output against the reference: the sum of squares in
    another order moves rsqrt by an fp32 ulp or two; in bf16 that rarely crosses a rounding boundary of
    the normalised value, and the weight multiply can make that one ulp two."""
    return (8, 1.0) if dtype == torch.float32 else (2, 0.01)


def check_rms_norm(norm: Callable, add_norm: Callable, gated: Callable, device: str,
                   shapes: list[tuple[int, ...]]) -> None:
    for dtype in DTYPES:
        for i, shape in enumerate(shapes):
            x, res = randn(shape, dtype, device, i), randn(shape, dtype, device, 100 + i)
            w = (1 + randn(shape[-1:], torch.float32, device, 200 + i, 0.1)).to(dtype)
            what = f"{dtype} {shape}"
            assert_ulps(norm(x, w, EPS), rms_norm_reference(x, w, EPS), *norm_limits(dtype), what)
            out, s = add_norm(x, res, w, EPS)
            out_ref, s_ref = fused_add_rms_norm_reference(x, res, w, EPS)
            assert torch.equal(s, s_ref), f"{what}: residual sum differs"
            assert_ulps(out, out_ref, *norm_limits(dtype), what)
            # zero-centred (Qwen3.5, Qwen3-Next): weights around 0, x / rms(x) * (1 + w) in fp32, one rounding
            w0 = randn(shape[-1:], torch.float32, device, 300 + i, 0.1).to(dtype)
            got = norm(x, w0, EPS, zero_centred=True)
            assert got.dtype == dtype, what
            assert_ulps(got, rms_norm_reference(x, w0, EPS, zero_centred=True), *norm_limits(dtype), what + " zc")
            out, s = add_norm(x, res, w0, EPS, zero_centred=True)
            out_ref, s_ref = fused_add_rms_norm_reference(x, res, w0, EPS, zero_centred=True)
            assert torch.equal(s, s_ref) and out.dtype == dtype, f"{what} zc: residual sum differs"
            assert_ulps(out, out_ref, *norm_limits(dtype), what + " zc add")
            # gated (a DeltaNet head's output norm): w * norm(x) * silu(z), w in x's dtype
            z, wg = randn(shape, dtype, device, 400 + i, 2.0), (1 + randn(shape[-1:], torch.float32, device, 500 + i,
                                                                         0.1)).to(dtype)
            got = gated(x, z, wg, EPS)
            assert got.dtype == dtype, what
            assert_ulps(got, rms_norm_gated_reference(x, z, wg, EPS), *norm_limits(dtype), what + " gated")
    # Rows of a wider tensor, read in place; an fp32 weight on bf16 rows gives fp32 out (torch's promotion),
    # so a rare bf16 flip of the normalised value shows as a bf16-sized difference.
    wide = randn((6, 300), torch.bfloat16, device, 7)
    x, w = wide[:, 50:250], 1 + randn((200,), torch.float32, device, 8, 0.1)
    got, want = norm(x, w, EPS), rms_norm_reference(x, w, EPS)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-5)
    assert (got != want).float().mean().item() <= 0.01


def check_route(route: Callable, device: str) -> None:
    for dtype in DTYPES:
        for i, (T, E, k, renorm) in enumerate(_ROUTE_CASES):
            logits, bias = randn((T, E), dtype, device, i, 2.0), randn((E,), torch.float32, device, 50 + i, 0.5)
            weights, ids = route(logits, bias, k, renorm)
            assert_same_routing(weights, ids, logits, bias, k, renorm)
    # Ties go to the lowest expert id; a -inf logit is still picked after every finite one.
    zeros = torch.zeros(2, 8, device=device)
    assert route(zeros, torch.zeros(8, device=device), 3, False)[1].tolist() == [[0, 1, 2]] * 2
    logits = torch.tensor([[float("-inf")] * 5 + [0.0, float("-inf"), 1.0]], device=device)
    weights, ids = route(logits, torch.zeros(8, device=device), 3, False)
    assert ids.tolist() == [[7, 5, 0]] and weights[0, 2].item() == 0.0


def assert_libm_close(got: Tensor, want: Tensor, exact: bool, what: str) -> None:
    """exact: the same bits. Else (numpy's exp against torch's): fp32 within a few ulps' worth of tolerance,
    bf16 nearly always the same bits (an fp32 ulp rarely crosses a bf16 rounding boundary)."""
    if exact:
        assert_ulps(got, want, 0, 0.0, what)
        return
    bf16 = got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1.6e-2 if bf16 else 1e-5, atol=1e-2 if bf16 else 1e-6, msg=what)
    assert (ulps(got, want) > 0).float().mean().item() <= (0.01 if bf16 else 1.0), what


def check_activations(silu_mul: Callable, combine: Callable, device: str, exact: bool) -> None:
    for dtype in DTYPES:
        for i, shape in enumerate(_ACT_SHAPES):
            gate, up = randn(shape, dtype, device, i, 3.0), randn(shape, dtype, device, 10 + i)
            assert_libm_close(silu_mul(gate, up), silu_and_mul_reference(gate, up), exact, f"silu {dtype} {shape}")
            g = randn((*shape[:-1], 1), dtype, device, 20 + i, 3.0)
            got, want = combine(g, gate, up), sigmoid_mul_add_reference(g, gate, up)
            assert_libm_close(got, want, exact, f"combine {dtype} {shape}")
        wide = randn((4, 100), dtype, device, 9)
        gate, up = wide[:, 3:40], wide[:, 50:87]  # strided rows, as a [T, 2F] gate_up split would give
        assert_libm_close(silu_mul(gate, up), silu_and_mul_reference(gate, up), exact, "strided silu")


def check_rotary(cos_sin: Callable, rotate_qk: Callable, device: str, exact: bool) -> None:
    for dtype in DTYPES:
        for i, (T, hq, hkv, D, theta) in enumerate(_ROPE_CASES):
            positions = torch.tensor([0, 1, 17, 4095, 32767, 3, 1000][:T], device=device)
            inv_freq = RotaryEmbedding(D, theta).inv_freq(positions.device)
            cos, sin = cos_sin(positions, inv_freq, dtype)
            cos_ref, sin_ref = cos_sin_reference(positions, inv_freq, dtype)
            assert_libm_close(cos, cos_ref, exact, f"cos {dtype} D={D}")
            assert_libm_close(sin, sin_ref, exact, f"sin {dtype} D={D}")
            # q and k as views of one qkv projection (strided tokens), rotated with the reference cos/sin.
            qkv = randn((T, (hq + 2 * hkv) * D), dtype, device, i)
            q = qkv[:, : hq * D].view(T, hq, D)
            k = qkv[:, hq * D : (hq + hkv) * D].view(T, hkv, D)
            q_rot, k_rot = rotate_qk(q, k, cos_ref, sin_ref)
            assert torch.equal(q_rot, apply_rotary(q, cos_ref, sin_ref)), f"q {dtype} {(T, hq, hkv, D)}"
            assert torch.equal(k_rot, apply_rotary(k, cos_ref, sin_ref)), f"k {dtype} {(T, hq, hkv, D)}"


def check_rotary_write_kv(fn: Callable, device: str) -> None:
    """q rotated and k (rotated), v in their slots as apply_rotary + write_kv_reference give them, bit for bit; a
    slot < 0 writes nothing, the other slots' pages are untouched."""
    for dtype in DTYPES:
        for i, (T, hq, hkv, D, theta) in enumerate(_ROPE_CASES):
            positions = torch.tensor([0, 1, 17, 4095, 32767, 3, 1000][:T], device=device)
            cos, sin = cos_sin_reference(positions, RotaryEmbedding(D, theta).inv_freq(positions.device), dtype)
            qkv = randn((T, (hq + 2 * hkv) * D), dtype, device, i)
            q, k, v = (t.view(T, -1, D) for t in qkv.split([hq * D, hkv * D, hkv * D], dim=-1))
            pages, block = 5, 4
            slots = torch.randperm(pages * block, generator=torch.Generator().manual_seed(i))[:T].to(device)
            slots[0] = -1  # a padding row
            cache = randn((pages, 2, block, hkv, D), dtype, device, 100 + i)
            want_cache = cache.clone()
            want_q = rotary_write_kv_reference(q, k, v, cos, sin, want_cache, slots)
            got_q = fn(q, k, v, cos, sin, cache, slots)
            assert torch.equal(got_q, want_q) and torch.equal(got_q, apply_rotary(q, cos, sin)), f"q {dtype} {i}"
            assert torch.equal(cache, want_cache), f"kv cache {dtype} {(T, hq, hkv, D)}"


# ---------------------------------------------------------------------------------------------- CPU


def test_cpu_dispatch_is_the_reference() -> None:
    x, res = randn((3, 40), torch.bfloat16, "cpu", 0), randn((3, 40), torch.bfloat16, "cpu", 1)
    w = randn((40,), torch.bfloat16, "cpu", 2)
    assert torch.equal(rms_norm(x, w, EPS), rms_norm_reference(x, w, EPS))
    assert torch.equal(rms_norm_gated(x, res, w, EPS), rms_norm_gated_reference(x, res, w, EPS))
    for a, b in zip(fused_add_rms_norm(x, res, w, EPS), fused_add_rms_norm_reference(x, res, w, EPS), strict=True):
        assert torch.equal(a, b)
    logits = randn((4, 9), torch.bfloat16, "cpu", 3)
    for a, b in zip(route_topk(logits, torch.zeros(9), 2, True), route_topk_reference(logits, torch.zeros(9), 2, True),
                    strict=True):
        assert torch.equal(a, b)
    assert torch.equal(silu_and_mul(x, res), silu_and_mul_reference(x, res))
    g = randn((3, 1), torch.bfloat16, "cpu", 4)
    assert torch.equal(sigmoid_mul_add(g, x, res), sigmoid_mul_add_reference(g, x, res))
    q, k = randn((3, 2, 8), torch.bfloat16, "cpu", 5), randn((3, 1, 8), torch.bfloat16, "cpu", 6)
    cos, sin = RotaryEmbedding(8, 1e4).cos_sin(torch.tensor([0, 4, 9]), torch.bfloat16)
    q_rot, k_rot = apply_rotary_qk(q, k, cos, sin)
    assert torch.equal(q_rot, apply_rotary(q, cos, sin)) and torch.equal(k_rot, apply_rotary(k, cos, sin))
    check_rotary_write_kv(rotary_write_kv, "cpu")


def unfused_forward(model: torch.nn.Module, batch: object) -> Tensor:
    """The decoder as written before the residual adds moved into the norms: h = h + f(norm(h))."""
    h = model.model.embed_tokens(batch.input_ids)
    cos, sin = model.rotary.cos_sin(batch.positions, h.dtype)
    for layer in model.model.layers:
        h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, model.kv_cache, batch)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.model.norm(h)


def run_both_layouts(ckpt: Path, dtype: torch.dtype, device: str) -> tuple[Tensor, Tensor]:
    """Hidden states of the fused-residual decoder and of `unfused_forward` on the same prefill + decode."""
    from test_models_parity import PagedModel

    pm = PagedModel(ckpt, dtype=dtype, device=device)
    seen: dict[str, list[Tensor]] = {"fused": [], "unfused": []}
    forward = pm.model.forward

    def both(batch: object) -> Tensor:  # the K/V writes repeat the same values: harmless
        seen["fused"].append(forward(batch))
        seen["unfused"].append(unfused_forward(pm.model, batch))
        return seen["fused"][-1]

    pm.model.forward = both
    out = pm.step([(0, list(range(3, 20))), (1, list(range(40, 45)))])
    pm.step([(0, [int(out[0][-1].argmax())]), (1, [int(out[1][-1].argmax())])])
    return torch.cat(seen["fused"]), torch.cat(seen["unfused"])


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "olmoe", "mixtral"])
def test_fused_residual_layout_is_bit_exact_in_bf16(parity_checkpoints: dict[str, Path], arch: str) -> None:
    # Moving each residual add into the next norm must not move a single rounding.
    fused, unfused = run_both_layouts(parity_checkpoints[arch], torch.bfloat16, "cpu")
    assert torch.equal(fused, unfused)


# ---------------------------------------------------------------------------------------------- interpreter

# Triton's interpreter reads TRITON_INTERPRET when triton is imported: run it in a fresh process.
_INTERPRET_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from rimuru.kernels.activation import sigmoid_mul_add_triton, silu_and_mul_triton
    from rimuru.kernels.rmsnorm import fused_add_rms_norm_triton, rms_norm_gated_triton, rms_norm_triton
    from rimuru.kernels.rotary import apply_rotary_qk_triton, cos_sin_triton, rotary_write_kv_triton
    from rimuru.kernels.router import route_topk_triton
    import test_fused_small_kernels as t
    t.check_rms_norm(rms_norm_triton, fused_add_rms_norm_triton, rms_norm_gated_triton, "cpu", t._NORM_SHAPES)
    t.check_route(route_topk_triton, "cpu")
    t.check_activations(silu_and_mul_triton, sigmoid_mul_add_triton, "cpu", exact=False)
    t.check_rotary(cos_sin_triton, apply_rotary_qk_triton, "cpu", exact=False)
    t.check_rotary_write_kv(rotary_write_kv_triton, "cpu")
    print("ok")
    """
)


def test_triton_interpreter_matches_reference() -> None:
    pytest.importorskip("triton")
    run_under_interpreter(_INTERPRET_SCRIPT.format(tests=str(REPO / "tests")))


# ---------------------------------------------------------------------------------------------- GPU

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
_GPU_TOKENS = (1, 7, 256, 4096)


@pytest.mark.gpu
@cuda
def test_cuda_kernels_match_reference() -> None:
    # The public functions on CUDA tensors take the Triton path; exact=True: libdevice's expf/cosf/sinf and
    # IEEE division are what torch's kernels use, so everything but the RMSNorm reduction is bit-exact.
    check_rms_norm(rms_norm, fused_add_rms_norm, rms_norm_gated, "cuda", _NORM_SHAPES)
    check_route(route_topk, "cuda")
    check_activations(silu_and_mul, sigmoid_mul_add, "cuda", exact=True)
    check_rotary(rotary.cos_sin_triton, apply_rotary_qk, "cuda", exact=True)
    check_rotary_write_kv(rotary_write_kv, "cuda")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("T", _GPU_TOKENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_model_shapes(T: int, dtype: torch.dtype) -> None:
    # Qwen1.5-MoE (d 2048, 16 x 128 heads, 60 experts top-4, shared expert 5632), Qwen3 (32 q / 4 kv heads,
    # 128 experts top-8, per-head norms) and DeepSeek-V3's width (7168, 256 experts).
    for d in (2048, 7168):
        x, res = randn((T, d), dtype, "cuda", T), randn((T, d), dtype, "cuda", T + 1)
        w = (1 + randn((d,), torch.float32, "cuda", 2, 0.1)).to(dtype)
        out, s = fused_add_rms_norm(x, res, w, EPS)
        out_ref, s_ref = fused_add_rms_norm_reference(x, res, w, EPS)
        assert torch.equal(s, s_ref)
        assert_ulps(out, out_ref, *norm_limits(dtype), f"add_norm d={d}")
    heads = randn((T, 32, 128), dtype, "cuda", 3)
    w = (1 + randn((128,), torch.float32, "cuda", 4, 0.1)).to(dtype)
    assert_ulps(rms_norm(heads, w, EPS), rms_norm_reference(heads, w, EPS), *norm_limits(dtype), "per-head norm")
    # Qwen3.5's zero-centred norms: the residual add and norm at d 2048, its q/k norms over heads of 256
    x, res = randn((T, 2048), dtype, "cuda", T + 2), randn((T, 2048), dtype, "cuda", T + 3)
    w0 = randn((2048,), torch.float32, "cuda", 5, 0.1).to(dtype)
    out, s = fused_add_rms_norm(x, res, w0, EPS, zero_centred=True)
    out_ref, s_ref = fused_add_rms_norm_reference(x, res, w0, EPS, zero_centred=True)
    assert torch.equal(s, s_ref)
    assert_ulps(out, out_ref, *norm_limits(dtype), "zero-centred add_norm")
    heads, w0 = randn((T, 16, 256), dtype, "cuda", 6), randn((256,), torch.float32, "cuda", 7, 0.1).to(dtype)
    assert_ulps(rms_norm(heads, w0, EPS, zero_centred=True), rms_norm_reference(heads, w0, EPS, zero_centred=True),
                *norm_limits(dtype), "zero-centred per-head norm")
    # its gated DeltaNet heads' output norm: [T, 32, 128] rows with their gate
    o, z = randn((T, 32, 128), dtype, "cuda", 8), randn((T, 32, 128), dtype, "cuda", 9, 2.0)
    wg = (1 + randn((128,), torch.float32, "cuda", 10, 0.1)).to(dtype)
    assert_ulps(rms_norm_gated(o, z, wg, EPS), rms_norm_gated_reference(o, z, wg, EPS), *norm_limits(dtype),
                "gated norm")
    for E, k, renorm in ((60, 4, False), (128, 8, True), (256, 8, True)):
        logits, bias = randn((T, E), dtype, "cuda", E), randn((E,), torch.float32, "cuda", E + 1, 0.5)
        assert_same_routing(*route_topk(logits, bias, k, renorm), logits, bias, k, renorm)
    for f in (5632, 1408):
        gate, up = randn((T, f), dtype, "cuda", f, 3.0), randn((T, f), dtype, "cuda", f + 1)
        assert torch.equal(silu_and_mul(gate, up), silu_and_mul_reference(gate, up))
    g, shared, routed = randn((T, 1), dtype, "cuda", 5, 3.0), randn((T, 2048), dtype, "cuda", 6), randn(
        (T, 2048), dtype, "cuda", 7)
    assert torch.equal(sigmoid_mul_add(g, shared, routed), sigmoid_mul_add_reference(g, shared, routed))
    positions = torch.randint(0, 32768, (T,), device="cuda")
    for hq, hkv, theta in ((16, 16, 1e6), (32, 4, 1e6), (16, 16, 1e4)):
        rope = RotaryEmbedding(128, theta)
        cos, sin = rope.cos_sin(positions, dtype)  # CUDA: the Triton kernel
        cos_ref, sin_ref = cos_sin_reference(positions, rope.inv_freq(positions.device), dtype)
        assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)
        qkv = randn((T, (hq + 2 * hkv) * 128), dtype, "cuda", hq)
        q, k = qkv[:, : hq * 128].view(T, hq, 128), qkv[:, hq * 128 : (hq + hkv) * 128].view(T, hkv, 128)
        q_rot, k_rot = apply_rotary_qk(q, k, cos, sin)
        assert torch.equal(q_rot, apply_rotary(q, cos, sin)) and torch.equal(k_rot, apply_rotary(k, cos, sin))
        v = qkv[:, (hq + hkv) * 128 :].view(T, hkv, 128)
        cache = torch.zeros(T // 16 + 2, 2, 16, hkv, 128, dtype=dtype, device="cuda")
        slots = torch.randperm(cache.shape[0] * 16, device="cuda")[:T]
        want_cache = cache.clone()
        want_q = rotary_write_kv_reference(q, k, v, cos, sin, want_cache, slots)
        assert torch.equal(rotary_write_kv(q, k, v, cos, sin, cache, slots), want_q) and torch.equal(cache, want_cache)


@pytest.mark.gpu
@cuda
def test_cuda_graph_replay_with_new_inputs() -> None:
    # Every kernel inside one captured graph, replayed after the inputs are refilled: no host sync, nothing
    # read at capture time.
    T, d, E = 16, 2048, 60

    def make(seed: int) -> list[Tensor]:
        return [randn((T, d), torch.bfloat16, "cuda", seed), randn((T, d), torch.bfloat16, "cuda", seed + 1),
                randn((T, E), torch.bfloat16, "cuda", seed + 2), randn((T, 1), torch.bfloat16, "cuda", seed + 3),
                torch.randint(0, 4096, (T,), device="cuda"),
                randn((T, 24, 128), torch.bfloat16, "cuda", seed + 4)]

    w, bias, rope = torch.ones(d, dtype=torch.bfloat16, device="cuda"), torch.zeros(E, device="cuda"), RotaryEmbedding(
        128, 1e6)

    def ops(x: Tensor, res: Tensor, logits: Tensor, g: Tensor, pos: Tensor, qkv: Tensor) -> list[Tensor]:
        normed, s = fused_add_rms_norm(x, res, w, EPS)
        weights, ids = route_topk(logits, bias, 4, False)
        cos, sin = rope.cos_sin(pos, torch.bfloat16)
        q, k = apply_rotary_qk(qkv[:, :16], qkv[:, 16:20], cos, sin)
        return [normed, s, rms_norm(x, w, EPS), weights, ids, silu_and_mul(x, res), sigmoid_mul_add(g, x, res),
                cos, sin, q, k]

    static = make(0)
    stream = torch.cuda.Stream()  # compile and warm the allocator outside the graph
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = ops(*static)
    for seed in (10, 20):
        for dst, src in zip(static, make(seed), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, ops(*static), strict=True):
            assert torch.equal(got, want)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "olmoe", "mixtral"])
def test_cuda_model_with_and_without_small_kernels(
    parity_checkpoints: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The whole bf16 model on CUDA: small kernels on vs every one of them replaced by its torch reference
    # (dispatch sees no Triton). Only the RMSNorm reduction order differs, so the logits must agree to
    # bf16 noise; the fused residual layout itself is checked bit for bit against the unfused one.
    fused, unfused = run_both_layouts(parity_checkpoints[arch], torch.bfloat16, "cuda")
    for module in (activation, rmsnorm, router, rotary):
        monkeypatch.setattr(module, "triton", None)
    torch_path, _ = run_both_layouts(parity_checkpoints[arch], torch.bfloat16, "cuda")
    monkeypatch.undo()
    assert torch.equal(fused, unfused)
    assert torch.isfinite(fused).all()
    err = (fused.float() - torch_path.float()).abs().mean().item()
    assert err < 0.02 * torch_path.float().std().item(), f"{arch}: mean abs difference {err:.3g}"
