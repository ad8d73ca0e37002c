"""The paged decode kernels of a gated DeltaNet layer (kernels/gated_delta_decode.py, kernels/causal_conv1d_update.py).

Each paged function reads and writes its state through page ids in a pool view. Every case shuffles the pages,
fills every page that holds no live state with NaN (unused pages and the pages of fresh sequences), gives a
padding row (-1) and, for the recurrent state, more value heads than key heads. The checks:

- the torch references equal the layer's own functions (recurrent_gated_delta_rule, causal_conv1d) over the
  gathered states, step after step, and leave every page they should not write bit for bit as it was;
- the Triton kernels (Triton's interpreter on the CPU, in a fresh process) equal the references and the layer's
  functions, at float32 within 1e-5;
- GatedDeltaNet.decode_paged equals read -> forward(recurrent=True) -> write, and a tiny hybrid model decodes the
  same tokens through it (references on the CPU, the interpreter's kernels, CUDA);
- on CUDA (`-m gpu`): Qwen3.5-35B shapes in bf16 and fp32 against the references, one CUDA-graph capture replayed
  with new page ids and inputs, and the engine's tokens with the kernels equal to the CPU path's.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from rimuru.kernels.causal_conv1d_update import causal_conv1d_update_reference
from rimuru.kernels.gated_delta_decode import gated_delta_decode_reference
from rimuru.models.forward_batch import ForwardBatch
from rimuru.models.gated_deltanet import GatedDeltaNet, causal_conv1d, l2_normalize, recurrent_gated_delta_rule
from rimuru.models.state_cache import LinearStateCache
from rimuru.testing.triton_interpreter import run_under_interpreter

REPO = Path(__file__).resolve().parents[1]
NAN = float("nan")


def _pages(B: int, n_pages: int, padding: tuple[int, ...], g: torch.Generator) -> Tensor:
    """[B] distinct shuffled page ids, -1 at the padding rows."""
    pages = torch.randperm(n_pages, generator=g)[:B].clone()
    pages[list(padding)] = -1
    return pages


def make_delta_case(
    B: int, Hk: int, Hv: int, dk: int, dv: int, L: int, seed: int, dtype: torch.dtype = torch.float32,
    device: str = "cpu", padding: tuple[int, ...] = (1,), fresh: tuple[int, ...] = (0, 3),
) -> dict[str, Tensor]:  # fmt: skip
    """L decode tokens of B sequences: q, k [B, Hk, L, dk] (normalised, q scaled), v [B, Hv, L, dv], g, beta
    [B, Hv, L], a NaN-filled ssm pool [2B + 3, Hv, dk, dv] where only the live sequences' pages hold state,
    ssm_pages [B], has_state [B]."""
    gen = torch.Generator().manual_seed(seed)
    n_pages = 2 * B + 3
    q = F.normalize(torch.randn(B, Hk, L, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(B, Hk, L, dk, generator=gen), dim=-1)
    v = torch.randn(B, Hv, L, dv, generator=gen)
    g = -F.softplus(torch.randn(B, Hv, L, generator=gen)) * 0.5  # log decay <= 0
    beta = torch.rand(B, Hv, L, generator=gen)
    pages = _pages(B, n_pages, padding, gen)
    has_state = torch.ones(B, dtype=torch.bool)
    has_state[list(fresh)] = False
    ssm = torch.full((n_pages, Hv, dk, dv), NAN)
    live = pages[(pages >= 0) & has_state]
    ssm[live] = torch.randn(len(live), Hv, dk, dv, generator=gen) * 0.3
    out = {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype), "g": g, "beta": beta, "ssm": ssm,
           "ssm_pages": pages, "has_state": has_state}
    return {name: t.to(device) for name, t in out.items()}


def make_conv_case(
    B: int, C: int, K: int, L: int, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
    padding: tuple[int, ...] = (1,), fresh: tuple[int, ...] = (0, 3),
) -> dict[str, Tensor]:  # fmt: skip
    """L tokens x [B, C, L], a NaN-filled conv pool [2B + 3, C, K-1] holding only the live sequences' state, weight
    [C, K], conv_pages [B], has_state [B]."""
    gen = torch.Generator().manual_seed(seed)
    n_pages = 2 * B + 3
    pages = _pages(B, n_pages, padding, gen)
    has_state = torch.ones(B, dtype=torch.bool)
    has_state[list(fresh)] = False
    conv = torch.full((n_pages, C, K - 1), NAN)
    live = pages[(pages >= 0) & has_state]
    conv[live] = torch.randn(len(live), C, K - 1, generator=gen)
    out = {"x": torch.randn(B, C, L, generator=gen), "conv": conv, "weight": torch.randn(C, K, generator=gen) / K,
           "conv_pages": pages, "has_state": has_state}
    return {name: t.to(dtype).to(device) if t.is_floating_point() else t.to(device) for name, t in out.items()}


def _gathered(pool: Tensor, pages: Tensor, has_state: Tensor) -> Tensor:
    """The layer's view of a pass's initial states: gathered, fresh (and padding) rows selected as zero."""
    keep = (has_state & (pages >= 0)).view(-1, *([1] * (pool.dim() - 1)))
    return torch.where(keep, pool[pages.clamp(min=0)], torch.zeros((), dtype=pool.dtype, device=pool.device))


def _assert_pages(after: Tensor, before: Tensor, pages: Tensor, want: Tensor, tol: float) -> None:
    """The valid rows' pages hold `want`; every other page is bit for bit as it was (NaN included)."""
    valid = pages >= 0
    written = torch.zeros(after.shape[0], dtype=torch.bool)
    written[pages[valid].cpu()] = True
    untouched_after, untouched_before = after.cpu()[~written], before.cpu()[~written]
    assert torch.equal(untouched_after.isnan(), untouched_before.isnan())
    assert torch.equal(untouched_after.nan_to_num(), untouched_before.nan_to_num()), "a page it must not write changed"
    got = after[pages[valid]].float()
    assert torch.isfinite(got).all(), "a fresh sequence's garbage reached its state"
    err = (got - want[valid].float()).abs().max().item()
    assert err <= tol * max(1.0, want[valid].float().abs().max().item()), err


