"""The Qwen3.5-MoE hybrid model against transformers' Qwen3_5MoeForCausalLM, on the CPU in float32.

As in test_models_parity: experts at shuffled pages of a NaN-filled expert view, KV at shuffled pages of a
NaN-filled KV cache. The linear-attention state lives at shuffled pages of NaN-filled ssm and conv views, read
and written through the batch's state page ids, so a request that starts fresh must select its zero state,
never read its pages.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

from rimuru.model_spec import FULL_ATTENTION, LINEAR_ATTENTION, ModelSpec
from rimuru.testing.paged_model import PagedModel, greedy_decode_together, random_prompts
from rimuru.testing.paged_model import assert_close as check_close

pytest.importorskip("transformers")

ARCH = "qwen3_5_moe_text"
# The chunk form of the delta rule sums in another order than transformers' (and than the per-token form).
ATOL = 1e-3
PROMPT_LENS = (5, 17, 70, 1)  # inside one page, past one, past a 64-token delta-rule chunk, one token
L, F = LINEAR_ATTENTION, FULL_ATTENTION
PATTERNS = {
    "LLLF": None,  # the default rule: full attention when (i + 1) % 4 == 0
    "FLL": [F, L, L],  # full attention first, linear layers after it
}


def checkpoint(tiny_checkpoint: Callable[..., Path], pattern: str, fused: bool) -> Path:
    types = PATTERNS[pattern]
    if types is None:
        return tiny_checkpoint(ARCH, fused_experts=fused)
    return tiny_checkpoint(ARCH, fused_experts=fused, num_hidden_layers=len(types), layer_types=types)


def HybridModel(ckpt: Path, seed: int = 0) -> PagedModel:  # noqa: N802 (reads as the class it builds)
    """The paged harness over a hybrid checkpoint: state pages come from NaN-filled ssm and conv views."""
    model = PagedModel(ckpt, seed)
    assert model.spec.is_hybrid and model.model.state_cache is not None
    return model


_HF_CACHE: dict[Path, torch.nn.Module] = {}


def hf_model(ckpt: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if ckpt not in _HF_CACHE:
        _HF_CACHE[ckpt] = AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        ).eval()
    return _HF_CACHE[ckpt]


def hf_logits(ckpt: Path, tokens: list[int]) -> Tensor:
    """transformers' logits [L, V] of every position of one unpadded sequence (no cache)."""
    with torch.inference_mode():
        return hf_model(ckpt)(torch.tensor([tokens]), use_cache=False).logits[0].float()


def prompts(seed: int, vocab: int) -> list[list[int]]:
    return random_prompts(seed, vocab, PROMPT_LENS)


def assert_close(got: Tensor, want: Tensor, what: str) -> None:
    check_close(got, want, what, ATOL)


CASES = [pytest.param(p, fused, id=f"{p}-{'fused' if fused else 'per_expert'}") for p in PATTERNS
         for fused in (False, True)]


def test_spec_of_the_tiny_model(tiny_checkpoint: Callable[..., Path]) -> None:
    spec = ModelSpec.from_pretrained(checkpoint(tiny_checkpoint, "LLLF", False))
    assert spec.layer_types == (L, L, L, F) and spec.attention_layer_ids == (3,)
    assert spec.norm_topk_prob and spec.attn_output_gate and spec.partial_rotary_factor == 0.25
    assert spec.num_moe_layers == 4 and spec.shared_expert_intermediate_size == 48


@pytest.mark.parametrize(("pattern", "fused"), CASES)
def test_prefill_matches_transformers(tiny_checkpoint: Callable[..., Path], pattern: str, fused: bool) -> None:
    ckpt = checkpoint(tiny_checkpoint, pattern, fused)
    hm = HybridModel(ckpt)
    assert len(hm.loaded) == hm.spec.num_moe_layers * hm.spec.num_experts
    seqs = prompts(1, hm.spec.vocab_size)
    # One prefill batch of prompts of different lengths: every position's logits.
    for s, (tokens, out) in enumerate(zip(seqs, hm.step(list(enumerate(seqs))), strict=True)):
        assert torch.isfinite(out).all()
        assert_close(out, hf_logits(ckpt, tokens), f"{pattern} prefill seq {s}")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_chunked_prefill_equals_one_prefill(tiny_checkpoint: Callable[..., Path], pattern: str) -> None:
    ckpt = checkpoint(tiny_checkpoint, pattern, False)
    a, b, c = prompts(2, 300)[:3]  # lengths 5, 17, 70
    whole = HybridModel(ckpt, seed=1).step([(0, c), (1, b)])
    chunked = HybridModel(ckpt, seed=2)
    # The second chunks carry the state of the first; a fresh sequence rides along in the second step.
    first = chunked.step([(0, c[:29]), (1, b[:6])])
    second = chunked.step([(1, b[6:]), (2, a), (0, c[29:])])
    assert_close(torch.cat([first[0], second[2]]), whole[0], f"{pattern} chunked seq 0")
    assert_close(torch.cat([first[1], second[0]]), whole[1], f"{pattern} chunked seq 1")
    assert_close(second[1], hf_logits(ckpt, a), f"{pattern} fresh seq beside chunks")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_greedy_decode_matches_generate(tiny_checkpoint: Callable[..., Path], pattern: str) -> None:
    ckpt = checkpoint(tiny_checkpoint, pattern, True)
    hm = HybridModel(ckpt, seed=3)
    seqs = prompts(4, hm.spec.vocab_size)[:3]
    steps = 5
    ours = greedy_decode_together(hm, seqs, steps)
    model = hf_model(ckpt)
    for s, prompt in enumerate(seqs):
        with torch.inference_mode():
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        want = gen[0, len(prompt):].tolist()
        assert ours[s] == want, f"{pattern} seq {s}: greedy tokens {ours[s]} != transformers' {want}"
    assert len({t for toks in ours for t in toks}) > 3, ours  # the tiny weights decode informatively


def test_multimodal_checkpoint_loads_text_model(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    # The `qwen3_5_moe` wrapper: text config under text_config, weights under model.language_model., plus a
    # vision tower and an MTP head that the loader skips.
    import json

    from safetensors.torch import load_file, save_file

    ckpt = checkpoint(tiny_checkpoint, "LLLF", True)
    text = json.loads((ckpt / "config.json").read_text())
    config = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
              "tie_word_embeddings": False, "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {name.replace("model.", "model.language_model.", 1): t
               for name, t in load_file(ckpt / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.layers.0.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    wrapped = HybridModel(tmp_path)
    assert wrapped.spec.model_type == "qwen3_5_moe" and wrapped.spec.norm_topk_prob
    seq = prompts(5, 300)[1]
    assert_close(wrapped.step([(0, seq)])[0], hf_logits(ckpt, seq), "multimodal checkpoint")


def test_both_model_types_are_registered() -> None:
    from rimuru.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
    from rimuru.models.registry import model_class

    assert model_class("qwen3_5_moe_text") is model_class("qwen3_5_moe") is Qwen3_5MoeForCausalLM
