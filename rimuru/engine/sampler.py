"""Turns the last-position logits of a batch into next tokens: greedy, temperature, top-k, top-p, seeds.

Greedy rows take the argmax of the raw logits. Sampled rows are scaled by temperature, cut by top-k
and top-p (one sort serves both), and drawn with the exponential race (argmax p / E, E ~ Exp(1)),
which equals a categorical draw. A request with a seed draws its E from its own generator, so its
tokens don't depend on which other requests share the batch.
"""

from __future__ import annotations

import torch

from rimuru.engine.sampling_params import SamplingParams

# Rows sampled together. The sampler's working copies ([rows, V] float32 scaled logits, sort values and
# int64 order, masks, probabilities, the race) cost ~48 bytes per vocabulary entry and row: a 256-row batch
# of a 152k vocabulary would need ~1.9 GB at once, a 32-row chunk ~230 MB. workspace_bytes reserves one chunk.
SAMPLE_ROWS_PER_CHUNK = 32
SAMPLER_BYTES_PER_ENTRY = 48


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """logits [B, V] float32 -> token ids [B] int64 (on the logits' device), without any host sync.

        A greedy-only batch is one argmax. Otherwise the per-request numbers travel in ONE packed
        host->device copy: rows temperature, top-k, top-p, greedy of a float32 [4, B] tensor.
        """
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)  # [B]
        V = logits.shape[-1]
        top_k = [p.top_k if p.top_k > 0 else V for p in params]
        top_p = [p.top_p for p in params]
        cut = any(k < V for k in top_k) or any(p < 1.0 for p in top_p)
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        packed = to_device(torch.tensor([temps, top_k, top_p, greedy], dtype=torch.float32), logits.device)
        B = logits.shape[0]
        sampled = torch.empty(B, dtype=torch.long, device=logits.device)
        for lo in range(0, B, SAMPLE_ROWS_PER_CHUNK):
            hi = min(B, lo + SAMPLE_ROWS_PER_CHUNK)
            sampled[lo:hi] = self._draw(logits[lo:hi], packed[:, lo:hi], cut, generators[lo:hi], greedy[lo:hi])
        if not any(greedy):
            return sampled
        return torch.where(packed[3] > 0.5, logits.argmax(dim=-1), sampled)

    def _draw(self, logits: torch.Tensor, packed: torch.Tensor, cut: bool,
              generators: list[torch.Generator | None], greedy: list[bool]) -> torch.Tensor:
        """One chunk of rows: logits [b, V], packed [4, b] -> sampled ids [b] (greedy rows are overwritten later)."""
        scaled = logits / packed[0][:, None]  # [b, V]
        if cut:  # top-k as float32 is exact: k <= V < 2**24
            scaled = _apply_top_k_top_p(scaled, packed[1].long()[:, None], packed[2][:, None])
        probs = torch.softmax(scaled, dim=-1)  # [b, V]
        race = torch.empty_like(probs)
        race.exponential_(generator=self.generator)
        for i, gen in enumerate(generators):
            if gen is not None and not greedy[i]:
                race[i].exponential_(generator=gen)
        return (probs / race).argmax(dim=-1)  # [b]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on the device without a host sync."""
    if device.type != "cuda":
        return host
    # pinned staging from the caching host allocator, which keeps it until the copy has completed
    return host.pin_memory().to(device, non_blocking=True)


def _apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """logits [B, V]; k [B, 1] int64 (V: off); p [B, 1] float32 (1.0: off)."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(V, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability of strictly better tokens
    # the best token always stays; p = 1.0 cuts nothing (float32 cumsums reach 1.0 before the tail)
    sorted_logits = sorted_logits.masked_fill((mass_before >= p) & (p < 1.0), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