def raw_qk(case: dict[str, Tensor], seed: int = 7) -> dict[str, Tensor]:
    """The case with raw q and k: each row of the normalised ones times a factor in [0.5, 3), q unscaled, so that
    normalising them (qk_scale = dk^-0.5) gives the case's own back."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(case)
    dk = case["q"].shape[-1]
    for name, scale in (("q", dk**-0.5), ("k", 1.0)):
        t = case[name]
        factor = (0.5 + 2.5 * torch.rand(*t.shape[:-1], 1, generator=gen)).to(t.device)
        out[name] = (t.float() / scale * factor).to(t.dtype)
    return out


def check_delta(fn: Callable[..., Tensor], case: dict[str, Tensor], tol: float = 1e-5,
                qk_scale: float | None = None) -> None:
    """`fn` (a paged gated delta decode) over the case's L tokens, one call per token, against
    recurrent_gated_delta_rule over all L tokens from the gathered initial states. `qk_scale`: the case's q and k
    are raw (raw_qk) and `fn` normalises them, given qk_scale; the recurrence takes them normalised, as the layer."""
    q, k, v, g, beta = (case[n] for n in ("q", "k", "v", "g", "beta"))
    pages, has_state, ssm = case["ssm_pages"], case["has_state"], case["ssm"]
    B, Hk, L, _ = q.shape
    Hv = v.shape[1]
    group = Hv // Hk
    before = ssm.clone()
    state0 = _gathered(ssm, pages, has_state)
    qf, kf = q.float(), k.float()
    if qk_scale is not None:
        qf, kf = l2_normalize(qf) * qk_scale, l2_normalize(kf)
    want_o, want_state = recurrent_gated_delta_rule(
        qf.repeat_interleave(group, 1), kf.repeat_interleave(group, 1), v.float(), g, beta, state0)
    valid = pages >= 0
    extra = {} if qk_scale is None else {"qk_scale": qk_scale}
    for t in range(L):
        flags = has_state if t == 0 else torch.ones_like(has_state)  # after the first token every state is live
        o = fn(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], ssm, pages, flags, **extra)
        assert o.shape == (B, Hv, v.shape[-1]) and o.dtype == torch.float32
        assert torch.equal(o[~valid], torch.zeros_like(o[~valid])), "a padding row's output is not 0"
        err = (o[valid] - want_o[valid][:, :, t]).abs().max().item()
        assert err <= tol * max(1.0, want_o[valid].abs().max().item()), (t, err)
    _assert_pages(ssm, before, pages, want_state, tol)


def check_conv(fn: Callable[..., Tensor], case: dict[str, Tensor], tol: float = 1e-5) -> None:
    """`fn` (a paged conv update) over the case's L tokens, one call per token, against causal_conv1d over all
    L tokens from the gathered initial states."""
    x, conv, weight, pages, has_state = (case[n] for n in ("x", "conv", "weight", "conv_pages", "has_state"))
    B, C, L = x.shape
    before = conv.clone()
    want_y, want_state = causal_conv1d(x, _gathered(conv, pages, has_state), weight,
                                       torch.full((B,), L, dtype=torch.long))
    valid = pages >= 0
    for t in range(L):
        flags = has_state if t == 0 else torch.ones_like(has_state)
        y = fn(x[:, :, t].contiguous(), conv, weight, pages, flags)
        assert y.shape == (B, C) and y.dtype == x.dtype
        assert torch.equal(y[~valid], torch.zeros_like(y[~valid])), "a padding row's output is not 0"
        err = (y[valid].float() - want_y[valid][:, :, t].float()).abs().max().item()
        assert err <= tol * max(1.0, want_y.abs().max().item()), (t, err)
    _assert_pages(conv, before, pages, want_state, tol)


# Small shapes: Hv > Hk grouping, dk and dv not powers of two (masked tiles), one and several tokens.
DELTA_CASES = [(5, 2, 4, 12, 24, 3), (4, 1, 3, 16, 16, 1), (6, 4, 4, 8, 40, 2)]  # B, Hk, Hv, dk, dv, L
CONV_CASES = [(5, 20, 4, 3), (4, 64, 4, 1), (6, 7, 3, 5)]  # B, C, K, L


@pytest.mark.parametrize("shape", DELTA_CASES)
def test_delta_reference_equals_the_recurrence(shape: tuple[int, ...]) -> None:
    check_delta(gated_delta_decode_reference, make_delta_case(*shape, seed=sum(shape)), tol=1e-6)
    dk = shape[3]  # raw q and k, normalised inside
    check_delta(gated_delta_decode_reference, raw_qk(make_delta_case(*shape, seed=sum(shape))), tol=1e-6,
                qk_scale=dk**-0.5)


@pytest.mark.parametrize("shape", CONV_CASES)
def test_conv_reference_equals_causal_conv1d(shape: tuple[int, ...]) -> None:
    check_conv(causal_conv1d_update_reference, make_conv_case(*shape, seed=sum(shape)), tol=1e-6)


def test_checks_catch_a_wrong_kernel() -> None:
    """The checks above fail for a function that multiplies the fresh state by 0, skips the grouping, or writes a
    padding row's page."""

    def multiplies_by_mask(q, k, v, g, beta, ssm, pages, has_state):  # noqa: ANN001, ANN202
        ssm[pages.clamp(min=0)] = ssm[pages.clamp(min=0)] * has_state.float()[:, None, None, None]  # NaN * 0 = NaN
        return gated_delta_decode_reference(q, k, v, g, beta, ssm, pages, torch.ones_like(has_state))

    def no_grouping(q, k, v, g, beta, ssm, pages, has_state):  # noqa: ANN001, ANN202
        rolled = q.roll(1, dims=1), k.roll(1, dims=1)  # value head h reading another key head
        return gated_delta_decode_reference(*rolled, v, g, beta, ssm, pages, has_state)

    def writes_padding(x, conv, weight, pages, has_state):  # noqa: ANN001, ANN202
        y = causal_conv1d_update_reference(x, conv, weight, pages, has_state)
        conv[pages.clamp(min=0)[pages < 0]] = 0.0  # a padding row's clamped page (0, unused here) written
        return y

    for bad in (multiplies_by_mask, no_grouping):
        with pytest.raises(AssertionError):
            check_delta(bad, make_delta_case(5, 2, 4, 12, 24, 2, seed=1))
    case = make_conv_case(5, 20, 4, 2, seed=1)
    assert 0 not in case["conv_pages"].tolist()
    with pytest.raises(AssertionError):
        check_conv(writes_padding, case)


