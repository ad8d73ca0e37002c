"""Gated DeltaNet prefill through flash-linear-attention on the GPU against the layer's own torch chunk form.

The fla path (kernels/fla_gated_delta.py) takes bf16/fp16 CUDA prefill only; everything else, the CPU included,
runs the torch form and never imports fla. On a GPU with fla-core installed, a varlen batch (fresh sequences and
sequences continuing from a state, lengths across chunk boundaries) gives the torch form's outputs and final
states within bf16 tolerance.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from rimuru.kernels import fla_gated_delta
from rimuru.models.gated_deltanet import GatedDeltaNet


def make_layer(seed: int, hidden: int, Hk: int, Hv: int, dk: int, dv: int) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(hidden, Hk, Hv, dk, dv, conv_kernel=4, eps=1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
        layer.A_log.uniform_(-1.0, 0.5)
        layer.dt_bias.normal_(0.0, 0.5)
    return layer.eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def test_the_cpu_never_takes_or_imports_fla() -> None:
    layer = make_layer(0, hidden=32, Hk=2, Hv=4, dk=8, dv=8).bfloat16()
    x = torch.randn(7, 32).bfloat16()
    assert not fla_gated_delta.fla_chunk_applies(x)
    qsl = torch.tensor([0, 3, 7], dtype=torch.int32)
    conv0, ssm0 = torch.zeros(2, layer.conv_dim, 3).bfloat16(), torch.zeros(2, 4, 8, 8)
    with torch.no_grad():
        layer(x, qsl, conv0, ssm0, torch.tensor([False, False]))
    assert "fla" not in sys.modules


def test_fla_is_handed_aligned_contiguous_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill's rows after d decode rows are slices d rows in: with 4 value heads in bf16, beta[1:] starts 8 bytes
    off a 16-byte boundary. fla's kernels would build a variant per alignment pattern, so the wrapper hands them
    aligned contiguous copies of such slices, the same values, and aligned tensors themselves (no copy)."""
    seen: dict[str, torch.Tensor] = {}

    def recording_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                        use_qk_l2norm_in_kernel):
        seen.update(q=q, k=k, v=v, g=g, beta=beta)
        return torch.zeros_like(v), initial_state.clone()

    monkeypatch.setattr(fla_gated_delta, "_fla_chunk", lambda: recording_chunk)
    T, H, dk, dv, d = 9, 4, 8, 8, 1
    q, k = torch.randn(T, H, dk).bfloat16(), torch.randn(T, H, dk).bfloat16()
    v = torch.randn(T + d, 2 * H * dv).bfloat16()[d:, H * dv:].reshape(T, H, dv)  # a strided view, like the conv's
    g_all, beta_all = -torch.rand(T + d, H), torch.rand(T + d, H).bfloat16()
    g, beta = g_all[d:], beta_all[d:]
    assert beta.data_ptr() % 16 != 0 and g.data_ptr() % 16 == 0
    state, cu = torch.zeros(2, H, dk, dv), torch.tensor([0, 4, T])
    fla_gated_delta.fla_chunk_gated_delta_rule(q, k, v, g, beta, state, cu, scale=dk**-0.5)
    for name, given in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        handed = seen[name][0]
        assert handed.is_contiguous() and handed.data_ptr() % 16 == 0, name
        torch.testing.assert_close(handed, given, rtol=0, atol=0)
    assert seen["q"][0].data_ptr() == q.data_ptr() and seen["g"][0].data_ptr() == g.data_ptr()  # no copy needed
    assert seen["beta"][0].data_ptr() != beta.data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core")
