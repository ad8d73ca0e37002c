"""Presence, frequency and repetition penalties, computed as vLLM's, on the sampler's copy of a row's raw logits
after its logit_bias and min_tokens bans and before the temperature:

    repetition r   a token of the prompt or of the output so far: logit / r where the logit is > 0, logit * r else
    frequency  f   logit -= f * (times the token was generated)
    presence   p   logit -= p * (1 if it was generated at all)

Only requests that set one (r != 1, f != 0 or p != 0) hold state or cost work: rows without penalties are skipped,
and a batch where no row has any makes no tensor and runs no op.

The state is a device table, one int32 row over the vocabulary per penalised request (its slot):

    counts[slot, t] = 2 * (times t was generated) + (1 if t is in the prompt)

so the repetition penalty's mask is counts > 0 and the output count counts >> 1. After each step the tokens sampled
for penalised rows are added on the device (+2 at their token, `PenaltyTable.count`): the host reads nothing to
keep the table current, and under async scheduling the token the step in flight sampled is counted before the next
step samples. A request given a slot (its first sampled step, or after its slot went to another request) has its
row built from what the host knows: its prompt, its output tokens, and the token sampled by the step in flight,
copied on the device from that step's output.

Size, measured: 4 bytes per vocabulary entry per slot, a 152k vocabulary's row 608 KB, max_num_seqs = 256 rows
156 MB (a 32k vocabulary: 33 MB). The table is made the first time a request asks for a penalty, all max_num_seqs
rows at once (every sampled request of a step may hold one; no growth, so no transient second copy), and the
workspace reserves it (engine/setup.py, engine/workspace_profile.py), so the budget holds either way.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rimuru.engine.sampler import to_device

if TYPE_CHECKING:
    from rimuru.engine.request import Request

COUNT_BYTES_PER_ENTRY = 4  # int32


def penalty_table_bytes(num_slots: int, vocab_size: int) -> int:
    """What the penalty table holds once made: the workspace reserves it."""
    return num_slots * vocab_size * COUNT_BYTES_PER_ENTRY


@dataclass(frozen=True)
class Penalties:
    """One step's penalised sampled rows, applied by the sampler chunk by chunk."""

    rows: list[int]  # the sampled rows with a penalty, ascending (host)
    values: torch.Tensor  # [5, R] float32 on the device: row, slot, repetition, frequency, presence
    counts: torch.Tensor  # [S, V] int32: the table

    def touches(self, lo: int, hi: int) -> bool:
        """Whether any of rows lo .. hi - 1 has a penalty."""
        return bisect_left(self.rows, lo) < bisect_left(self.rows, hi)

    def apply(self, chunk: torch.Tensor, lo: int) -> None:
        """Penalises, in place, the rows of `chunk` (the sampler's copy of rows lo .. lo + len(chunk) - 1) that have
        a penalty."""
        a, b = bisect_left(self.rows, lo), bisect_left(self.rows, lo + chunk.shape[0])
        if a == b:
            return
        v = self.values[:, a:b]  # [5, r]
        counts = self.counts.index_select(0, v[1].long())  # [r, V] int32
        every = b - a == chunk.shape[0]  # every row of the chunk: no gather
        local = None if every else v[0].long() - lo  # [r]
        x = chunk if every else chunk.index_select(0, local)  # [r, V]
        rep, freq, pres = v[2][:, None], v[3][:, None], v[4][:, None]  # [r, 1] each
        x = torch.where(counts > 0, torch.where(x > 0, x / rep, x * rep), x)
        generated = (counts >> 1).float()  # [r, V]
        x -= freq * generated  # two subtractions in vLLM's order, so the float32 results are its own
        x -= pres * (generated > 0)
        if every:
            chunk.copy_(x)
        else:
            chunk.index_copy_(0, local, x)


