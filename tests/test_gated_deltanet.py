"""Rimuru's gated DeltaNet layer against transformers' Qwen3.5-MoE linear-attention layer (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from rimuru.models.gated_deltanet import GatedDeltaNet

transformers = pytest.importorskip("transformers")
from transformers import Qwen3_5MoeTextConfig  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet  # noqa: E402

ATOL = 1e-4
HIDDEN = 32


def tiny_config(num_k_heads: int = 2, num_v_heads: int = 4) -> Qwen3_5MoeTextConfig:
    return Qwen3_5MoeTextConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, linear_num_key_heads=num_k_heads,
        linear_num_value_heads=num_v_heads, linear_key_head_dim=8, linear_value_head_dim=6,
        linear_conv_kernel_dim=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        vocab_size=64, layer_types=["linear_attention"],
    )  # fmt: skip


def make_pair(num_k_heads: int = 2, num_v_heads: int = 4, chunk_size: int = 64,
              seed: int = 0) -> tuple[Qwen3_5MoeGatedDeltaNet, GatedDeltaNet]:
    """The reference layer with random weights (norm weight and dt_bias too) and ours holding the same."""
    torch.manual_seed(seed)
    cfg = tiny_config(num_k_heads, num_v_heads)
    ref = Qwen3_5MoeGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        ref.norm.weight.add_(1.0)
    ours = GatedDeltaNet(HIDDEN, num_k_heads, num_v_heads, 8, 6, 4, cfg.rms_norm_eps, chunk_size).eval()
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=True)
    assert not missing and not unexpected
    return ref, ours


def ref_run(ref: Qwen3_5MoeGatedDeltaNet, chunks: list[Tensor]) -> tuple[list[Tensor], Tensor, Tensor]:
    """Feed one sequence to the reference in successive calls with its cache: (outputs, conv, recurrent)."""
    cache = DynamicCache(config=tiny_config(ref.num_k_heads, ref.num_v_heads))
    outs = [ref(c[None], cache_params=cache)[0] for c in chunks]
    layer = cache.layers[0]
    return outs, layer.conv_states[0][..., 1:], layer.recurrent_states[0]  # HF keeps K inputs; we keep K-1


def run_ours(layer: GatedDeltaNet, seqs: list[Tensor], conv: Tensor | None = None, state: Tensor | None = None,
             fresh: Tensor | None = None, recurrent: bool = False) -> tuple[list[Tensor], Tensor, Tensor]:
    """One varlen call over `seqs`; missing states are NaN-filled and marked fresh."""
    B = len(seqs)
    (cd, kw), (hv, dk, dv) = layer.state_shapes()
    if conv is None:
        conv = torch.full((B, cd, kw), float("nan"))
        state = torch.full((B, hv, dk, dv), float("nan"))
        fresh = torch.ones(B, dtype=torch.bool)
    lens = torch.tensor([s.shape[0] for s in seqs])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()])
    out, conv_f, state_f = layer(torch.cat(seqs), qsl, conv, state, ~fresh, recurrent=recurrent)
    return list(out.split(lens.tolist())), conv_f, state_f


@torch.no_grad()
@pytest.mark.parametrize(("hk", "hv", "length", "chunk"), [(2, 4, 13, 64), (2, 2, 70, 16), (1, 4, 3, 4)])
def test_prefill_matches_reference(hk: int, hv: int, length: int, chunk: int) -> None:
    ref, ours = make_pair(hk, hv, chunk)
    x = torch.randn(length, HIDDEN)
    (r_out,), r_conv, r_state = ref_run(ref, [x])
    (o_out,), o_conv, o_state = run_ours(ours, [x])
    torch.testing.assert_close(o_out, r_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(o_conv, r_conv, atol=ATOL, rtol=0)
    torch.testing.assert_close(o_state, r_state, atol=ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("split", [1, 2, 5, 17])
def test_two_chunks_with_carried_state_equal_one(split: int) -> None:
    ref, ours = make_pair(chunk_size=8)
    x = torch.randn(29, HIDDEN)
    (whole,), conv_w, state_w = run_ours(ours, [x])
    (first,), conv1, state1 = run_ours(ours, [x[:split]])
    (second,), conv2, state2 = run_ours(ours, [x[split:]], conv1, state1, torch.tensor([False]))
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=ATOL, rtol=0)
    torch.testing.assert_close(conv2, conv_w, atol=ATOL, rtol=0)
    torch.testing.assert_close(state2, state_w, atol=ATOL, rtol=0)


@torch.no_grad()
def test_decode_steps_match_reference_cache() -> None:
    ref, ours = make_pair()
    x = torch.randn(11 + 4, HIDDEN)
    steps = [x[:11]] + [x[11 + i : 12 + i] for i in range(4)]  # a prefill, then 4 single-token decodes
    r_outs, r_conv, r_state = ref_run(ref, steps)
    (out,), conv, state = run_ours(ours, [steps[0]])
    outs = [out]
    for step in steps[1:]:
        (out,), conv, state = run_ours(ours, [step], conv, state, torch.tensor([False]), recurrent=True)
        outs.append(out)
    for o, r in zip(outs, r_outs, strict=True):
        torch.testing.assert_close(o, r, atol=ATOL, rtol=0)
    torch.testing.assert_close(conv, r_conv, atol=ATOL, rtol=0)
    torch.testing.assert_close(state, r_state, atol=ATOL, rtol=0)
    (full,), _, _ = run_ours(ours, [x])  # and one prefill of the whole sequence gives the same last rows
    torch.testing.assert_close(torch.cat(outs)[-4:], full[-4:], atol=ATOL, rtol=0)


@torch.no_grad()
def test_recurrent_form_equals_chunk_form_for_prefill() -> None:
    _, ours = make_pair(chunk_size=4)
    seqs = [torch.randn(n, HIDDEN) for n in (9, 2, 5)]
    chunk = run_ours(ours, seqs)
    rec = run_ours(ours, seqs, recurrent=True)
    for a, b in zip(chunk[0], rec[0], strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    torch.testing.assert_close(chunk[2], rec[2], atol=ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("recurrent", [False, True])
def test_batch_of_different_lengths_equals_each_alone(recurrent: bool) -> None:
    ref, ours = make_pair(chunk_size=8)
    a, b = torch.randn(19, HIDDEN), torch.randn(2, HIDDEN)
    outs, conv, state = run_ours(ours, [a, b], recurrent=recurrent)
    for i, seq in enumerate((a, b)):
        (r_out,), r_conv, r_state = ref_run(ref, [seq])
        torch.testing.assert_close(outs[i], r_out, atol=ATOL, rtol=0)
        torch.testing.assert_close(conv[i : i + 1], r_conv, atol=ATOL, rtol=0)
        torch.testing.assert_close(state[i : i + 1], r_state, atol=ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("recurrent", [False, True])
def test_mixed_batch_fresh_state_memory_is_garbage(recurrent: bool) -> None:
    """A continuing sequence beside a fresh one whose state memory holds NaN and huge values."""
    ref, ours = make_pair(chunk_size=8)
    prefix, cont, new = torch.randn(6, HIDDEN), torch.randn(1 if recurrent else 7, HIDDEN), torch.randn(5, HIDDEN)
    (_,), conv1, state1 = run_ours(ours, [prefix])
    conv = torch.cat([conv1, torch.full_like(conv1, float("nan"))])  # [2, conv_dim, K-1]
    state = torch.cat([state1, torch.full_like(state1, 1e30)])
    state[1, 0, 0, 0] = float("nan")
    fresh = torch.tensor([False, True])
    outs, conv_f, state_f = run_ours(ours, [cont, new], conv, state, fresh, recurrent=recurrent)
    r_outs, r_conv, r_state = ref_run(ref, [prefix, cont])
    torch.testing.assert_close(outs[0], r_outs[1], atol=ATOL, rtol=0)
    torch.testing.assert_close(state_f[:1], r_state, atol=ATOL, rtol=0)
    torch.testing.assert_close(conv_f[:1], r_conv, atol=ATOL, rtol=0)
    (r_new,), r_conv, r_state = ref_run(ref, [new])
    torch.testing.assert_close(outs[1], r_new, atol=ATOL, rtol=0)
    torch.testing.assert_close(conv_f[1:], r_conv, atol=ATOL, rtol=0)
    torch.testing.assert_close(state_f[1:], r_state, atol=ATOL, rtol=0)
