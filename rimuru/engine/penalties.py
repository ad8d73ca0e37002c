"""Presence, frequency and repetition penalties, computed as vLLM's, on the sampler's copy of a row's raw logits
after its logit_bias and min_tokens bans and before the temperature:

    repetition r   a token of the prompt or of the output so far: logit / r where the logit is > 0, logit * r else
    frequency  f   logit -= f * (times the token was generated)
    presence   p   logit -= p * (1 if it was generated at all)

Only requests that set one (r != 1, f != 0 or p != 0) hold state or cost work: rows without penalties are skipped,
and a batch where no row has any makes no tensor and runs no op.

Nothing stands on the device. The sampler works SAMPLE_ROWS_PER_CHUNK rows at a time (engine/sampler.py), and for
a chunk with penalised rows `Penalties.apply` builds their counts there and then, as vLLM bin-counts its penalised
rows each step, in a chunk-local int32 temporary freed with the chunk:

    counts[i, t] = 2 * (times t was generated) + (1 if t is in the prompt)      i: the chunk's i-th penalised row

so the repetition penalty's mask is counts > 0 and the output count counts >> 1. What goes in comes from the host's
token history of each penalised request (`_History`, kept from step to step: its prompt's distinct tokens, when its
repetition penalty reads them, and its distinct generated tokens with their weights; a step adds only the tokens
it has not seen, so the host's work is O(new tokens) plus one concatenation per chunk), sent as one int32 array per
chunk (the rows' places and factors, flat indices i * V + t and their weights) in one pinned non-blocking
host->device copy and added with index_add_. Under async scheduling a request's last token was sampled by the step
still in flight and the host has not read it: its entry is added on the device from that step's sampled-token
tensor. No step reads anything back.

Memory: nothing between steps (the host's histories are numpy arrays). Within a chunk, per entry of its [b, V]
rows: the counts 4 bytes a penalised row, the copied array at most 8 while they are built (every token of a row
distinct: at most V entries, an index and a weight each; then given back), and the arithmetic's temporaries (the
repetition's where over the divided and multiplied logits) at most ~26 with the chunk's copy and the counts. A chunk
sampled with top-k and top-p, what the workspace is measured with (engine/workspace_profile.py on a GPU;
SAMPLER_BYTES_PER_ENTRY = 48 in the CPU bound), peaks higher (~33 in tensors alone, before a GPU sort's scratch), so
the penalties need no room of their own (tests/test_penalties.py measures both).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rimuru.engine.sampler import to_device

if TYPE_CHECKING:
    from rimuru.engine.request import Request

_PROMPT, _GENERATED = 1, 2  # the weights of a prompt token (once) and of each generated occurrence


class _History:
    """One penalised request's tokens as the host knows them, deduplicated: `tokens[:size]` distinct ids and
    `weights[:size]` their counts' weights (1 if in the prompt, where its repetition penalty reads it, + 2 per
    generated occurrence)."""

    def __init__(self, req: Request, vocab_size: int) -> None:
        prompt = np.zeros(0, dtype=np.int64)
        if req.params.repetition_penalty != 1.0:
            prompt = np.unique(np.asarray(req.prompt_token_ids, dtype=np.int64))
            prompt = prompt[(prompt >= 0) & (prompt < vocab_size)]
        n = len(prompt)
        self.tokens = np.empty(max(16, 2 * n), dtype=np.int32)
        self.weights = np.empty(len(self.tokens), dtype=np.int32)
        self.tokens[:n] = prompt
        self.weights[:n] = _PROMPT
        self.size = n
        self.where: dict[int, int] = dict(zip(prompt.tolist(), range(n), strict=True))
        self.outputs = req.output_token_ids  # the list read (a request given a new list is rebuilt)
        self.seen = 0  # how many of its tokens are in

    def follows(self, req: Request) -> bool:
        return req.output_token_ids is self.outputs and len(req.output_token_ids) >= self.seen

    def update(self) -> None:
        """The output tokens the host read since the last step: O(new tokens)."""
        new = self.outputs[self.seen :]
        self.seen = len(self.outputs)
        for t in new:
            i = self.where.get(t)
            if i is None:
                i = self.where[t] = self.size
                if i == len(self.tokens):
                    self.tokens = np.concatenate([self.tokens, np.empty_like(self.tokens)])
                    self.weights = np.concatenate([self.weights, np.empty_like(self.weights)])
                self.tokens[i] = t
                self.weights[i] = 0
                self.size += 1
            self.weights[i] += _GENERATED


@dataclass(frozen=True)
class Penalties:
    """One step's penalised sampled rows, on the host, applied by the sampler chunk by chunk."""

    rows: list[int]  # the sampled rows with a penalty, ascending
    factors: np.ndarray  # [R, 3] float32: repetition, frequency, presence
    tokens: list[np.ndarray]  # [R] each row's distinct known tokens (int32)
    weights: list[np.ndarray]  # [R] their weights (int32)
    pending: list[int]  # [R] each row's token in `in_flight` (the step in flight sampled it), -1: none
    in_flight: torch.Tensor | None  # [B'] int64: the sampled tokens of the step in flight (device)
    vocab_size: int

    def touches(self, lo: int, hi: int) -> bool:
        """Whether any of rows lo .. hi - 1 has a penalty."""
        return bisect_left(self.rows, lo) < bisect_left(self.rows, hi)

    def _send(self, a: int, b: int, lo: int, device: torch.device) -> tuple[torch.Tensor, int, int]:
        """Penalised rows a .. b - 1 (indices into `rows`) of a chunk starting at row `lo`, in one int32 array copied
        to `device` (pinned, non-blocking: no host sync):

            [chunk rows (r) | factors as float32 (3r) | flat index i * V + t (n) | weight (n) |
             in-flight tokens: i * V (p) | their rows in `in_flight` (p) | weight (p)]

        Returns it, n and p."""
        V, r = self.vocab_size, b - a
        assert r * V < 2**31, (r, V)  # flat int32 indices
        lens = np.fromiter((len(t) for t in self.tokens[a:b]), dtype=np.int64, count=r)
        n = int(lens.sum())
        pend = [(i, self.pending[a + i]) for i in range(r) if self.pending[a + i] >= 0]
        p = len(pend)
        host = np.empty(4 * r + 2 * n + 3 * p, dtype=np.int32)
        host[:r] = self.rows[a:b]
        host[:r] -= lo
        host[r : 4 * r].view(np.float32)[:] = self.factors[a:b].T.reshape(-1)
        k = 4 * r
        if n:
            np.concatenate(self.tokens[a:b], out=host[k : k + n])
            host[k : k + n] += np.repeat(np.arange(r, dtype=np.int32) * V, lens)
            np.concatenate(self.weights[a:b], out=host[k + n : k + 2 * n])
        k += 2 * n
        if p:
            host[k : k + p] = [i * V for i, _ in pend]
            host[k + p : k + 2 * p] = [j for _, j in pend]
            host[k + 2 * p :] = _GENERATED
        return to_device(torch.from_numpy(host), device), n, p

    def counts(self, a: int, b: int, device: torch.device, lo: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The counts of penalised rows a .. b - 1 (indices into `rows`), [b - a, V] int32, built on `device`; and
        [4, b - a] float32 there: their rows in the chunk from row `lo`, and their repetition, frequency and presence
        penalties."""
        r = b - a
        sent, n, p = self._send(a, b, lo, device)
        counts = torch.zeros(r * self.vocab_size, dtype=torch.int32, device=device)
        k = 4 * r
        if n:
            counts.index_add_(0, sent[k : k + n], sent[k + n : k + 2 * n])
        k += 2 * n
        if p:
            assert self.in_flight is not None
            flat = sent[k : k + p] + self.in_flight.index_select(0, sent[k + p : k + 2 * p])
            counts.index_add_(0, flat, sent[k + 2 * p :])
        head = sent[: 4 * r].clone()  # the index is given back now, before the arithmetic
        values = torch.cat([head[:r].float()[None], head[r:].view(torch.float32).view(3, r)])
        return counts.view(r, self.vocab_size), values

    def apply(self, chunk: torch.Tensor, lo: int) -> None:
        """Penalises, in place, the rows of `chunk` (the sampler's copy of rows lo .. lo + len(chunk) - 1) that have
        a penalty."""
        a, b = bisect_left(self.rows, lo), bisect_left(self.rows, lo + chunk.shape[0])
        if a == b:
            return
        counts, v = self.counts(a, b, chunk.device, lo)  # [r, V] int32 (this chunk's alone), [4, r]
        every = b - a == chunk.shape[0]  # every row of the chunk: no gather
        local = None if every else v[0].long()  # [r]
        x = chunk if every else chunk.index_select(0, local)  # [r, V]
        rep, freq, pres = v[1][:, None], v[2][:, None], v[3][:, None]  # [r, 1] each
        x = torch.where(counts > 0, torch.where(x > 0, x / rep, x * rep), x)
        generated = (counts >> 1).float()  # [r, V]
        del counts
        x -= freq * generated  # two subtractions in vLLM's order, so the float32 results are its own
        x -= pres * (generated > 0)
        if every:
            chunk.copy_(x)
        else:
            chunk.index_copy_(0, local, x)


class PenaltyHistory:
    """The engine's penalty state, on the host: each penalised request's token history (the runner keeps one)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.histories: dict[Request, _History] = {}

    def prepare(self, requests: Sequence[Request], vocab_size: int,
                in_flight: tuple[torch.Tensor, dict[int, int]] | None) -> Penalties | None:
        """The step's penalties over its sampled rows (`requests`, one each, in order, of a `vocab_size` vocabulary);
        None when no row has a penalty. `in_flight`: the last launch's sampled tokens (device) and each request's row
        in them by seq_id, where a request's pending token is."""
        if self.histories:
            for req in [r for r in self.histories if r.status.finished]:
                del self.histories[req]
        rows = [i for i, req in enumerate(requests) if req.params.penalized]
        if not rows:
            return None
        tokens, weights, pending = [], [], []
        for i in rows:
            req = requests[i]
            h = self.histories.get(req)
            if h is None or not h.follows(req):
                h = self.histories[req] = _History(req, vocab_size)
            h.update()
            tokens.append(h.tokens[: h.size])
            weights.append(h.weights[: h.size])
            if req.num_pending_tokens:
                assert req.num_pending_tokens == 1 and in_flight is not None, (req.request_id, req.num_pending_tokens)
                pending.append(in_flight[1][req.seq_id])  # KeyError: the token was not sampled by that step
            else:
                pending.append(-1)
        factors = np.array([[requests[i].params.repetition_penalty, requests[i].params.frequency_penalty,
                             requests[i].params.presence_penalty] for i in rows], dtype=np.float32)
        return Penalties(rows, factors, tokens, weights, pending, None if in_flight is None else in_flight[0],
                         vocab_size)
