"""Turns a SchedulerOutput into tensors, runs the model, samples.

The runner never decides allocation: it reads the pages the scheduler gave each request.

Batch layout (all scheduled requests flattened, prefill chunks and decodes mixed):
    tokens     | r0: start0 .. start0+n0-1 | r1: ... | ...        T = sum(n_i) rows
    block_tables[l, b, j] = page of block j of request b in attention layer l (0-padded)
    slot_mapping[l, t]   = page * block_size + position % block_size for token row t in layer l
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rimuru.engine.cuda_graphs import DecodeGraphs
from rimuru.engine.request import Request
from rimuru.engine.sampler import Sampler
from rimuru.engine.scheduler import SchedulerOutput
from rimuru.models.forward_batch import ForwardBatch


@dataclass
class HostBatch:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [L, B, max_blocks] int32
    slot_mapping: np.ndarray  # [L, T] int64
    logits_indices: np.ndarray  # [B'] int64
    max_query_len: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, num_attention_layers: int,
                 block_size: int, sampler: Sampler) -> None:
        self.model = model
        self.device = device
        self.num_layers = num_attention_layers
        self.block_size = block_size
        self.sampler = sampler
        self.graphs: DecodeGraphs | None = None  # set by enable_cuda_graphs()
        self.graph_steps = 0

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        self.graphs = DecodeGraphs(self.model, self.device, self.num_layers, max_num_seqs, max_model_len,
                                   self.block_size)
        self.graphs.capture()

    def host_arrays(self, sched: SchedulerOutput) -> HostBatch:
        """The batch as numpy arrays (shared by the eager path and the CUDA-graph path)."""
        bs, L = self.block_size, self.num_layers
        B = len(sched.scheduled)
        T = sched.num_tokens
        h = HostBatch(
            input_ids=np.empty(T, dtype=np.int64),
            positions=np.empty(T, dtype=np.int64),
            query_start_loc=np.zeros(B + 1, dtype=np.int32),
            seq_lens=np.empty(B, dtype=np.int32),
            block_tables=np.zeros((L, B, max(len(s.request.kv_pages) for s in sched.scheduled)), dtype=np.int32),
            slot_mapping=np.empty((L, T), dtype=np.int64),
            logits_indices=np.empty(sum(s.samples for s in sched.scheduled), dtype=np.int64),
            max_query_len=max(s.num_new_tokens for s in sched.scheduled),
        )
        t = 0
        j = 0
        for b, s in enumerate(sched.scheduled):
            req, n = s.request, s.num_new_tokens
            h.input_ids[t : t + n] = _token_slice(req, s.start, s.start + n)
            pos = np.arange(s.start, s.start + n, dtype=np.int64)
            h.positions[t : t + n] = pos
            pages = np.asarray(req.kv_pages, dtype=np.int64)  # [num_blocks, L]
            h.block_tables[:, b, : len(pages)] = pages.T
            h.slot_mapping[:, t : t + n] = (pages[pos // bs] * bs + (pos % bs)[:, None]).T
            h.seq_lens[b] = s.start + n
            t += n
            h.query_start_loc[b + 1] = t
            if s.samples:
                h.logits_indices[j] = t - 1
                j += 1
        return h

    def prepare(self, sched: SchedulerOutput) -> ForwardBatch:
        h = self.host_arrays(sched)

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        return ForwardBatch(
            input_ids=dev(h.input_ids), positions=dev(h.positions), query_start_loc=dev(h.query_start_loc),
            seq_lens=dev(h.seq_lens), block_tables=dev(h.block_tables), slot_mapping=dev(h.slot_mapping),
            logits_indices=dev(h.logits_indices), max_query_len=h.max_query_len, max_seq_len=int(h.seq_lens.max()),
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[int]:
        """Runs one step; returns the sampled token of each scheduled request that samples, in order."""
        sampling = [s.request for s in sched.scheduled if s.samples]
        if self.graphs is not None and self.graphs.can_run(sched):
            h = self.host_arrays(sched)
            logits = self.graphs.run(h.input_ids, h.positions, h.seq_lens, h.block_tables, h.slot_mapping)
            self.graph_steps += 1
        else:
            batch = self.prepare(sched)
            hidden = self.model(batch)  # [T, d]
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
