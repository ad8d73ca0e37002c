"""Paged fused MoE: reference vs dense float64, Triton (interpreter on CPU, and CUDA) vs reference."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import Tensor

from rimuru.kernels.fused_moe import fused_moe, fused_moe_reference
from rimuru.kernels.moe_align import moe_align_torch
from rimuru.testing.triton_interpreter import run_under_interpreter

REPO = Path(__file__).resolve().parents[1]


def make_case(
    T: int, d: int, f: int, E: int, k: int, absent: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Random hidden/routing and a pool whose pages are shuffled, with `absent` experts at -1 (never routed)."""
    g = torch.Generator().manual_seed(seed)
    num_pages = 3 * E + 7  # spare pages that no expert owns
    view = (torch.randn(num_pages, f * d, generator=g) / d**0.5).to(dtype)
    table = torch.randperm(num_pages, generator=g)[: 3 * E].view(E, 3).to(torch.int32)
    gone = torch.randperm(E, generator=g)[:absent]
    table[gone] = -1
    present = torch.tensor([e for e in range(E) if e not in set(gone.tolist())])
    # Route to a random subset of the present experts so some present experts get zero tokens.
    pick = present[torch.randperm(len(present), generator=g)[: max(k, (len(present) * 2) // 3)]]
    ids = torch.stack([pick[torch.randperm(len(pick), generator=g)[:k]] for _ in range(T)]) if T else None
    ids = ids if ids is not None else torch.empty(0, k, dtype=torch.int64)
    w = torch.rand(T, k, generator=g)
    w = w / w.sum(-1, keepdim=True)
    hidden = torch.randn(T, d, generator=g).to(dtype)
    return (hidden.to(device), w.to(device), ids.to(device), view.to(device), table.to(device))


def dense_float64(hidden: Tensor, w: Tensor, ids: Tensor, view: Tensor, table: Tensor, f: int) -> Tensor:
    T, d = hidden.shape
    out = torch.zeros(T, d, dtype=torch.float64)
    for t in range(T):
        h = hidden[t].double().cpu()
        for j in range(ids.shape[1]):
            p1, p3, p2 = table[ids[t, j]].tolist()
            w1, w3 = view[p1].double().cpu().view(f, d), view[p3].double().cpu().view(f, d)
            w2 = view[p2].double().cpu().view(d, f)
            out[t] += w[t, j].double().cpu() * (w2 @ (torch.nn.functional.silu(w1 @ h) * (w3 @ h)))
    return out


def contiguous_weights(view: Tensor, table: Tensor, f: int, d: int) -> tuple[Tensor, Tensor]:
    E = table.shape[0]
    w13 = torch.zeros(E, 2 * f, d, dtype=view.dtype, device=view.device)
    w2 = torch.zeros(E, d, f, dtype=view.dtype, device=view.device)
    for e in range(E):
        p1, p3, p2 = table[e].tolist()
        if p1 >= 0:
            w13[e, :f], w13[e, f:], w2[e] = view[p1].view(f, d), view[p3].view(f, d), view[p2].view(d, f)
    return w13, w2


def move_to_host_rows(view: Tensor, table: Tensor, experts: list[int],
                      pin: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's host rows [3E, f*d] (row 3e + j: matrix j of expert e, from its pages) and a table in which
    `experts` are named by their host rows instead of their pages; their pages are then poisoned with NaN, so a
    kernel that still read them would show it."""
    from rimuru.kernels.fused_moe import host_row_code

    E = table.shape[0]
    host = torch.zeros(3 * E, view.shape[1], dtype=view.dtype, pin_memory=pin)
    moved = table.clone()
    for e in experts:
        for j in range(3):
            host[3 * e + j].copy_(view[int(table[e, j])])
            moved[e, j] = host_row_code(e, j)
    poisoned = view.clone()
    for e in experts:
        poisoned[table[e].long()] = float("nan")
    return host, moved, poisoned


def rel_err(a: Tensor, b: Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize(
    "T,d,f,E,k,absent", [(1, 16, 8, 4, 1, 0), (5, 24, 40, 6, 2, 1), (9, 32, 16, 10, 8, 2), (0, 16, 8, 3, 2, 0)]
)
def test_reference_matches_dense_float64(T: int, d: int, f: int, E: int, k: int, absent: int) -> None:
    args = make_case(T, d, f, E, k, absent, torch.float64, "cpu", seed=T + d)
    out = fused_moe_reference(*args, f)
    assert out.dtype == torch.float64 and out.shape == (T, d)
    torch.testing.assert_close(out, dense_float64(*args, f), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fused_moe(*args, f), out)  # CPU dispatch is the reference


def test_reference_rejects_non_resident_expert() -> None:
    hidden, w, ids, view, table = make_case(3, 16, 8, 4, 2, 0, torch.float32, "cpu", seed=1)
    table[ids[0, 0]] = -1
    with pytest.raises(ValueError, match="not resident"):
        fused_moe_reference(hidden, w, ids, view, table, 8)


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_torch_layout(block_m: int) -> None:
    ids = torch.tensor([[3, 0], [3, 2], [0, 3], [3, 2]])  # expert 1 has no tokens
    a = moe_align_torch(ids, num_experts=5, block_m=block_m)
    counts = [2, 0, 2, 4, 0]
    padded = [-(-c // block_m) * block_m for c in counts]
    assert a.block_end.tolist() == torch.tensor(padded).cumsum(0).tolist()
    flat = ids.reshape(-1).tolist()
    for e in range(5):
        lo, hi = a.block_end[e].item() - padded[e], a.block_end[e].item()
        group = a.sorted_ids[lo:hi].tolist()
        assert sorted(x for x in group if x < 8) == [i for i, x in enumerate(flat) if x == e]
        assert group.count(8) == padded[e] - counts[e]
    assert (a.sorted_ids[a.block_end[-1] :] == 8).all()


def test_reference_reads_experts_named_by_host_rows() -> None:
    hidden, w, ids, view, table = make_case(9, 48, 24, 6, 2, 1, torch.float64, "cpu", seed=3)
    routed = sorted(set(ids.flatten().tolist()))
    host, moved, poisoned = move_to_host_rows(view, table, routed[:2])
    out = fused_moe_reference(hidden, w, ids, poisoned, moved, 24, host)
    assert torch.equal(out, fused_moe_reference(hidden, w, ids, view, table, 24))
    assert rel_err(out, dense_float64(hidden, w, ids, view, table, 24)) < 1e-12
    with pytest.raises(ValueError, match="not resident"):  # host codes mean nothing without the host rows
        fused_moe_reference(hidden, w, ids, poisoned, moved, 24)
    with pytest.raises(ValueError, match="host_rows"):
        fused_moe_reference(hidden, w, ids, poisoned, moved, 24, host[:, :-1])


# Triton's interpreter reads TRITON_INTERPRET when triton is imported: run it in a fresh process.
_INTERPRET_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import rimuru.kernels.moe_align as moe_align
    from rimuru.kernels.fused_moe import fused_moe_contiguous, fused_moe_reference, fused_moe_triton
    from test_fused_moe import contiguous_weights, make_case, rel_err
    # Rows per expert 0.5 .. 66: the first three tile configs; odd d/f exercise the K and N masks.
    cases = [(1, 64, 32, 4, 2, 1), (7, 96, 48, 6, 3, 0), (33, 64, 80, 5, 1, 1), (20, 32, 16, 12, 8, 2),
             (34, 40, 24, 2, 1, 0), (66, 32, 16, 1, 1, 0)]
    for force_chunked_align in (False, True):  # the single-program alignment, or the chunked one at any size
        moe_align.SINGLE_PROGRAM_MAX = 0 if force_chunked_align else 4096
        for i, (T, d, f, E, k, absent) in enumerate(cases):
            if force_chunked_align and i not in (1, 3):
                continue
            args = make_case(T, d, f, E, k, absent, torch.float32, "cpu", seed=i)
            ref = fused_moe_reference(*args, f)
            out = fused_moe_triton(*args, f)
            err = rel_err(out, ref)
            assert err < 1e-5, (T, d, f, E, k, err)
            w13, w2 = contiguous_weights(args[3], args[4], f, d)
            assert torch.equal(fused_moe_contiguous(*args[:3], w13, w2), out), (T, d, f, E, k)
    # Inputs as callers hand them over, read in place: hidden rows strided (a slice of a wider
    # tensor), int32 ids, an int64 table, float64 router weights.
    hidden, w, ids, view, table = make_case(9, 48, 24, 5, 2, 1, torch.float32, "cpu", seed=42)
    wide = torch.randn(9, 80)
    wide[:, 16:64] = hidden
    ref = fused_moe_reference(hidden, w, ids, view, table, 24)
    out = fused_moe_triton(wide[:, 16:64], w.double(), ids.int(), view, table.long(), 24)
    assert rel_err(out, ref) < 1e-5, rel_err(out, ref)
    # Experts read from the layer's host rows give the same numbers as from their pages (the same arithmetic).
    from test_fused_moe import move_to_host_rows
    hidden, w, ids, view, table = make_case(20, 32, 16, 12, 8, 2, torch.float32, "cpu", seed=7)
    routed = sorted(set(ids.flatten().tolist()))
    host, moved, poisoned = move_to_host_rows(view, table, routed[::2])
    out = fused_moe_triton(hidden, w, ids, poisoned, moved, 16, host)
    assert torch.equal(out, fused_moe_triton(hidden, w, ids, view, table, 16))
    # Routed experts whose rows are absent (-1: another rank holds them under expert parallelism) contribute zeros:
    # what the reference gives with skip_absent, i.e. the sum over the experts present alone
    hidden, w, ids, view, table = make_case(20, 32, 16, 12, 8, 0, torch.float32, "cpu", seed=8)
    elsewhere = table.clone()
    elsewhere[6:] = -1
    out = fused_moe_triton(hidden, w, ids, view, elsewhere, 16)
    assert rel_err(out, fused_moe_reference(hidden, w, ids, view, elsewhere, 16, skip_absent=True)) < 1e-5
    others = table.clone()
    others[:6] = -1
    both = out + fused_moe_triton(hidden, w, ids, view, others, 16)
    assert rel_err(both, fused_moe_triton(hidden, w, ids, view, table, 16)) < 1e-5
    # Both Triton alignments give the torch path's layout exactly (stable: an expert's assignments in index order),
    # across chunk edges, empty experts and an int32 input
    g = torch.Generator().manual_seed(3)
    for n, E, block_m in [(1, 5, 16), (1023, 60, 16), (1024, 128, 64), (1025, 7, 32), (3000, 60, 128),
                          (5000, 128, 16), (9001, 256, 64)]:
        ids = torch.randint(0, E, (n,), generator=g)
        ids[ids == 2] = 3  # expert 2 never routed to
        want = moe_align.moe_align_torch(ids.view(-1, 1), E, block_m)
        for limit in (4096, 0):
            moe_align.SINGLE_PROGRAM_MAX = limit
            if limit and n > limit:
                continue
            got = moe_align.moe_align(ids.int().view(-1, 1), E, block_m)
            assert got.max_blocks == want.max_blocks
            assert torch.equal(got.block_end, want.block_end), (n, E, block_m, limit)
            assert torch.equal(got.sorted_ids, want.sorted_ids), (n, E, block_m, limit)
    print("ok")
    """
)


def test_triton_interpreter_matches_reference() -> None:
    pytest.importorskip("triton")
    run_under_interpreter(_INTERPRET_SCRIPT.format(tests=str(REPO / "tests")))


# ---------------------------------------------------------------------------------------------- GPU

_GPU_SHAPES = [(2048, 1408, 60, 4), (2048, 768, 128, 8), (2048, 512, 256, 8), (96, 80, 9, 3), (272, 136, 17, 5)]
_GPU_TOKENS = [1, 2, 7, 16, 64, 255, 1024, 4096]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", _GPU_SHAPES, ids=lambda s: "d{}_f{}_E{}_k{}".format(*s))
@pytest.mark.parametrize("T", _GPU_TOKENS)
def test_cuda_paged_matches_reference(shape: tuple[int, int, int, int], T: int) -> None:
    from rimuru.kernels.fused_moe import fused_moe_contiguous

    d, f, E, k = shape
    absent = E // 5
    hidden, w, ids, view, table = make_case(T, d, f, E, k, absent, torch.bfloat16, "cuda", seed=T * 7 + d)
    ref = fused_moe_reference(hidden, w, ids, view, table, f)
    torch.cuda.synchronize()
    torch.cuda.memory.empty_cache()
    out = fused_moe(hidden, w, ids, view, table, f)  # CUDA dispatch -> Triton
    assert out.dtype == torch.bfloat16 and out.shape == (T, d)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2
    w13, w2 = contiguous_weights(view, table, f, d)
    assert torch.equal(fused_moe_contiguous(hidden, w, ids, w13, w2), out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 64, 1024])
def test_cuda_routed_experts_held_elsewhere_contribute_zeros(T: int) -> None:
    """Expert parallelism: a rank's table holds its half of the experts, -1 rows for the other rank's; the two
    ranks' outputs sum to the whole layer's (what the all-reduce does)."""
    d, f, E, k = 256, 128, 64, 8
    hidden, w, ids, view, table = make_case(T, d, f, E, k, 0, torch.bfloat16, "cuda", seed=T)
    halves = [table.clone(), table.clone()]
    halves[0][E // 2 :], halves[1][: E // 2] = -1, -1
    parts = [fused_moe(hidden, w, ids, view, half, f) for half in halves]
    for part, half in zip(parts, halves, strict=True):
        ref = fused_moe_reference(hidden, w, ids, view, half, f, skip_absent=True)
        assert rel_err(part, ref) < 1e-2
    assert rel_err(parts[0].float() + parts[1].float(), fused_moe(hidden, w, ids, view, table, f)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,E,block_m", [(4097, 60, 16), (16384, 128, 64), (32768, 256, 128), (40000, 60, 32)])
def test_cuda_chunked_alignment_equals_the_stable_sort(n: int, E: int, block_m: int) -> None:
    """Past SINGLE_PROGRAM_MAX assignments the three chunked launches give the stable sort's layout exactly."""
    from rimuru.kernels.moe_align import SINGLE_PROGRAM_MAX, moe_align

    assert n > SINGLE_PROGRAM_MAX
    g = torch.Generator(device="cuda").manual_seed(n)
    ids = torch.randint(0, E, (n // 4 + 1, 4), device="cuda", generator=g).reshape(-1)[:n].view(-1, 1)
    got, want = moe_align(ids, E, block_m), moe_align_torch(ids, E, block_m)
    assert got.max_blocks == want.max_blocks
    assert torch.equal(got.block_end, want.block_end) and torch.equal(got.sorted_ids, want.sorted_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 16, 300, 2048])
def test_cuda_experts_read_from_pinned_host_rows(T: int) -> None:
    """Experts named by host rows are read by the kernel from pinned host memory over PCIe (no copy), with the
    same result as from their pages, also inside a CUDA graph whose tables then change in place."""
    d, f, E, k = 256, 128, 64, 8
    hidden, w, ids, view, table = make_case(T, d, f, E, k, 0, torch.bfloat16, "cuda", seed=T + 5)
    expect = fused_moe(hidden, w, ids, view, table, f)
    routed = sorted(set(ids.flatten().tolist()))
    host, moved, poisoned = move_to_host_rows(view.cpu(), table.cpu(), routed[::3], pin=True)
    poisoned, moved = poisoned.cuda(), moved.cuda()
    assert torch.equal(fused_moe(hidden, w, ids, poisoned, moved, f, host), expect)
    with pytest.raises(ValueError, match="pinned"):
        fused_moe(hidden, w, ids, poisoned, moved, f, host.clone())  # pageable: a kernel cannot read it
    graph, live = torch.cuda.CUDAGraph(), moved.clone()
    with torch.cuda.graph(graph):
        out = fused_moe(hidden, w, ids, view, live, f, host)
    live.copy_(table)  # every expert back in its pages: the graph reads them there
    graph.replay()
    assert torch.equal(out, expect)
    live.copy_(moved)
    view.copy_(poisoned)  # their pages poisoned: the graph must read the host rows
    graph.replay()
    assert torch.equal(out, expect)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_cuda_topk_sweep_and_poisoned_buffers(k: int) -> None:
    # Poison the caching allocator's free blocks so unwritten rows would show up as NaN/huge values.
    junk = torch.full((64 << 20,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del junk
    d, f, E = 2048, 768, 32
    for T in (1, 3, 33, 4096):
        hidden, w, ids, view, table = make_case(T, d, f, E, k, 4, torch.bfloat16, "cuda", seed=k * 100 + T)
        ref = fused_moe_reference(hidden, w, ids, view, table, f)
        out = fused_moe(hidden, w, ids, view, table, f)
        assert torch.isfinite(out).all(), (T, k)
        assert rel_err(out, ref) < 1e-2, (T, k)
        assert torch.equal(fused_moe(hidden, w, ids, view, table, f), out), "not deterministic"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(2048, 768, 128, 8), (96, 80, 9, 3)], ids=lambda s: "d{}_f{}_E{}_k{}".format(*s))
@pytest.mark.parametrize("T", [1, 16, 300, 2048])
def test_cuda_graph_replay_with_new_inputs(shape: tuple[int, int, int, int], T: int) -> None:
    # The engine captures decode steps in CUDA graphs: the whole call (alignment, both GEMMs, top-k
    # sum) must have no host sync and must read everything it depends on from device memory at
    # replay time. Capture once, then refill hidden, weights, ids, table (rows moved to other pages,
    # other experts absent) and pool contents, and replay. T=2048 with k=8 takes the chunked alignment.
    d, f, E, k = shape
    static = make_case(T, d, f, E, k, E // 5, torch.bfloat16, "cuda", seed=T)
    stream = torch.cuda.Stream()  # compile and warm the allocator outside the graph
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(*static, f)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(*static, f)  # [T, d], a static output
    for seed in (T + 1, T + 2, T):
        case = make_case(T, d, f, E, k, E // 5, torch.bfloat16, "cuda", seed=seed)
        for dst, src in zip(static, case, strict=True):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), (T, seed)
        assert rel_err(out, fused_moe_reference(*case, f)) < 1e-2, (T, seed)
        assert torch.equal(out, fused_moe(*case, f)), "graph replay differs from an eager call"
