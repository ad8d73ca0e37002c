"""Prompt logprobs as vLLM's `prompt_logprobs`: for each prompt token after the first, its logprob under the model
given the tokens before it (raw logits, as the sampled tokens' logprobs), its rank and the top k; the first entry is
None.

Position j of a prompt of P tokens predicts token j + 1, so the rows are the hidden states of positions 0 .. P - 2
(position P - 1 predicts the first generated token: that row is sampled). A prefill cut into chunks brings its
rows chunk by chunk; each step computes those of its chunks and reads them with its sampled tokens:

    step's tokens     | r0: start0 .. start0+n0-1 | r1 (asks): start1 .. start1+n1-1 | ...
    rows              hidden rows of r1's positions start1 .. min(start1 + n1, P1 - 1) - 1
    targets           r1's prompt tokens start1 + 1 .. min(start1 + n1, P1 - 1)

Only requests that ask get rows, and the LM head runs over those rows alone, SAMPLE_ROWS_PER_CHUNK at a time (a
chunk's [b, V] logits and log_softmax are the sampler chunk's working set, which the workspace reserves). The values
travel packed as the sampled tokens' logprobs do (engine/logprobs.py), one [R, 2K+2] int32 tensor for the step.

The hidden states are those of the pass: an eager pass's, or the ones a mixed CUDA graph's replay leaves in the
graphs' memory pool, valid until the next replay, which the runner queues only after these reads
(engine/cuda_graphs.py `mixed_hidden`; a pure-decode step never has prompt rows: each of its rows samples). A
request that asks does not start from a cached prefix (engine/kv_cache_manager.py): its prompt's positions must all
be computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rimuru.engine.logprobs import LogprobRows, TokenLogprobs, pack_chunk, unpack_logprobs
from rimuru.engine.sampler import SAMPLE_ROWS_PER_CHUNK, to_device
from rimuru.engine.scheduler import ScheduledRequest


@dataclass(frozen=True)
class PromptSpan:
    """One request's prompt logprobs in a step: `count` rows from `row`, for its prompt positions `first` on."""

    index: int  # the request's place in the step's scheduled list
    first: int  # the prompt position of its first row's target (>= 1)
    row: int  # its first row in the step's rows
    count: int


@dataclass(frozen=True)
class PromptLogprobRows:
    """A step's prompt rows: which hidden rows, predicting which tokens, with how many top logprobs."""

    hidden_rows: np.ndarray  # [R] int64: rows of the pass's hidden states
    targets: np.ndarray  # [R] int64: the prompt token each row predicts
    nums: list[int]  # [R] top logprobs per row (-1 resolved to the vocabulary size)
    spans: list[PromptSpan]

    @property
    def width(self) -> int:
        return max(self.nums)


def prompt_logprob_rows(
    scheduled: Sequence[ScheduledRequest], vocab_size: int,
    batch_order: Callable[[Sequence[ScheduledRequest]], Sequence[int] | None] | None = None,
) -> PromptLogprobRows | None:  # fmt: skip
    """The step's prompt rows (batch layout above); None when no scheduled chunk has any, the common case, which
    costs one pass over the requests. `batch_order`: the batch's order of the scheduled requests where it is not
    theirs (ModelRunner.batch_order: a hybrid model's mixed step puts its decodes first), asked only when someone
    wants prompt logprobs; it places their rows."""
    if all(s.request.params.prompt_logprobs is None for s in scheduled):
        return None
    rows: list[np.ndarray] = []
    targets: list[int] = []
    nums: list[int] = []
    spans: list[PromptSpan] = []
    order = batch_order(scheduled) if batch_order is not None else None
    first_row = [0] * len(scheduled)  # the hidden row of each scheduled request's first token
    offset = 0
    for i in order if order is not None else range(len(scheduled)):
        first_row[i] = offset
        offset += scheduled[i].num_new_tokens
    for b, s in enumerate(scheduled):
        req = s.request
        asked = req.params.prompt_logprobs
        offset = first_row[b]
        if asked is not None:
            end = min(s.start + s.num_new_tokens, len(req.prompt_token_ids) - 1)
            if s.start < end:
                k = end - s.start
                spans.append(PromptSpan(b, s.start + 1, len(targets), k))
                rows.append(np.arange(offset, offset + k, dtype=np.int64))
                targets += req.prompt_token_ids[s.start + 1 : end + 1]
                nums += [vocab_size if asked == -1 else min(asked, vocab_size)] * k
    if not spans:
        return None
    return PromptLogprobRows(np.concatenate(rows), np.array(targets, dtype=np.int64), nums, spans)


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            sel: PromptLogprobRows) -> torch.Tensor:
    """hidden [T, d] of the pass -> packed [R, 2K+2] int32 (engine/logprobs.py's layout), without a host sync. The LM
    head runs over the rows in chunks; every tensor-parallel rank runs it over the same chunks
    (`follow_prompt_logits`), so their all-gathers meet."""
    device = hidden.device
    index = to_device(torch.from_numpy(np.stack([sel.hidden_rows, sel.targets])), device)  # [2, R]: one copy
    K = sel.width
    R = len(sel.nums)
    packed = torch.empty(R, 2 * K + 2, dtype=torch.int32, device=device)
    for lo in range(0, R, SAMPLE_ROWS_PER_CHUNK):
        hi = min(R, lo + SAMPLE_ROWS_PER_CHUNK)
        logits = compute_logits(hidden.index_select(0, index[0, lo:hi]))  # [b, V] float32
        pack_chunk(packed[lo:hi], logits, index[1, lo:hi], K)
    return packed


def follow_prompt_logits(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                         hidden_rows: np.ndarray) -> None:
    """Tensor parallelism, ranks > 0: the LM head over rank 0's prompt rows in rank 0's chunks (its all-gathers need
    every rank); the logits are rank 0's."""
    rows = to_device(torch.from_numpy(hidden_rows), hidden.device)
    for lo in range(0, len(hidden_rows), SAMPLE_ROWS_PER_CHUNK):
        compute_logits(hidden.index_select(0, rows[lo : lo + SAMPLE_ROWS_PER_CHUNK]))


def unpack_prompt_logprobs(packed: torch.Tensor, sel: PromptLogprobRows) -> dict[int, tuple[int, list[TokenLogprobs]]]:
    """packed [R, 2K+2] int32 on the host -> by scheduled index: (the prompt position of its first entry, one entry
    per row)."""
    R = len(sel.nums)
    rows = unpack_logprobs(packed, LogprobRows(num_sampled=R, rows=list(range(R)), nums=sel.nums))
    out: dict[int, tuple[int, list[TokenLogprobs]]] = {}
    for span in sel.spans:
        entries = rows[span.row : span.row + span.count]
        out[span.index] = (span.first, [e for e in entries if e is not None])
    return out
