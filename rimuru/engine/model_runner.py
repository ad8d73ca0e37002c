"""Turns a SchedulerOutput into tensors, runs the model, samples.

The runner never decides allocation: it reads the pages the scheduler gave each request.

Batch layout (all scheduled requests flattened, prefill chunks and decodes mixed):
    tokens     | r0: start0 .. start0+n0-1 | r1: ... | ...        T = sum(n_i) rows
    block_tables[l, b, j] = page of block j of request b in attention layer l (0-padded)
    slot_mapping[l, t]   = page * block_size + position % block_size for token row t in layer l
"""

from __future__ import annotations

import numpy as np
import torch

from rimuru.engine.request import Request
from rimuru.engine.sampler import Sampler
from rimuru.engine.scheduler import SchedulerOutput
from rimuru.models.forward_batch import ForwardBatch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, num_attention_layers: int,
                 block_size: int, sampler: Sampler) -> None:
        self.model = model
        self.device = device
        self.num_layers = num_attention_layers
        self.block_size = block_size
        self.sampler = sampler

    def prepare(self, sched: SchedulerOutput) -> ForwardBatch:
        bs, L = self.block_size, self.num_layers
        B = len(sched.scheduled)
        T = sched.num_tokens
        input_ids = np.empty(T, dtype=np.int64)
        positions = np.empty(T, dtype=np.int64)
        query_start_loc = np.zeros(B + 1, dtype=np.int32)
        seq_lens = np.empty(B, dtype=np.int32)
        max_blocks = max(len(s.request.kv_pages) for s in sched.scheduled)
        block_tables = np.zeros((L, B, max_blocks), dtype=np.int32)
        slot_mapping = np.empty((L, T), dtype=np.int64)
        logits_rows = []
        t = 0
        for b, s in enumerate(sched.scheduled):
            req, n = s.request, s.num_new_tokens
            input_ids[t : t + n] = _token_slice(req, s.start, s.start + n)
            pos = np.arange(s.start, s.start + n, dtype=np.int64)
            positions[t : t + n] = pos
            pages = np.asarray(req.kv_pages, dtype=np.int64)  # [num_blocks, L]
            block_tables[:, b, : len(pages)] = pages.T
            slot_mapping[:, t : t + n] = (pages[pos // bs] * bs + (pos % bs)[:, None]).T
            seq_lens[b] = s.start + n
            t += n
            query_start_loc[b + 1] = t
            if s.samples:
                logits_rows.append(t - 1)

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        return ForwardBatch(
            input_ids=dev(input_ids),
            positions=dev(positions),
            query_start_loc=dev(query_start_loc),
            seq_lens=dev(seq_lens),
            block_tables=dev(block_tables),
            slot_mapping=dev(slot_mapping),
            logits_indices=dev(np.asarray(logits_rows, dtype=np.int64)),
            max_query_len=max(s.num_new_tokens for s in sched.scheduled),
            max_seq_len=int(seq_lens.max()),
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[int]:
        """Runs one step; returns the sampled token of each scheduled request that samples, in order."""
        batch = self.prepare(sched)
        hidden = self.model(batch)  # [T, d]
        sampling = [s.request for s in sched.scheduled if s.samples]
        if not sampling:
            return []
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [B', V] float32
        tokens = self.sampler(logits, [r.params for r in sampling], [r.generator for r in sampling])
        return tokens.tolist()


def _token_slice(req: Request, start: int, end: int) -> list[int]:
    p = len(req.prompt_token_ids)
    if start >= p:
        return req.output_token_ids[start - p : end - p]
    if end <= p:
        return req.prompt_token_ids[start:end]
    return req.prompt_token_ids[start:] + req.output_token_ids[: end - p]
