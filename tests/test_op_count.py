"""The pass counter (rimuru/testing/op_count.py): what it calls a launch, a view, a host sync, a kernel's launches."""

from __future__ import annotations

import torch

from rimuru.testing.op_count import OpCounter, box_kernels, fla_packed_reference


def test_launches_views_and_syncs_are_told_apart() -> None:
    x = torch.randn(6, 4)
    counter = OpCounter()
    with torch.inference_mode(), counter.counting():
        with counter.region("a"):
            y = x * 2  # launch
            _ = y[:, :2].transpose(0, 1)  # views
            _ = y.float()  # same dtype: a view
            _ = y.to(torch.bfloat16)  # a cast: a launch
        with counter.region("b"):
            _ = y[y > 0]  # the compare launches; the boolean mask syncs
            _ = int(y.sum())  # item
            _ = y.tolist()
            _ = torch.arange(3).repeat_interleave(torch.tensor([1, 2, 0]))  # tensor repeats
            _ = torch.arange(3).repeat_interleave(2)  # int repeats: no sync
    a, b = counter.regions["a"], counter.regions["b"]
    assert (a.launches, a.syncs) == (2, 0) and a.views >= 3 and a.entries == 1
    assert b.syncs == 4, b.sync_sites
    assert set(b.sync_sites) == {"index.Tensor", "item.default", "tolist", "repeat_interleave.self_Tensor"}
    assert b.h2d == 1  # torch.tensor of host data


def test_kernels_count_as_their_gpu_launches_and_fla_syncs_per_new_cu_seqlens() -> None:
    from rimuru.models import layers, moe

    counter = OpCounter()
    x, w = torch.randn(5, 8), torch.ones(8)
    with torch.inference_mode(), box_kernels(counter, emulate_fla=True), counter.counting():
        layers.rms_norm(x, w, 1e-6)  # one launch, the reference's ops uncounted
        weights, ids = moe.route_topk(torch.randn(5, 16), torch.zeros(16), 2, True)
        cu = torch.tensor([0, 3, 5], dtype=torch.int64)
        for _ in range(3):  # the same int64 tensor: fla's cache builds its chunk indices once
            counter.fla_call(cu)
        counter.fla_call(cu.int())  # int32: the wrapper's cast makes a new object each call
    c = counter.regions["other"]
    assert c.kernel_calls == 6 and c.ops["rms_norm"] == 1 and c.ops["route_topk"] == 1
    assert c.sync_sites["fla_chunk_gated_delta_rule"] == 4  # two chunk sizes, twice
    assert layers.rms_norm.__name__ == "rms_norm"  # unpatched after the block


def test_fla_stand_in_is_the_chunk_form_per_sequence() -> None:
    from rimuru.models.gated_deltanet import chunk_gated_delta_rule, l2_normalize

    g = torch.Generator().manual_seed(0)
    T, H, dk, dv = 9, 2, 4, 3
    q, k = torch.randn(T, H, dk, generator=g), torch.randn(T, H, dk, generator=g)
    v = torch.randn(T, H, dv, generator=g)
    gate, beta = -torch.rand(T, H, generator=g), torch.rand(T, H, generator=g)
    state = torch.randn(2, H, dk, dv, generator=g)
    o, final = fla_packed_reference(q, k, v, gate, beta, state, torch.tensor([0, 4, 9]), scale=0.5)
    hm = lambda t: t[4:].transpose(0, 1)[None]  # noqa: E731 - the second sequence, head-major
    o1, s1 = chunk_gated_delta_rule(l2_normalize(hm(q)) * 0.5, l2_normalize(hm(k)), hm(v), hm(gate), hm(beta),
                                    state[1:])
    torch.testing.assert_close(o[4:], o1[0].transpose(0, 1))
    torch.testing.assert_close(final[1:], s1)