def test_cuda_fla_prefill_equals_the_torch_chunk_form(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = make_layer(1, hidden=512, Hk=2, Hv=4, dk=128, dv=128).cuda().bfloat16()
    (C, Km1), (Hv, dk, dv) = layer.state_shapes()
    lens = [1, 63, 64, 65, 200]  # across the 64-token chunk boundaries
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    T, B = sum(lens), len(lens)
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(T, 512, device="cuda", generator=g).bfloat16()
    has_state = torch.tensor([False, True, False, True, True], device="cuda")
    ssm0 = torch.randn(B, Hv, dk, dv, device="cuda", generator=g) * 0.05
    conv0 = torch.randn(B, C, Km1, device="cuda", generator=g).bfloat16()
    ssm0[~has_state] = float("nan")  # a fresh sequence's pages hold garbage: it must be selected away
    assert fla_gated_delta.fla_chunk_applies(x)
    with torch.no_grad():
        got, conv_got, ssm_got = layer(x, qsl, conv0, ssm0, has_state)
        monkeypatch.setattr("rimuru.models.gated_deltanet.fla_chunk_applies", lambda x: False)
        want, conv_want, ssm_want = layer(x, qsl, conv0, ssm0, has_state)
    assert torch.isfinite(got).all() and torch.isfinite(ssm_got).all()
    assert _rel(got, want) < 3e-2
    assert _rel(ssm_got, ssm_want) < 3e-2
    assert torch.equal(conv_got, conv_want)  # the conv runs the same torch code on both paths


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="needs CUDA and fla-core")
def test_cuda_fla_window_in_a_cuda_graph_equals_the_varlen_prefill() -> None:
    """The single-prefill graphs' form (GatedDeltaNet.window_core: one sequence in a window of W rows, zeros and
    beta = g = 0 past it, fla's fixed-length path) captured once in a CUDA graph and replayed for sequences of
    several lengths, continued and fresh: the outputs, final conv and recurrent states of fla's varlen path on the
    sequence alone, within bf16 tolerance (the conv equal)."""
    layer = make_layer(3, hidden=512, Hk=2, Hv=4, dk=128, dv=128).cuda().bfloat16()
    (C, Km1), (Hv, dk, dv) = layer.state_shapes()
    W = 256
    gen = torch.Generator(device="cuda").manual_seed(4)
    x_all = torch.randn(W, 512, device="cuda", generator=gen).bfloat16()
    # the graph's static inputs
    mixed_w = torch.zeros(W, C, device="cuda", dtype=torch.bfloat16)
    g_w = torch.zeros(W, Hv, device="cuda")
    beta_w = torch.zeros(W, Hv, device="cuda", dtype=torch.bfloat16)
    conv0 = torch.zeros(1, C, Km1, device="cuda", dtype=torch.bfloat16)
    state0 = torch.zeros(1, Hv, dk, dv, device="cuda")
    length = torch.zeros(1, dtype=torch.int64, device="cuda")
    assert fla_gated_delta.fla_chunk_applies(mixed_w)
    with torch.no_grad():
        for _ in range(2):  # compiles and autotunes fla's kernels before the capture
            layer.window_core(mixed_w, g_w, beta_w, conv0, state0, length)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer.window_core(mixed_w, g_w, beta_w, conv0, state0, length)
        for n, fresh in ((200, False), (65, True), (7, False), (W, False)):
            mixed, g, beta = layer.project(x_all[:n])
            c0 = torch.zeros(1, C, Km1, device="cuda", dtype=torch.bfloat16) if fresh else \
                torch.randn(1, C, Km1, device="cuda", generator=gen).bfloat16()
            s0 = torch.zeros(1, Hv, dk, dv, device="cuda") if fresh else \
                torch.randn(1, Hv, dk, dv, device="cuda", generator=gen) * 0.05
            qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
            want, conv_want, ssm_want = layer.varlen_core(mixed, g, beta, c0, s0, qsl, n)
            for buf, t in ((mixed_w, mixed), (g_w, g), (beta_w, beta)):
                buf.zero_()
                buf[:n].copy_(t)
            conv0.copy_(c0)
            state0.copy_(s0)
            length.fill_(n)
            graph.replay()
            got, conv_got, ssm_got = out
            assert torch.isfinite(got[:n]).all() and torch.isfinite(ssm_got).all()
            assert _rel(got[:n], want) < 3e-2, n
            assert _rel(ssm_got, ssm_want) < 3e-2, n
            assert torch.equal(conv_got, conv_want), n
