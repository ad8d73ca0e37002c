"""Hugging Face transformers as the reference: greedy tokens of a checkpoint, computed by transformers itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def hf_greedy(path: str | Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """`steps` greedy tokens for each prompt from transformers' own model and `generate` (float32, CPU).
    EOS does not stop generation (eos_token_id=None), matching `ignore_eos=True` on our side."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(prompt):].tolist())
    return out


def run_greedy(llm: Any, prompts: list[list[int]], steps: int, one_by_one: bool = False) -> list[list[int]]:
    """`steps` greedy tokens (EOS ignored) per prompt from a Rimuru `LLM`, all at once or one at a time; then
    checks that the run left nothing behind: no KV page in use and the allocator's invariants intact."""
    from rimuru.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    if one_by_one:
        outs = [llm.generate({"prompt_token_ids": p}, params)[0] for p in prompts]
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.stats()["kv_pages_used"] == 0, "KV pages leaked"
    llm.engine.pool.allocator.check_invariants()
    return [o.outputs[0].token_ids for o in outs]


def random_prompts(lengths: tuple[int, ...], seed: int = 11, vocab: int = 300) -> list[list[int]]:
    """Seeded random prompt token ids (ids 0-2 are the tiny tokenizer's specials, so they are avoided)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_greedy_matches(path: str | Path, prompts: list[list[int]], got: list[list[int]], steps: int,
                          tie: float = 1e-3) -> None:
    """Our greedy tokens against transformers' (float32, CPU), equal token by token except after a position where
    the reference's top-2 logits are within `tie` (summation order may pick either there; the rest of that
    sequence is then not compared). Raises AssertionError naming the first real difference."""
    from transformers import AutoModelForCausalLM

    want = hf_greedy(path, prompts, steps)
    model = None
    for s, (prompt, ours, ref) in enumerate(zip(prompts, got, want, strict=True)):
        assert len(ours) == len(ref) == steps, (s, len(ours), len(ref))
        i = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), None)
        if i is None:
            continue
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ref[:i]]), use_cache=False).logits[0, -1].float()
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < tie, (f"sequence {s}: token {i} is {ours[i]}, transformers' {ref[i]} (top-2 logit gap {gap:.3g} "
                           f">= {tie}); ours {ours}, transformers' {ref}")
