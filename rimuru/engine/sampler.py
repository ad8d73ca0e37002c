"""Turns the last-position logits of a batch into next tokens: greedy, temperature, top-k, top-p, seeds.

Greedy rows take the argmax of the raw logits. Sampled rows are scaled by temperature, cut by top-k
and top-p (one sort serves both), and drawn with the exponential race (argmax p / E, E ~ Exp(1)),
which equals a categorical draw. A request with a seed draws its E from its own generator, so its
tokens don't depend on which other requests share the batch.

Rows may come with logit edits (`LogitEdits`): a request's `logit_bias` (added to its raw logits before temperature,
as vLLM's) and, as vLLM's min-tokens logits processor, -inf at EOS and the stop ids of requests still short of
`min_tokens`; then, in vLLM's order, the presence, frequency and repetition penalties (`Penalties`,
engine/penalties.py). All of them go into the sampler's own copies of the logits, one chunk of rows at a time: the
raw logits stay as they are for the logprobs (vLLM's default, raw logprobs), and the host never waits.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rimuru.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rimuru.engine.penalties import Penalties
    from rimuru.engine.request import Request

# Rows sampled together. The sampler's working copies ([rows, V] float32 scaled logits, sort values and
# int64 order, masks, probabilities, the race) cost ~48 bytes per vocabulary entry and row: a 256-row batch
# of a 152k vocabulary would need ~1.9 GB at once, a 32-row chunk ~230 MB. workspace_bytes reserves one chunk (the
# GPU's start-up profile measures it), and a chunk's penalty counts are built inside that room (engine/penalties.py).
SAMPLE_ROWS_PER_CHUNK = 32
SAMPLER_BYTES_PER_ENTRY = 48


@dataclass(frozen=True)
class LogitEdits:
    """Values added to some rows' logits: entry j adds values[j] to token index[1, j] of row index[0, j], rows
    ascending (-inf bans the token; several entries of one token add up)."""

    rows: list[int]  # index[0] on the host: which entries fall in a chunk of rows, without reading the device
    index: torch.Tensor  # [2, N] int64 on the logits' device
    values: torch.Tensor  # [N] float32 on the logits' device

    def touches(self, lo: int, hi: int) -> bool:
        """Whether any of rows lo .. hi - 1 has an entry."""
        return bisect_left(self.rows, lo) < bisect_left(self.rows, hi)

    def apply(self, chunk: torch.Tensor, lo: int) -> None:
        """Adds the entries of rows lo .. lo + len(chunk) - 1 into `chunk` (the sampler's copy, never the raw
        logits)."""
        a, b = bisect_left(self.rows, lo), bisect_left(self.rows, lo + chunk.shape[0])
        if a < b:
            chunk.index_put_((self.index[0, a:b] - lo, self.index[1, a:b]), self.values[a:b], accumulate=True)


def logit_edits(requests: Sequence[Request], vocab_size: int, device: torch.device) -> LogitEdits | None:
    """Per sampled row (one request each, in order): its `logit_bias`, and -inf at EOS (unless ignore_eos) and its
    stop_token_ids while it has generated fewer than `min_tokens` tokens (a token sampled by a pass still in flight,
    under async scheduling, counts as generated). None when no row has any, the common case, which costs one pass
    over the rows."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, req in enumerate(requests):
        p = req.params
        for t, bias in sorted((p.logit_bias or {}).items()):
            rows.append(i)
            cols.append(t)
            values.append(bias)
        if not p.min_tokens or len(req.output_token_ids) + req.num_pending_tokens >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids)
        if req.eos_token_id is not None and not p.ignore_eos:
            stops.add(req.eos_token_id)
        for t in sorted(stops):
            if 0 <= t < vocab_size:  # an id past the vocabulary can never be drawn anyway
                rows.append(i)
                cols.append(t)
                values.append(float("-inf"))
    if not rows:
        return None
    packed = to_device(torch.tensor([rows, cols], dtype=torch.int64), device)
    return LogitEdits(rows, packed, to_device(torch.tensor(values, dtype=torch.float32), device))


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
        edits: LogitEdits | None = None, penalties: Penalties | None = None,
    ) -> torch.Tensor:
        """logits [B, V] float32 -> token ids [B] int64 (on the logits' device), without any host sync; `edits`
        are added to the rows' logits first (a -inf entry: the row never draws that token), then `penalties` are
        applied.

        A greedy-only batch is one argmax. Otherwise the per-request numbers travel in ONE packed
        host->device copy: rows temperature, top-k, top-p, greedy of a float32 [4, B] tensor.
        """
        greedy = [p.greedy for p in params]
        if all(greedy):
            return _argmax(logits, edits, penalties)  # [B]
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
            sampled[lo:hi] = self._draw(logits[lo:hi], packed[:, lo:hi], cut, generators[lo:hi], greedy[lo:hi],
                                        edits, penalties, lo)
        if not any(greedy):
            return sampled
        return torch.where(packed[3] > 0.5, _argmax(logits, edits, penalties), sampled)

    def _draw(self, logits: torch.Tensor, packed: torch.Tensor, cut: bool, generators: list[torch.Generator | None],
              greedy: list[bool], edits: LogitEdits | None, penalties: Penalties | None, lo: int) -> torch.Tensor:
        """One chunk of rows (from row `lo`): logits [b, V], packed [4, b] -> sampled ids [b] (greedy rows are
        overwritten later)."""
        edited = _edited(logits, lo, edits, penalties)  # [b, V]: before the temperature, as vLLM's
        if edited is not None:
            scaled = edited.div_(packed[0][:, None])
        else:
            scaled = logits / packed[0][:, None]  # [b, V], a new tensor
        if cut:  # top-k as float32 is exact: k <= V < 2**24
            scaled = _apply_top_k_top_p(scaled, packed[1].long()[:, None], packed[2][:, None])
        probs = torch.softmax(scaled, dim=-1)  # [b, V]
        race = torch.empty_like(probs)
        race.exponential_(generator=self.generator)
        for i, gen in enumerate(generators):
            if gen is not None and not greedy[i]:
                race[i].exponential_(generator=gen)
        return (probs / race).argmax(dim=-1)  # [b]