# ---------------------------------------------------------------------------------------------- the layer


def make_layer(seed: int, hidden: int = 32, Hk: int = 2, Hv: int = 4, dk: int = 8, dv: int = 12,
               K: int = 4) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(hidden, Hk, Hv, dk, dv, K, eps=1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.4)
        layer.A_log.uniform_(-1.0, 0.5)
        layer.norm.weight.uniform_(0.7, 1.3)
    return layer.eval()


def _decode_batch(pages: Tensor, seq_lens: Tensor) -> ForwardBatch:
    B = pages.shape[0]
    rows = torch.arange(B)
    return ForwardBatch(
        input_ids=torch.zeros(B, dtype=torch.int64), positions=seq_lens.long() - 1,
        query_start_loc=torch.arange(B + 1, dtype=torch.int32), seq_lens=seq_lens.int(),
        block_tables=torch.zeros(0, B, 1, dtype=torch.int32), slot_mapping=torch.zeros(0, B, dtype=torch.int64),
        logits_indices=rows, max_query_len=1, max_seq_len=int(seq_lens.max()),
        ssm_pages=pages[None].clone(), conv_pages=pages.flip(0)[None].clone(),
    )  # fmt: skip


@torch.no_grad()
def check_layer_decode(seed: int, steps: int = 3, tol: float = 1e-5) -> None:
    """decode_paged (through LinearStateCache.decode) against read -> forward(recurrent=True) -> write, over a few
    steps from prefilled states, with a fresh sequence, a padding row and NaN in every unused page."""
    layer = make_layer(seed)
    (C, Km1), (Hv, dk, dv) = layer.state_shapes()
    B, n_pages = 5, 13
    gen = torch.Generator().manual_seed(seed)
    pages = _pages(B, n_pages, (2,), gen)  # ssm pages; the conv pages are the same ids in reverse order
    seq_lens = torch.tensor([7, 1, 4, 12, 3])  # sequence 1 is fresh: this pass brings its first token
    ssm, conv = torch.full((n_pages, Hv, dk, dv), NAN), torch.full((n_pages, C, Km1), NAN)
    ref, paged = LinearStateCache(ssm.clone(), conv.clone()), LinearStateCache(ssm.clone(), conv.clone(), True)
    batch = _decode_batch(pages, seq_lens)
    # prefill the sequences with context (all but the fresh one) through the chunk form, into both caches
    prompt_lens = (seq_lens - 1).clamp(min=0)
    live = (prompt_lens > 0) & (pages >= 0)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), prompt_lens[live].cumsum(0).int()])
    x = torch.randn(int(prompt_lens[live].sum()), layer.in_proj_qkv.in_features, generator=gen)
    n_live = int(live.sum())
    zeros = torch.zeros(n_live, dtype=torch.bool)
    _, conv_f, ssm_f = layer(x, qsl, torch.full((n_live, C, Km1), NAN), torch.full((n_live, Hv, dk, dv), NAN), zeros)
    for cache in (ref, paged):
        cache.conv[batch.conv_pages[0][live]] = conv_f
        cache.ssm[batch.ssm_pages[0][live]] = ssm_f
    has_state = seq_lens > 1
    valid = pages >= 0
    for step in range(steps):
        x = torch.randn(B, layer.in_proj_qkv.in_features, generator=gen)
        assert paged.decodes_in_place(batch) and not ref.decodes_in_place(batch)
        conv0, ssm0 = ref.read(0, batch)
        want, conv1, ssm1 = layer(x, batch.query_start_loc, conv0, ssm0, has_state, recurrent=True)
        ref.write(0, batch, conv1, ssm1)
        got = paged.decode(layer, 0, batch, x, has_state)
        assert torch.isfinite(got[valid]).all(), step
        err = (got[valid] - want[valid]).abs().max().item()
        assert err <= tol * max(1.0, want[valid].abs().max().item()), (step, err)
        for a, b in ((paged.ssm, ref.ssm), (paged.conv, ref.conv)):
            assert torch.equal(a.isnan(), b.isnan()), step  # the same pages written, the others still NaN
            assert (a.nan_to_num() - b.nan_to_num()).abs().max().item() <= tol, step
        has_state = torch.ones_like(has_state)


