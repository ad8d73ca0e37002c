"""CUDA graphs for decode steps: the whole forward pass plus the logits, replayed for a ladder of
padded batch sizes, so that a decode step costs one launch instead of hundreds.

Every per-step input lives in a static device buffer that the graphs read; a step's numbers arrive
on the device in the runner's one packed host->device copy, already padded up to the captured size Bp,
and are copied (device to device) into the first Bp rows:

    row b < B   : the request's token, position, context length, block-table row, slot
    row b >= B  : token 0, position 0, context 1, block-table row of page 0, slot -1 (no KV write)

Padded rows compute garbage that nobody reads (their logits are dropped). Page tables are read
through these buffers and expert tables through the provider's own [L_moe, E, 3] tensor, both
updated in place, so pages and experts may move between steps without invalidating any graph.
"""

from __future__ import annotations

import logging

import torch

from rimuru.engine.scheduler import SchedulerOutput
from rimuru.models.forward_batch import ForwardBatch

logger = logging.getLogger("rimuru")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (vLLM's ladder, shortened)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, device: torch.device, num_layers: int, max_num_seqs: int,
                 max_model_len: int, block_size: int) -> None:
        self.model = model
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.max_model_len = max_model_len
        self.max_blocks = max_blocks = -(-max_model_len // block_size)
        n, L = self.max_bs, num_layers
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # decode: one row each
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(L, n, max_blocks, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((L, n), -1, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:, :bs], slot_mapping=self.slot_mapping[:, :bs],
            logits_indices=self.logits_indices[:bs], max_query_len=1, max_seq_len=self.max_model_len,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
                batch = self.batch(bs)
                for _ in range(2):  # warm-up outside the graph: compiles kernels, settles allocations
                    self.model.compute_logits(self.model(batch))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.logits[bs] = self.model.compute_logits(self.model(batch))
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, sched: SchedulerOutput) -> bool:
        return (len(sched.scheduled) <= self.max_bs
                and all(s.num_new_tokens == 1 and s.samples for s in sched.scheduled)
                and max(len(s.request.kv_pages) for s in sched.scheduled) <= self.max_blocks)

    def padded_size(self, bs: int) -> int:
        return next(s for s in self.sizes if s >= bs)

    def run(self, num_seqs: int, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
            block_tables: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """One decode step of `num_seqs` requests, its inputs already on the device and padded to the captured
        size Bp (ModelRunner.host_arrays(pad_to=Bp)): [Bp], [Bp], [Bp], [L, Bp, nb], [L, Bp]. Copies them into
        the static buffers (device to device, no host sync), replays, returns logits [num_seqs, V]."""
        bp = input_ids.shape[0]
        if bp not in self.graphs:
            raise ValueError(f"no decode graph captured for {bp} rows (captured: {self.sizes})")
        nb = block_tables.shape[2]
        self.input_ids[:bp].copy_(input_ids)
        self.positions[:bp].copy_(positions)
        self.seq_lens[:bp].copy_(seq_lens)
        self.block_tables[:, :bp, :nb].copy_(block_tables)
        self.slot_mapping[:, :bp].copy_(slot_mapping)
        self.graphs[bp].replay()
        return self.logits[bp][:num_seqs]