class PenaltyTable:
    """The engine's penalty state: the device table and which request holds which slot (the runner keeps one)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots  # the most rows a step samples (max_num_seqs)
        self.device = device
        self.counts: torch.Tensor | None = None  # [S, V] int32, made on first use
        self._steps: torch.Tensor | None = None  # [2] int32: 1 (a prompt token), 2 (a generated token)
        self._slots: dict[Request, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))

    def prepare(self, requests: Sequence[Request], vocab_size: int,
                in_flight: tuple[torch.Tensor, dict[int, int]] | None) -> Penalties | None:
        """The step's penalties over its sampled rows (`requests`, one each, in order, of a `vocab_size` vocabulary):
        slots for the penalised requests that have none, built on the device; None when no row has a penalty.
        `in_flight`: the last launch's sampled tokens (device) and each request's row in them by seq_id, where a
        request's pending token is."""
        rows = [i for i, req in enumerate(requests) if req.params.penalized]
        if not rows:
            if self._slots:
                self._release_finished()
            return None
        if self.counts is None:
            self.counts = torch.zeros(self.num_slots, vocab_size, dtype=torch.int32, device=self.device)
            self._steps = torch.arange(1, 3, dtype=torch.int32, device=self.device)  # made on the device: no copy
        self._release_finished()
        batch = [requests[i] for i in rows]
        new = [req for req in batch if req not in self._slots]
        if new:
            taken = set(batch)
            for req in new:
                self._slots[req] = self._take(taken)
            self._build(new, in_flight)
        packed = [[float(i) for i in rows], [float(self._slots[req]) for req in batch],
                  [req.params.repetition_penalty for req in batch], [req.params.frequency_penalty for req in batch],
                  [req.params.presence_penalty for req in batch]]
        values = to_device(torch.tensor(packed, dtype=torch.float32), self.device)  # slots < 2**24: exact
        return Penalties(rows, values, self.counts)

    def count(self, penalties: Penalties, tokens: torch.Tensor) -> None:
        """After sampling: each penalised row's sampled token (tokens [B] int64, on the device) is generated once
        more."""
        assert self.counts is not None and self._steps is not None
        v = penalties.values
        sampled = tokens.index_select(0, v[0].long())  # [R]
        self.counts.index_put_((v[1].long(), sampled), self._steps[1:].expand(len(penalties.rows)), accumulate=True)

    def _release_finished(self) -> None:
        for req in [r for r in self._slots if r.status.finished]:
            self._free.append(self._slots.pop(req))

    def _take(self, keep: set[Request]) -> int:
        """A free slot, else the slot of a request not in this step (preempted, or sitting out; rebuilt when it
        samples again)."""
        if self._free:
            return self._free.pop()
        victim = next(r for r in self._slots if r not in keep)  # a step samples at most num_slots rows
        return self._slots.pop(victim)

    def _build(self, new: list[Request], in_flight: tuple[torch.Tensor, dict[int, int]] | None) -> None:
        """The rows of requests given a slot this step: zero, +1 at their prompt's tokens (where the repetition
        penalty reads them), +2 per output token known to the host and per token sampled by the step in flight."""
        assert self.counts is not None and self._steps is not None
        one, two = self._steps[:1], self._steps[1:]
        slots = [self._slots[req] for req in new]
        prompt: list[list[int]] = [[], []]
        output: list[list[int]] = [[], []]
        pending_slots: list[int] = []
        pending_rows: list[int] = []
        for req, slot in zip(new, slots, strict=True):
            if req.params.repetition_penalty != 1.0:
                ids = sorted(set(req.prompt_token_ids))
                prompt[0] += [slot] * len(ids)
                prompt[1] += ids
            output[0] += [slot] * len(req.output_token_ids)
            output[1] += req.output_token_ids
            if req.num_pending_tokens:
                assert req.num_pending_tokens == 1 and in_flight is not None, (req.request_id, req.num_pending_tokens)
                pending_slots.append(slot)
                pending_rows.append(in_flight[1][req.seq_id])  # KeyError: the token was not sampled by that step
        n_prompt, n_output = len(prompt[0]), len(output[0])
        index = to_device(torch.tensor([slots + prompt[0] + output[0] + pending_slots,
                                        [0] * len(slots) + prompt[1] + output[1] + pending_rows],
                                       dtype=torch.int64), self.device)  # [2, N]: one copy for the whole build
        counts = self.counts
        k = len(slots)
        counts.index_fill_(0, index[0, :k], 0)
        if n_prompt:  # every entry writes 1: a token repeated in the prompt is still 1
            counts.index_put_((index[0, k : k + n_prompt], index[1, k : k + n_prompt]),
                              one.expand(n_prompt))
        k += n_prompt
        if n_output:
            counts.index_put_((index[0, k : k + n_output], index[1, k : k + n_output]),
                              two.expand(n_output), accumulate=True)
        k += n_output
        if pending_slots:
            tokens = in_flight[0].index_select(0, index[1, k:]) if in_flight is not None else None
            assert tokens is not None
            counts.index_put_((index[0, k:], tokens), two.expand(len(pending_slots)), accumulate=True)
