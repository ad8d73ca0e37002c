"""Hugging Face transformers as the reference: greedy tokens of a checkpoint, computed by transformers itself."""

from __future__ import annotations

from pathlib import Path

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