def test_layer_decode_paged_equals_forward_and_write() -> None:
    for seed in (0, 1):
        check_layer_decode(seed)


def test_decodes_in_place_only_for_pure_decode() -> None:
    pages = torch.arange(3)
    decode = _decode_batch(pages, torch.tensor([3, 1, 5]))
    cache = LinearStateCache(torch.zeros(3, 1, 1, 1), torch.zeros(3, 1, 1))
    assert cache.in_place_decode is False and not cache.decodes_in_place(decode)  # the CPU path by default
    forced = LinearStateCache(cache.ssm, cache.conv, in_place_decode=True)
    assert forced.decodes_in_place(decode)
    mixed = _decode_batch(pages, torch.tensor([3, 1, 5]))
    mixed.query_start_loc = torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    mixed.input_ids, mixed.max_query_len = torch.zeros(4, dtype=torch.int64), 2  # a prefill chunk of two tokens
    assert not forced.decodes_in_place(mixed)


# ---------------------------------------------------------------------------------------------- the engine

HYBRID_PROMPTS = (5, 17, 3, 30)
HYBRID_STEPS = 8


def hybrid_greedy(path: Path, device: str, in_place_decode: bool | None, **llm_args: object) -> list[list[int]]:
    """Greedy tokens of the tiny hybrid model, its state cache's decode path forced (None: the engine's default)."""
    from rimuru import LLM, SamplingParams
    from rimuru.testing.reference import random_prompts

    llm = LLM(str(path), gpu_memory_budget="64MiB" if device == "cpu" else "1GiB", device=device,
              max_num_batched_tokens=16, **llm_args)
    cache = llm.engine.model.state_cache
    assert cache is not None
    if in_place_decode is not None:
        cache.in_place_decode = in_place_decode
    calls = {"n": 0}
    decode = cache.decode

    def counted(*args: object, **kwargs: object) -> Tensor:
        calls["n"] += 1
        return decode(*args, **kwargs)

    cache.decode = counted  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=HYBRID_STEPS, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(HYBRID_PROMPTS, seed=31)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert (calls["n"] > 0) == bool(cache.in_place_decode), calls  # the paged decode ran exactly when chosen
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def hybrid_ckpt(tiny_checkpoint: Callable[..., Path]) -> Path:
    pytest.importorskip("transformers")
    return tiny_checkpoint("qwen3_5_moe_text", seed=3)


