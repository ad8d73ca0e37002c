"""The logprobs requests ask for, computed as vLLM's default: log_softmax of the RAW logits (before temperature,
top-k and top-p), in float32, on the device, and read to the host together with the step's sampled tokens.

Only the rows whose request asked are computed; a step where nobody asked costs nothing. Rows asking for
different numbers share one width K, the largest asked; the host keeps each row's own number.

One step's logprobs are ONE int32 tensor, so they travel in one device->host copy beside the tokens (the float32
values are bit-cast, so nothing is rounded):

    packed [R, 2K+2] int32         R rows that asked, in sampled-row order
    col 0          the sampled token's logprob      (float32 bits)
    col 1..K       the top K logprobs, best first   (float32 bits)
    col K+1        the sampled token's rank          (1: the most likely)
    col K+2..2K+1  the top K token ids
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rimuru.engine.sampler import SAMPLE_ROWS_PER_CHUNK, to_device


@dataclass(frozen=True)
class LogprobRows:
    """Which sampled rows of a step asked for logprobs, and how many top ones each (set by the runner at launch)."""

    num_sampled: int  # rows of the step's sampled tokens
    rows: list[int]  # the rows that asked, ascending
    nums: list[int]  # top logprobs each of them asked for, -1 resolved to the vocabulary size

    @property
    def width(self) -> int:
        return max(self.nums)


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled row's logprobs on the host."""

    token_logprob: float  # the sampled token's
    rank: int  # the sampled token's (1: the most likely)
    top_ids: list[int]  # the requested number of most likely tokens, best first
    top_logprobs: list[float]


def logprob_rows(asked: list[int | None], vocab_size: int) -> LogprobRows | None:
    """`asked`: each sampled row's `SamplingParams.logprobs`. None when no row asked."""
    pairs = [(i, n) for i, n in enumerate(asked) if n is not None]
    if not pairs:
        return None
    nums = [vocab_size if n == -1 else min(n, vocab_size) for _, n in pairs]
    return LogprobRows(num_sampled=len(asked), rows=[i for i, _ in pairs], nums=nums)


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, sel: LogprobRows) -> torch.Tensor:
    """logits [B, V] float32 raw, tokens [B] int64 sampled -> packed [R, 2K+2] int32 (layout above), without a
    host sync. Rows go in chunks of the sampler's: a chunk's working set (log_softmax [b, V] float32, the rank
    mask [b, V] bool) is a fraction of the sampler chunk's that the workspace reserves, and freed before it."""
    device = logits.device
    K = sel.width
    R = len(sel.rows)
    every = R == logits.shape[0]
    index = None if every else to_device(torch.tensor(sel.rows, dtype=torch.int64), device)  # [R]
    packed = torch.empty(R, 2 * K + 2, dtype=torch.int32, device=device)
    for lo in range(0, R, SAMPLE_ROWS_PER_CHUNK):
        hi = min(R, lo + SAMPLE_ROWS_PER_CHUNK)
        if every:
            chunk, sampled = logits[lo:hi], tokens[lo:hi]
        else:
            chunk, sampled = logits.index_select(0, index[lo:hi]), tokens.index_select(0, index[lo:hi])
        pack_chunk(packed[lo:hi], chunk, sampled, K)
    return packed


def pack_chunk(packed: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, K: int) -> None:
    """One chunk of rows into its rows of a packed tensor: logits [b, V] raw, tokens [b] int64 (whose logprob and
    rank are packed) -> packed [b, 2K+2] int32 (layout above), on the device."""
    values = packed[:, : K + 1].view(torch.float32)  # [b, K+1]: the same bytes, read as float32
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [b, V]
    token_lp = logprobs.gather(1, tokens[:, None])  # [b, 1]
    values[:, :1] = token_lp
    # tokens as likely as the sampled one count ahead of it, as vLLM ranks them
    packed[:, K + 1] = (logprobs >= token_lp).sum(dim=-1)  # [b]
    if K:
        top_lp, top_ids = logprobs.topk(K, dim=-1)  # [b, K], best first
        values[:, 1:] = top_lp
        packed[:, K + 2 :] = top_ids


def unpack_logprobs(packed: torch.Tensor, sel: LogprobRows) -> list[TokenLogprobs | None]:
    """packed [R, 2K+2] int32 on the host -> one entry per sampled row (None: that row did not ask)."""
    K = sel.width
    values = packed[:, : K + 1].view(torch.float32).tolist()  # [R][K+1]
    ints = packed[:, K + 1 :].tolist()  # [R][K+1]: rank, then the top ids
    out: list[TokenLogprobs | None] = [None] * sel.num_sampled
    for row, n, v, i in zip(sel.rows, sel.nums, values, ints, strict=True):
        out[row] = TokenLogprobs(token_logprob=v[0], rank=i[0], top_ids=i[1 : 1 + n], top_logprobs=v[1 : 1 + n])
    return out