def _edited(logits: torch.Tensor, lo: int, edits: LogitEdits | None,
            penalties: Penalties | None) -> torch.Tensor | None:
    """A copy of the chunk logits [b, V] (rows lo .. lo + b - 1) with its edits added, then its penalties applied;
    None when neither touches the chunk."""
    hi = lo + logits.shape[0]
    add = edits is not None and edits.touches(lo, hi)
    penalize = penalties is not None and penalties.touches(lo, hi)
    if not (add or penalize):
        return None
    edited = logits.clone()
    if add:
        assert edits is not None
        edits.apply(edited, lo)
    if penalize:
        assert penalties is not None
        penalties.apply(edited, lo)
    return edited


def _argmax(logits: torch.Tensor, edits: LogitEdits | None, penalties: Penalties | None = None) -> torch.Tensor:
    """logits [B, V] -> greedy ids [B] of the edited and penalised logits: a chunk of rows with edits or penalties
    is copied (one chunk at a time, within the sampler's workspace) and its argmax replaces theirs."""
    ids = logits.argmax(dim=-1)  # [B]
    if edits is None and penalties is None:
        return ids
    B = logits.shape[0]
    for lo in range(0, B, SAMPLE_ROWS_PER_CHUNK):
        hi = min(B, lo + SAMPLE_ROWS_PER_CHUNK)
        chunk = _edited(logits[lo:hi], lo, edits, penalties)  # [b, V]
        if chunk is not None:
            ids[lo:hi] = chunk.argmax(dim=-1)
    return ids


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
