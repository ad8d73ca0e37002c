"""Turns the last-position logits of a batch into next tokens: greedy, temperature, top-k, top-p, seeds.

Greedy rows take the argmax of the raw logits. Sampled rows are scaled by temperature, cut by top-k
and top-p (one sort serves both), and drawn with the exponential race (argmax p / E, E ~ Exp(1)),
which equals a categorical draw. A request with a seed draws its E from its own generator, so its
tokens don't depend on which other requests share the batch.
"""

from __future__ import annotations

import torch

from rimuru.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """logits [B, V] float32 -> token ids [B] int64 (on the logits' device)."""
        greedy = [p.greedy for p in params]
        argmax = logits.argmax(dim=-1)  # [B]
        if all(greedy):
            return argmax
        temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                             device=logits.device, dtype=torch.float32)
        scaled = logits / temps[:, None]  # [B, V]
        scaled = _apply_top_k_top_p(scaled, params)
        probs = torch.softmax(scaled, dim=-1)  # [B, V]
        race = torch.empty_like(probs)
        race.exponential_(generator=self.generator)
        for i, gen in enumerate(generators):
            if gen is not None and not greedy[i]:
                race[i].exponential_(generator=gen)
        sampled = (probs / race).argmax(dim=-1)  # [B]
        greedy_mask = torch.tensor(greedy, device=logits.device)
        return torch.where(greedy_mask, argmax, sampled)


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    V = logits.shape[-1]
    top_k = [p.top_k if p.top_k > 0 else V for p in params]
    top_p = [p.top_p for p in params]
    if all(k >= V for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(V, device=logits.device)[None, :]
    k = torch.tensor(top_k, device=logits.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    p = torch.tensor(top_p, device=logits.device, dtype=torch.float32)[:, None]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability of strictly better tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))  # the best token always stays
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
