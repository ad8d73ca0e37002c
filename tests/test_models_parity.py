"""Rimuru's models against transformers' own, on the CPU in float32.

Experts sit at shuffled pages of a NaN-filled expert view and every attention layer's KV at shuffled
pages of a NaN-filled KV cache, so a wrong page id or an unwritten slot shows up as NaN or a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

from rimuru.testing import ARCHS
from rimuru.testing.paged_model import PagedModel, random_prompts  # noqa: F401 (PagedModel: imported from here too)
from rimuru.testing.paged_model import assert_close as check_close

ATOL = 1e-4
PROMPT_LENS = (5, 17, 33, 1)  # inside one page, just past one, just past two, a single token


_HF_CACHE: dict[Path, torch.nn.Module] = {}


def hf_logits(ckpt: Path, tokens: list[int]) -> Tensor:
    """transformers' logits [L, V] of every position of one unpadded sequence."""
    from transformers import AutoModelForCausalLM

    if ckpt not in _HF_CACHE:
        _HF_CACHE[ckpt] = AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        ).eval()
    with torch.inference_mode():
        return _HF_CACHE[ckpt](torch.tensor([tokens])).logits[0].float()


def prompts(seed: int, vocab: int) -> list[list[int]]:
    return random_prompts(seed, vocab, PROMPT_LENS)


def assert_close(got: Tensor, want: Tensor, what: str) -> None:
    check_close(got, want, what, ATOL)


CASES = [pytest.param(arch, fused, id=f"{arch}-{'fused' if fused else 'per_expert'}") for arch in ARCHS
         for fused in (False, True)]


@pytest.mark.parametrize(("arch", "fused"), CASES)
def test_prefill_then_decode_matches_transformers(
    tiny_checkpoint: Callable[..., Path], arch: str, fused: bool
) -> None:
    ckpt = tiny_checkpoint(arch, fused_experts=fused)
    pm = PagedModel(ckpt)
    assert len(pm.loaded) == pm.spec.num_moe_layers * pm.spec.num_experts
    seqs = prompts(1, pm.spec.vocab_size)

    # One prefill batch of prompts of different lengths: every position's logits.
    outs = pm.step(list(enumerate(seqs)))
    for s, (tokens, out) in enumerate(zip(seqs, outs, strict=True)):
        assert_close(out, hf_logits(ckpt, tokens), f"{arch} prefill seq {s}")

    # Greedy decode through the paged cache, all sequences batched, 4 steps.
    steps = 4
    decode_logits: list[list[Tensor]] = [[] for _ in seqs]
    for _ in range(steps):
        nxt = [int(out[-1].argmax()) for out in outs]
        for tokens, t in zip(seqs, nxt, strict=True):
            tokens.append(t)
        outs = pm.step([(s, [t]) for s, t in enumerate(nxt)])
        for s, out in enumerate(outs):
            decode_logits[s].append(out[0])
    for s, tokens in enumerate(seqs):
        # Causal: a decode step's logits are the full sequence's logits at that position.
        ref = hf_logits(ckpt, tokens)  # [n + steps, V]
        assert_close(torch.stack(decode_logits[s]), ref[-steps:], f"{arch} decode seq {s}")
        greedy = [int(x) for x in ref[-steps - 1 : -1].argmax(-1)]
        assert greedy == tokens[-steps:], f"{arch} greedy tokens of seq {s}"


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_one_shot(tiny_checkpoint: Callable[..., Path], arch: str) -> None:
    ckpt = tiny_checkpoint(arch)
    pm = PagedModel(ckpt, seed=3)
    a, b, c = prompts(2, pm.spec.vocab_size)[:3]  # lengths 5, 17, 33
    # Chunks of different sequences share steps; a decode-sized chunk rides along.
    steps = [
        [(0, c[:10]), (1, b[:7])],
        [(1, b[7:8]), (0, c[10:26]), (2, a)],
        [(0, c[26:]), (1, b[8:])],
    ]
    last: dict[int, Tensor] = {}
    for step in steps:
        for (seq, _), out in zip(step, pm.step(step), strict=True):
            last[seq] = out[-1]
    for seq, tokens in ((0, c), (1, b), (2, a)):
        assert_close(last[seq], hf_logits(ckpt, tokens)[-1], f"{arch} chunked seq {seq}")


def test_greedy_tokens_are_not_degenerate(tiny_checkpoint: Callable[..., Path]) -> None:
    # The tiny weights must make decoding informative: varied tokens, varied routing.
    ckpt = tiny_checkpoint("qwen2_moe")
    pm = PagedModel(ckpt)
    seq = prompts(4, pm.spec.vocab_size)[1]
    out = pm.step([(0, seq)])[0]
    tokens = []
    for _ in range(12):
        tokens.append(int(out[-1].argmax()))
        out = pm.step([(0, tokens[-1:])])[0]
    assert len(set(tokens)) > 3, tokens
    moe = pm.model.model.layers[0].mlp
    with torch.inference_mode():
        hidden = pm.model.model.embed_tokens(torch.tensor(seq))
        _, ids = moe.route(pm.model.model.layers[0].post_attention_layernorm(hidden))
    assert len(set(ids.flatten().tolist())) >= pm.spec.num_experts // 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_on_gpu_is_close_to_transformers(tiny_checkpoint: Callable[..., Path], arch: str) -> None:
    # bf16 cannot match fp32 bit for bit: ask for small mean error and the same greedy token at
    # nearly every position (a near-tie may flip). Reference: transformers in fp32.
    ckpt = tiny_checkpoint(arch)
    pm = PagedModel(ckpt, dtype=torch.bfloat16, device="cuda")
    seqs = prompts(1, pm.spec.vocab_size)
    outs = pm.step(list(enumerate(seqs)))
    got = torch.cat(outs)
    want = torch.cat([hf_logits(ckpt, tokens) for tokens in seqs])
    assert torch.isfinite(got).all()
    mean_err = (got - want).abs().mean().item()
    assert mean_err < 0.05 * want.std().item(), f"{arch}: mean abs error {mean_err:.3g}"
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.85, f"{arch}: greedy tokens agree at only {agree:.0%} of positions"