def test_engine_decodes_the_same_tokens_through_the_paged_path(hybrid_ckpt: Path) -> None:
    # On the CPU the kernels' dispatchers run their torch references: this holds the layer's wiring.
    want = hybrid_greedy(hybrid_ckpt, "cpu", None)
    assert hybrid_greedy(hybrid_ckpt, "cpu", True) == want
    assert len({t for toks in want for t in toks}) > 5, want


# ---------------------------------------------------------------------------------------------- interpreter

# Triton's interpreter reads TRITON_INTERPRET when triton is imported: run it in a fresh process.
_INTERPRET_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from functools import partial
    from rimuru.kernels.causal_conv1d_update import causal_conv1d_update_reference, causal_conv1d_update_triton
    from rimuru.kernels.gated_delta_decode import gated_delta_decode_reference, gated_delta_decode_triton
    import test_gated_delta_kernels as t
    for i, shape in enumerate(t.DELTA_CASES):
        t.check_delta(gated_delta_decode_triton, t.make_delta_case(*shape, seed=i))
        t.check_delta(gated_delta_decode_triton, t.raw_qk(t.make_delta_case(*shape, seed=i)), qk_scale=shape[3] ** -0.5)
        for bv in (4, 8):  # several value tiles per head
            t.check_delta(partial(gated_delta_decode_triton, block_v_override=bv), t.make_delta_case(*shape, seed=i))
    for i, shape in enumerate(t.CONV_CASES):
        t.check_conv(causal_conv1d_update_triton, t.make_conv_case(*shape, seed=i))
    # the kernels against the references directly, int32 page ids, strided q/k/v/x (views of a wider tensor)
    case = t.make_delta_case(6, 2, 6, 16, 20, 1, seed=9, padding=(0, 4), fresh=(2,))
    args = [case[n][:, :, 0] for n in ("q", "k", "v", "g", "beta")]
    a, b = case["ssm"].clone(), case["ssm"].clone()
    o_ref = gated_delta_decode_reference(*args, a, case["ssm_pages"], case["has_state"])
    o_tri = gated_delta_decode_triton(*args, b, case["ssm_pages"].int(), case["has_state"])
    assert (o_ref - o_tri).abs().max() < 1e-5 and torch.equal(a.isnan(), b.isnan())
    assert (a.nan_to_num() - b.nan_to_num()).abs().max() < 1e-5
    case = t.make_conv_case(5, 24, 4, 1, seed=9)
    wide = torch.randn(5, 40)
    wide[:, 8:32] = case["x"][:, :, 0]
    a, b = case["conv"].clone(), case["conv"].clone()
    y_ref = causal_conv1d_update_reference(case["x"][:, :, 0], a, case["weight"], case["conv_pages"], case["has_state"])
    y_tri = causal_conv1d_update_triton(wide[:, 8:32], b, case["weight"], case["conv_pages"].int(), case["has_state"])
    assert (y_ref - y_tri).abs().max() < 1e-5 and torch.equal(a.isnan(), b.isnan())
    assert (a.nan_to_num() - b.nan_to_num()).abs().max() == 0
    # the layer and the tiny hybrid model through the kernels: the dispatchers patched to Triton
    import rimuru.models.gated_deltanet as gdn
    gdn.gated_delta_decode, gdn.causal_conv1d_update = gated_delta_decode_triton, causal_conv1d_update_triton
    t.check_layer_decode(0)
    if {ckpt!r}:
        from pathlib import Path
        want = t.hybrid_greedy(Path({ckpt!r}), "cpu", False)
        assert t.hybrid_greedy(Path({ckpt!r}), "cpu", True) == want, want
    print("ok")
    """
)


def test_triton_interpreter_matches_references(request: pytest.FixtureRequest) -> None:
    pytest.importorskip("triton")
    try:  # the tiny model's part needs transformers to build its checkpoint; the kernels' part does not
        ckpt = str(request.getfixturevalue("hybrid_ckpt"))
    except pytest.skip.Exception:
        ckpt = ""
    run_under_interpreter(_INTERPRET_SCRIPT.format(tests=str(REPO / "tests"), ckpt=ckpt), timeout=600)


# ---------------------------------------------------------------------------------------------- GPU

QWEN35_35B = (16, 32, 128, 128)  # Hk, Hv, dk, dv
QWEN35_35B_CONV = 8192  # conv_dim = 2 * 16 * 128 + 32 * 128


def _rel(a: Tensor, b: Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B", [1, 3, 64, 256])
def test_cuda_kernels_match_references_at_qwen35_shapes(dtype: torch.dtype, B: int) -> None:
    from rimuru.kernels.causal_conv1d_update import causal_conv1d_update
    from rimuru.kernels.gated_delta_decode import gated_delta_decode

    Hk, Hv, dk, dv = QWEN35_35B
    padding, fresh = (B // 2,) if B > 1 else (), (0,) if B > 2 else ()
    case = make_delta_case(B, Hk, Hv, dk, dv, 1, seed=B, dtype=dtype, device="cuda", padding=padding, fresh=fresh)
    args = [case[n][:, :, 0] for n in ("q", "k", "v", "g", "beta")]
    a, b = case["ssm"].clone(), case["ssm"].clone()
    o_ref = gated_delta_decode_reference(*args, a, case["ssm_pages"], case["has_state"])
    o = gated_delta_decode(*args, b, case["ssm_pages"], case["has_state"])  # CUDA dispatch -> Triton
    torch.cuda.synchronize()
    assert torch.equal(a.isnan(), b.isnan())
    assert _rel(o, o_ref) < 1e-4 and (a.nan_to_num() - b.nan_to_num()).abs().max().item() < 1e-4
    check_delta(gated_delta_decode, make_delta_case(B, Hk, Hv, dk, dv, 4, seed=B + 1, dtype=dtype, device="cuda",
                                                    padding=padding, fresh=fresh), tol=1e-4)
    # raw q and k (the layer's decode path): normalised and q scaled in the kernel
    check_delta(gated_delta_decode, raw_qk(make_delta_case(B, Hk, Hv, dk, dv, 4, seed=B + 2, dtype=dtype,
                                                           device="cuda", padding=padding, fresh=fresh)),
                tol=1e-4, qk_scale=dk**-0.5)

    cc = make_conv_case(B, QWEN35_35B_CONV, 4, 1, seed=B, dtype=dtype, device="cuda", padding=padding, fresh=fresh)
    a, b = cc["conv"].clone(), cc["conv"].clone()
    y_ref = causal_conv1d_update_reference(cc["x"][:, :, 0], a, cc["weight"], cc["conv_pages"], cc["has_state"])
    y = causal_conv1d_update(cc["x"][:, :, 0].contiguous(), b, cc["weight"], cc["conv_pages"], cc["has_state"])
    torch.cuda.synchronize()
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())  # copies, exact
    assert _rel(y, y_ref) < (1e-5 if dtype == torch.float32 else 2e-2)  # bf16: a few ulps (two roundings each)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_with_new_pages_and_inputs() -> None:
    """Both kernels captured once, replayed after the page ids, fresh flags, inputs and pool change in place."""
    from rimuru.kernels.causal_conv1d_update import causal_conv1d_update
    from rimuru.kernels.gated_delta_decode import gated_delta_decode

    Hk, Hv, dk, dv = QWEN35_35B
    B = 16

    def inputs(seed: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        d = make_delta_case(B, Hk, Hv, dk, dv, 1, seed=seed, dtype=torch.bfloat16, device="cuda",
                            padding=(seed % B,), fresh=((seed + 3) % B,))
        c = make_conv_case(B, QWEN35_35B_CONV, 4, 1, seed=seed, dtype=torch.bfloat16, device="cuda",
                           padding=(seed % B,), fresh=((seed + 3) % B,))
        return ({n: (t[:, :, 0].contiguous() if n in ("q", "k", "v", "g", "beta") else t) for n, t in d.items()},
                {n: (t[:, :, 0].contiguous() if n == "x" else t) for n, t in c.items()})

    sd, sc = inputs(0)

    def step() -> tuple[Tensor, Tensor]:
        o = gated_delta_decode(sd["q"], sd["k"], sd["v"], sd["g"], sd["beta"], sd["ssm"], sd["ssm_pages"],
                               sd["has_state"])
        y = causal_conv1d_update(sc["x"], sc["conv"], sc["weight"], sc["conv_pages"], sc["has_state"])
        return o, y

    pristine = (sd["ssm"].clone(), sc["conv"].clone())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the graph
    torch.cuda.current_stream().wait_stream(side)
    sd["ssm"].copy_(pristine[0])
    sc["conv"].copy_(pristine[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, y = step()
    for seed in (1, 2, 3):
        d, c = inputs(seed)
        for dst, src in (*zip(sd.values(), d.values(), strict=True), *zip(sc.values(), c.values(), strict=True)):
            dst.copy_(src)
        ssm_ref, conv_ref = d["ssm"].clone(), c["conv"].clone()
        o_ref = gated_delta_decode_reference(d["q"], d["k"], d["v"], d["g"], d["beta"], ssm_ref, d["ssm_pages"],
                                             d["has_state"])
        y_ref = causal_conv1d_update_reference(c["x"], conv_ref, c["weight"], c["conv_pages"], c["has_state"])
        o.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(o, o_ref) < 1e-4 and _rel(y, y_ref) < 1e-2, seed
        assert torch.equal(sd["ssm"].isnan(), ssm_ref.isnan()), seed
        assert (sd["ssm"].nan_to_num() - ssm_ref.nan_to_num()).abs().max().item() < 1e-4, seed
        assert torch.equal(sc["conv"].nan_to_num(), conv_ref.nan_to_num()), seed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_layer_decode_paged_equals_forward() -> None:
    layer = make_layer(0, hidden=256, Hk=2, Hv=4, dk=128, dv=128).cuda()
    (C, Km1), (Hv, dk, dv) = layer.state_shapes()
    B, n = 8, 20
    gen = torch.Generator().manual_seed(0)
    pages = _pages(B, n, (3,), gen).cuda()
    has_state = torch.tensor([True, False] * (B // 2), device="cuda")
    ssm = torch.randn(n, Hv, dk, dv, generator=gen).cuda() * 0.1
    conv = torch.randn(n, C, Km1, generator=gen).cuda()
    fresh = pages[~has_state & (pages >= 0)]
    ssm[fresh], conv[fresh] = NAN, NAN
    x = torch.randn(B, 256, generator=gen).cuda()
    with torch.no_grad():
        conv0, ssm0 = conv[pages.clamp(min=0)], ssm[pages.clamp(min=0)]
        qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda")
        want, conv1, ssm1 = layer(x, qsl, conv0, ssm0, has_state, recurrent=True)
        got = layer.decode_paged(x, conv, pages, ssm, pages, has_state)
    valid = pages >= 0
    assert _rel(got[valid], want[valid]) < 1e-4
    assert _rel(ssm[pages[valid]], ssm1[valid]) < 1e-4 and _rel(conv[pages[valid]], conv1[valid]) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_decodes_the_cpu_paths_tokens(hybrid_ckpt: Path) -> None:
    from rimuru.testing.reference import assert_greedy_matches, random_prompts

    want = hybrid_greedy(hybrid_ckpt, "cpu", None)  # gather -> recurrent_gated_delta_rule -> scatter
    got = hybrid_greedy(hybrid_ckpt, "cuda", None, dtype="float32", enforce_eager=True)  # the default: kernels
    gathered = hybrid_greedy(hybrid_ckpt, "cuda", False, dtype="float32", enforce_eager=True)
    assert got == gathered, "the kernels and the gather path on the same GPU decode different tokens"
    assert_greedy_matches(hybrid_ckpt, random_prompts(HYBRID_PROMPTS, seed=31), got, HYBRID_STEPS)
    assert got == want, "the GPU's tokens differ from the CPU path's"
