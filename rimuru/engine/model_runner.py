"""Turns a SchedulerOutput into tensors, runs the model, samples.

The runner never decides allocation: it reads the pages the scheduler gave each request; nor does it know
how experts are found (the model's expert provider, set up by the expert runtime).

Batch layout (all scheduled requests flattened, prefill chunks and decodes mixed):
    tokens     | r0: start0 .. start0+n0-1 | r1: ... | ...        T = sum(n_i) rows
    block_tables[l, b, j] = page of block j of request b in attention layer l (0-padded)
    slot_mapping[l, t]   = page * block_size + position % block_size for token row t in layer l
    ssm_pages[k, b], conv_pages[k, b] = state pages of request b in linear-attention layer k (hybrid models;
                           -1 for padding rows)

A hybrid model's batch puts its single-token sequences (decodes) first, in scheduled order, then the others:
its linear-attention layers decode rows 0..D-1 in place with the paged kernels and run the chunk form over the
rows after them (models/state_cache.py, `StepLayout`). The sampled rows (logits_indices) stay in scheduled order.

Host work per step is kept flat: one Python pass over the scheduled requests collects their numbers,
everything else is a few whole-batch numpy operations. Each request's pages are kept as an int32
[num_blocks, L] array that grows with `Request.kv_pages` (which only ever grows, or is replaced by a new
list when the request's pages are freed), so a long context is not re-read from Python lists every step.
On a GPU all inputs travel in ONE host->device copy (`InputStager`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rimuru.engine.cuda_graphs import StepGraphs
from rimuru.engine.kv_compaction import KVMoves
from rimuru.engine.logprobs import LogprobRows, TokenLogprobs, compute_logprobs, logprob_rows, unpack_logprobs
from rimuru.engine.penalties import PenaltyHistory
from rimuru.engine.prompt_logprobs import (
    PromptLogprobRows,
    compute_prompt_logprobs,
    follow_prompt_logits,
    prompt_logprob_rows,
    unpack_prompt_logprobs,
)
from rimuru.engine.request import Request
from rimuru.engine.sampler import Sampler, logit_edits
from rimuru.engine.scheduler import ScheduledRequest, SchedulerOutput
from rimuru.engine.state_cache_manager import StateCopy
from rimuru.engine.step_profiler import StepTrace
from rimuru.kernels.paged_attention import q_tile_starts, tile_map_block_q
from rimuru.memory.host_wait import wait_for
from rimuru.models.causal_lm import MoECausalLM
from rimuru.models.forward_batch import ForwardBatch, StepLayout

_ALIGN = 16  # bytes: every packed field starts at a multiple (int64 views need 8)
KV_COPY_CHUNK = 64  # KV pages a compaction copy gathers at once (8 MB of Qwen1.5-MoE pages)
_TORCH_DTYPE = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


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
    num_sampled: int = 0  # real sampled rows (logits_indices may be padded past them)
    q_tile_start: np.ndarray | None = None  # [B+1] int32, mixed graphs only
    # async scheduling: input rows whose token the previous step sampled and nobody has read yet (input_ids
    # holds 0 there), and each one's row in that step's sampled tokens; the runner fills them on the device (every
    # tensor-parallel rank from its copy of those tokens)
    pending_rows: list[int] | None = None
    pending_src: list[int] | None = None
    # hybrid models: [L_lin, B] int64 state page ids (models/state_cache.py), None for the others
    ssm_pages: np.ndarray | None = None
    conv_pages: np.ndarray | None = None
    layout: StepLayout | None = None  # hybrid models: the real rows' split (decodes first)
    # prompt logprobs (engine/prompt_logprobs.py): [R] int64 hidden rows the LM head runs over after the sampled
    # rows; not a device input of the pass (tensor parallelism sends it beside the arrays)
    prompt_rows: np.ndarray | None = None

    def fields(self) -> list[np.ndarray]:
        """The arrays the device gets, in order: the seven of every batch, q_tile_start (mixed graphs), then the
        state page ids (hybrid models)."""
        out = [self.input_ids, self.positions, self.query_start_loc, self.seq_lens, self.block_tables,
               self.slot_mapping, self.logits_indices]
        if self.q_tile_start is not None:
            out.append(self.q_tile_start)
        if self.ssm_pages is not None and self.conv_pages is not None:
            out += [self.ssm_pages, self.conv_pages]
        return out


class InputStager:
    """Packs host arrays into one (pinned, on a GPU) buffer and sends them with ONE non-blocking copy;
    returns device tensors viewing the copy. Two host buffers alternate; a buffer is refilled only after
    the copy that last read it has completed (its event), so the host never overwrites bytes in flight."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._host: list[torch.Tensor | None] = [None, None]
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def _buffer(self, nbytes: int) -> tuple[int, torch.Tensor]:
        i = self._turn
        self._turn ^= 1
        done = self._done[i]
        if done is not None:
            wait_for(done)  # the copy of two steps ago: long finished in a running loop
        buf = self._host[i]
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, 2 * (buf.numel() if buf is not None else 0), 1 << 16)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)
            self._host[i] = buf
        return i, buf

    def stage(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        i, host = self._buffer(total)
        raw = host.numpy()
        for a, off in zip(arrays, offsets, strict=True):
            raw[off : off + a.nbytes].view(a.dtype)[:] = a.reshape(-1)
        dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        dev.copy_(host[:total], non_blocking=True)
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
            self._done[i] = done
        return [dev[off : off + a.nbytes].view(_TORCH_DTYPE[a.dtype]).view(a.shape)
                for a, off in zip(arrays, offsets, strict=True)]


class SampledTokens:
    """A launched step's sampled tokens on their way to the host: one non-blocking copy into pinned memory
    and an event, so reading them (`tolist`, the step's one device->host wait) can come after the next
    step has been launched. Rows that asked for logprobs bring their packed logprobs (engine/logprobs.py), and
    prompt chunks that asked for prompt logprobs theirs (engine/prompt_logprobs.py), in more non-blocking copies
    behind the same event: the same single wait reads them all."""

    def __init__(self, tokens: torch.Tensor | None, device: torch.device, trace: StepTrace,
                 logprobs: tuple[torch.Tensor, LogprobRows] | None = None,
                 prompt: tuple[torch.Tensor, PromptLogprobRows] | None = None) -> None:
        self._trace = trace
        self._event: torch.cuda.Event | None = None
        self._rows = None if logprobs is None else logprobs[1]
        self._logprobs = None if logprobs is None else logprobs[0]
        self._prompt_rows = None if prompt is None else prompt[1]
        self._prompt = None if prompt is None else prompt[0]
        self._host = tokens
        if device.type == "cuda" and (tokens is not None or prompt is not None):
            self._host = None if tokens is None else _to_pinned(tokens)
            if self._logprobs is not None:
                self._logprobs = _to_pinned(self._logprobs)
            if self._prompt is not None:
                self._prompt = _to_pinned(self._prompt)
            self._event = torch.cuda.Event()
            self._event.record()

    def tolist(self) -> list[int]:
        if self._event is not None:
            wait_for(self._event)
        if self._host is None:
            return []
        out = self._host.tolist()
        self._trace.mark("readback")
        return out

    def prompt_logprobs(self) -> dict[int, tuple[int, list[TokenLogprobs]]] | None:
        """By scheduled index, the step's prompt logprobs (engine/prompt_logprobs.py), read after `tolist`; None when
        no chunk asked."""
        if self._prompt is None or self._prompt_rows is None:
            return None
        if self._event is not None:
            wait_for(self._event)  # already passed in `tolist`
        return unpack_prompt_logprobs(self._prompt, self._prompt_rows)

    def logprobs(self) -> list[TokenLogprobs | None] | None:
        """Each sampled row's logprobs (None: the row did not ask), read after `tolist`; None when no row asked."""
        if self._logprobs is None or self._rows is None:
            return None
        if self._event is not None:
            wait_for(self._event)  # already passed in `tolist`: no second wait
        return unpack_logprobs(self._logprobs, self._rows)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass(frozen=True)
class GraphStep:
    """Which captured graph a pass replays, as rank 0 chose it, for the other tensor-parallel ranks to replay the
    same one: every rank captured the same ladders in the same order, so the collectives inside pair up. The
    pass's host arrays are already padded to the graph's size."""

    kind: str  # "decode" | "mixed"
    num_rows: int  # decode: the real sequences; mixed: the sampled rows
    layout: StepLayout | None = None  # a hybrid model's mixed step: its eager stretches' split (single-prefill choice)


# Tensor parallelism, rank 0: each pass to the other ranks before running it (engine/tp_workers.py): the batch's host
# arrays, whether it samples, the state copies and KV moves queued before it, and the graph it replays (None: eager)
PassSender = Callable[[HostBatch, bool, list[StateCopy], KVMoves | None, GraphStep | None], None]


class ModelRunner:
    def __init__(self, model: MoECausalLM, device: torch.device, num_attention_layers: int,
                 block_size: int, sampler: Sampler, *, num_linear_layers: int = 0,
                 peers: PassSender | None = None) -> None:
        self.model = model
        self.peers = peers
        # tensor parallelism with async scheduling: rank 0's sampled tokens to every rank (a device broadcast in
        # place: the other ranks' tensors receive), for the next pass's pending rows
        self.share_sampled_tokens: Callable[[torch.Tensor], object] | None = None
        self.device = device
        self.num_layers = num_attention_layers
        self.num_linear_layers = num_linear_layers  # hybrid models: linear-attention layers, each with state pages
        self.block_size = block_size
        self.sampler = sampler
        self.penalties = PenaltyHistory(device)  # the penalised requests' token histories (engine/penalties.py)
        self.graphs: StepGraphs | None = None  # set by use_cuda_graphs()
        self.graph_steps = 0  # steps replayed from a CUDA graph (decode or mixed)
        self.mixed_graph_steps = 0
        self.stager = InputStager(device) if device.type == "cuda" else None
        # the last launch's sampled tokens (device) and each sampling request's row in them, by seq_id (a
        # tensor-parallel follower's: rank 0's tokens, with no index; the plans name the rows)
        self._last_sampled: tuple[torch.Tensor, dict[int, int]] | None = None
        # request -> (its kv_pages list, int32 [capacity, L] pages, blocks filled): the pages as an array
        self._pages: dict[Request, tuple[list[list[int]], np.ndarray, int]] = {}

    def use_cuda_graphs(self, graphs: StepGraphs) -> None:
        """Steps that fit a captured graph replay it from now on (engine/cuda_graphs.py)."""
        self.graphs = graphs

    @functools.cached_property
    def q_block(self) -> int:
        """Query tokens per q tile of the mixed graphs' attention launch."""
        spec = self.model.spec
        return tile_map_block_q(spec.num_attention_heads, spec.num_key_value_heads,
                                next(self.model.parameters()).element_size())

    def step_kind(self, sched: SchedulerOutput) -> str:
        """decode-graph | decode-eager | mixed-graph | prefill-graph | prefill | mixed | idle (the step profiler's
        kinds)."""
        if sched.is_empty:
            return "idle"
        graphs = self.graphs
        decodes = sum(1 for s in sched.scheduled if s.num_new_tokens == 1 and s.samples)
        if decodes == len(sched.scheduled):
            return "decode-graph" if graphs is not None and graphs.can_run(sched) else "decode-eager"
        kind = "mixed" if decodes else "prefill"
        return f"{kind}-graph" if graphs is not None and graphs.can_run_mixed(sched) else kind

    # ---- host arrays ---------------------------------------------------------------------------------
    def _page_array(self, req: Request, cache: dict[Request, tuple[list[list[int]], np.ndarray, int]]) -> np.ndarray:
        """`req.kv_pages` as int32 [num_blocks, L], extended from the previous step's array when possible."""
        kv = req.kv_pages
        nb = len(kv)
        entry = self._pages.get(req)
        if entry is not None and entry[0] is kv and entry[2] <= nb:
            _, arr, filled = entry
            if nb > filled:
                if nb > arr.shape[0]:
                    grown = np.empty((max(nb, 2 * arr.shape[0]), self.num_layers), dtype=np.int32)
                    grown[:filled] = arr[:filled]
                    arr = grown
                arr[filled:nb] = kv[filled:nb]
        else:
            arr = self._new_page_array(kv)
        cache[req] = (kv, arr, nb)
        return arr[:nb]

    def _new_page_array(self, rows: list[list[int]] | np.ndarray) -> np.ndarray:
        """int32 [capacity, L] holding `rows` ([num_blocks, L]) in its first rows, room to grow after them."""
        arr = np.empty((max(len(rows), 4), self.num_layers), dtype=np.int32)
        arr[: len(rows)] = rows
        return arr

    def page_grid(self, req: Request) -> np.ndarray | None:
        """`req.kv_pages` as the int32 array the last launch built, if it is still the request's grid (else None)."""
        entry = self._pages.get(req)
        if entry is None or entry[0] is not req.kv_pages or entry[2] != len(req.kv_pages):
            return None
        return entry[1][: entry[2]]

    def grid_renamed(self, req: Request, grid: np.ndarray) -> None:
        """KV compaction replaced `req.kv_pages` by `grid`'s pages: the next launch takes this array instead of
        converting the new list (on the launch's host chain)."""
        self._pages[req] = (req.kv_pages, self._new_page_array(grid), len(grid))

    def batch_order(self, scheduled: Sequence[ScheduledRequest]) -> list[int] | None:
        """A hybrid model's batch order where a step mixes prefill chunks and decodes: the single-token sequences first
        (their DeltaNet layers take the paged decode kernels over rows 0..D-1), scheduled order kept within each
        group; None where the batch keeps scheduled order (every other model, and steps of one kind)."""
        if self.num_linear_layers and any(s.num_new_tokens > 1 for s in scheduled):
            return sorted(range(len(scheduled)), key=lambda i: scheduled[i].num_new_tokens > 1)  # stable
        return None

    def host_arrays(self, sched: SchedulerOutput, pad_to: int | None = None, pad_tokens: int | None = None,
                    pad_seqs: int | None = None) -> HostBatch:
        """The batch as numpy arrays (shared by the eager path and the CUDA-graph paths).

        `pad_to` (decode graphs): rows B..pad_to-1 are padding: token 0 at position 0, a one-token context on
        page 0 (block-table row 0) and slot -1 (no KV write); logits_indices keeps the B real rows.
        `pad_tokens` + `pad_seqs` (mixed graphs): token rows T..pad_tokens-1 are padding (token 0, position 0,
        slot -1) owned by no sequence; sequences B..pad_seqs-1 are empty (q_len 0, context 0); logits_indices
        is padded with row 0 to pad_seqs entries; q_tile_start is set. Block tables keep the B real rows."""
        bs, L = self.block_size, self.num_layers
        scheduled = sched.scheduled
        B = len(scheduled)
        order = self.batch_order(scheduled)  # hybrid models: batch row b holds scheduled[order[b]]
        if order is not None:
            scheduled = [scheduled[i] for i in order]
        starts_l, ns_l, samples_l, tokens = [], [], [], []
        cache: dict[Request, tuple[list[list[int]], np.ndarray, int]] = {}
        pages = []
        pending_rows: list[int] | None = None
        pending_src: list[int] = []
        sampled_row = self._last_sampled[1] if self._last_sampled is not None else {}
        for s in scheduled:
            req, start, n = s.request, s.start, s.num_new_tokens
            starts_l.append(start)
            ns_l.append(n)
            samples_l.append(s.samples)
            p = len(req.prompt_token_ids)
            if start >= p:
                known = req.output_token_ids[start - p : start - p + n]
                tokens += known
                if len(known) < n:  # the last row is the token the step in flight sampled
                    assert len(known) == n - 1 and req.num_pending_tokens >= 1, (req.request_id, start, n)
                    pending_rows = pending_rows if pending_rows is not None else []
                    pending_rows.append(len(tokens))
                    pending_src.append(sampled_row[req.seq_id])  # KeyError: the last launch did not sample it
                    tokens.append(0)
            else:
                tokens += _token_slice(req, start, start + n)
            pages.append(self._page_array(req, cache))
        self._pages = cache  # requests not scheduled this step are dropped (rebuilt if they come back)

        mixed = pad_tokens is not None
        Bp = pad_to if pad_to is not None else B
        starts = np.array(starts_l, dtype=np.int64)
        ns = np.array(ns_l, dtype=np.int64)
        T = len(tokens)
        Tp = pad_tokens if mixed else T + (Bp - B)  # decode padding rows are one token each
        input_ids = np.zeros(Tp, dtype=np.int64)
        input_ids[:T] = tokens
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(ns, out=qsl[1:])
        tok_row = np.repeat(np.arange(B), ns)  # [T] request of each token
        positions = np.zeros(Tp, dtype=np.int64)
        positions[:T] = np.arange(T, dtype=np.int64) - (qsl[:-1] - starts)[tok_row]
        seq_lens = np.ones(Bp, dtype=np.int32)
        seq_lens[:B] = starts + ns

        nbs = np.fromiter((len(p) for p in pages), dtype=np.int64, count=B)
        flat = np.concatenate(pages) if B > 1 else pages[0]  # [sum nb, L] int32
        blk0 = np.zeros(B, dtype=np.int64)
        np.cumsum(nbs[:-1], out=blk0[1:])
        block_tables = np.zeros((L, Bp, int(nbs.max())), dtype=np.int32)
        blk_row = np.repeat(np.arange(B), nbs)
        block_tables[:, blk_row, np.arange(len(flat)) - blk0[blk_row]] = flat.T
        slot_mapping = np.full((L, Tp), -1, dtype=np.int64)
        slot_mapping[:, :T] = (flat[blk0[tok_row] + positions[:T] // bs].T.astype(np.int64) * bs
                               + positions[:T] % bs)
        if any(s.num_cached_writes for s in scheduled):  # a full prefix hit: its shared page holds that KV already
            skip = starts + np.fromiter((s.num_cached_writes for s in scheduled), dtype=np.int64, count=B)
            slot_mapping[:, :T][:, positions[:T] < skip[tok_row]] = -1
        query_start_loc = qsl.astype(np.int32)
        if Bp > B:  # padding rows: one token each
            query_start_loc = np.concatenate([query_start_loc, T + np.arange(1, Bp - B + 1, dtype=np.int32)])
        last_rows = qsl[1:] - 1  # [B] by batch row
        if order is not None:  # back to scheduled order: the sampler's rows are the sampling requests' in that order
            by_sched = np.empty(B, dtype=np.int64)
            by_sched[np.array(order)] = last_rows
            last_rows = by_sched
            samples_l = [s.samples for s in sched.scheduled]
        logits_indices = last_rows[np.array(samples_l, dtype=bool)]
        num_sampled = len(logits_indices)
        q_tile_start = None
        if mixed:
            S = pad_seqs if pad_seqs is not None else B
            seq_lens = np.concatenate([seq_lens, np.zeros(S - B, dtype=np.int32)])
            query_start_loc = np.concatenate([query_start_loc, np.full(S - B, T, dtype=np.int32)])
            logits_indices = np.concatenate([logits_indices, np.zeros(S - num_sampled, dtype=np.int64)])
            q_tile_start = q_tile_starts(ns, self.q_block, S)
        ssm_pages = conv_pages = layout = None
        if self.num_linear_layers:
            ssm_pages, conv_pages = self._state_pages(scheduled, pad_seqs if mixed and pad_seqs is not None else Bp)
            layout = StepLayout.of(ns_l)
        return HostBatch(input_ids=input_ids, positions=positions, query_start_loc=query_start_loc,
                         seq_lens=seq_lens, block_tables=block_tables, slot_mapping=slot_mapping,
                         logits_indices=logits_indices, max_query_len=max(ns_l), num_sampled=num_sampled,
                         q_tile_start=q_tile_start, pending_rows=pending_rows,
                         pending_src=pending_src if pending_rows is not None else None,
                         ssm_pages=ssm_pages, conv_pages=conv_pages, layout=layout)

    def _state_pages(self, scheduled: list[ScheduledRequest], num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """[L_lin, num_rows] int64 ssm and conv page ids of the scheduled requests; -1 in padding rows."""
        ssm = np.full((self.num_linear_layers, num_rows), -1, dtype=np.int64)
        conv = np.full((self.num_linear_layers, num_rows), -1, dtype=np.int64)
        for b, s in enumerate(scheduled):
            req = s.request
            assert len(req.ssm_pages) == self.num_linear_layers, (req.request_id, "scheduled without state pages")
            ssm[:, b] = req.ssm_pages
            conv[:, b] = req.conv_pages
        return ssm, conv

    def to_device(self, h: HostBatch) -> list[torch.Tensor]:
        """The HostBatch fields (in `HostBatch.fields()` order) as device tensors: zero-copy views on the CPU,
        one packed copy on a GPU."""
        if self.stager is None:
            return [torch.from_numpy(a) for a in h.fields()]
        return self.stager.stage(h.fields())

    def prepare(self, sched: SchedulerOutput) -> ForwardBatch:
        return self.device_batch(self.host_arrays(sched))

    def device_batch(self, h: HostBatch) -> ForwardBatch:
        """An eager pass's batch (no padding): a hybrid model's carries its layout (StepLayout)."""
        ids, pos, qsl, seq_lens, bt, slots, li, *state = self.to_device(h)
        self._fill_pending(ids, h)
        ssm_pages, conv_pages = state if state else (None, None)
        layout = h.layout
        if layout is None and ssm_pages is not None:  # a tensor-parallel follower's arrays: from the row counts
            layout = StepLayout.of(np.diff(h.query_start_loc).tolist())
        return ForwardBatch(input_ids=ids, positions=pos, query_start_loc=qsl, seq_lens=seq_lens, block_tables=bt,
                            slot_mapping=slots, logits_indices=li, max_query_len=h.max_query_len,
                            max_seq_len=int(h.seq_lens.max()), ssm_pages=ssm_pages, conv_pages=conv_pages,
                            layout=layout)

    @torch.inference_mode()
    def copy_states(self, copies: list[StateCopy]) -> None:
        """Prefix caching of a hybrid model: whole states copied page to page (a request's into a snapshot, or a
        snapshot into a request's), queued before the pass on the stream that runs it."""
        state_cache = self.model.state_cache
        assert state_cache is not None
        for copy in copies:
            state_cache.copy(*copy)

    @torch.inference_mode()
    def copy_kv(self, moves: KVMoves) -> None:
        """KV compaction: pages' bytes to their new pages, queued before the pass on the stream that runs it (after the
        pass in flight, which may still write the sources)."""
        kv = self.model.kv_cache
        src = torch.from_numpy(moves.src).to(kv.device)
        dst = torch.from_numpy(moves.dst).to(kv.device)
        # in chunks: the gathered pages are a temporary outside the measured workspace (no destination is a source,
        # so the order of the chunks does not matter)
        for i in range(0, len(moves), KV_COPY_CHUNK):
            kv.index_copy_(0, dst[i : i + KV_COPY_CHUNK], kv.index_select(0, src[i : i + KV_COPY_CHUNK]))

    def follow(self, arrays: list[np.ndarray], max_query_len: int, sample: bool,
               state_copies: list[StateCopy] | None = None, prompt_rows: np.ndarray | None = None,
               kv_moves: KVMoves | None = None, graph: GraphStep | None = None,
               pending: tuple[list[int], list[int]] | None = None) -> torch.Tensor | None:
        """Tensor parallelism, ranks > 0: rank 0's pass over this rank's shard (its logits are rank 0's to sample, its
        prompt rows' logits rank 0's to turn into prompt logprobs), after the state copies and KV moves rank 0 queued
        before it (the same page ids in every rank's pool); replayed from the graph rank 0 replayed, or eager.
        Async scheduling: `pending` rows take tokens from this rank's copy of the previous pass's sampled ones, and
        a sampling pass's come from rank 0 at its end (`share_sampled_tokens`), in the order rank 0's launch makes
        its collectives. Returns the pass's logits (this rank's copy of the gathered ones; None
        where it samples nothing)."""
        if state_copies:
            self.copy_states(state_copies)
        if kv_moves is not None:
            self.copy_kv(kv_moves)
        ids, pos, qsl, seq_lens, bt, slots, li, *rest = arrays
        qts = rest.pop(0) if graph is not None and graph.kind == "mixed" else None
        ssm, conv = rest if rest else (None, None)
        h = HostBatch(input_ids=ids, positions=pos, query_start_loc=qsl, seq_lens=seq_lens, block_tables=bt,
                      slot_mapping=slots, logits_indices=li, max_query_len=max_query_len, q_tile_start=qts,
                      pending_rows=pending[0] if pending is not None else None,
                      pending_src=pending[1] if pending is not None else None,
                      ssm_pages=ssm, conv_pages=conv, layout=graph.layout if graph is not None else None)
        logits: torch.Tensor | None
        hidden: torch.Tensor | None = None  # where prompt rows are read
        if graph is not None:
            if self.graphs is None:
                raise RuntimeError("rank 0 replayed a CUDA graph but this rank captured none")
            tensors = self.to_device(h)
            self._fill_pending(tensors[0], h)
            if graph.kind == "decode":
                logits = self._replay_decode(graph.num_rows, tensors)
            else:
                h.num_sampled = graph.num_rows
                logits = self._replay_mixed(h, tensors)
                hidden = self.graphs.mixed_hidden() if prompt_rows is not None else None
        else:
            batch = self.device_batch(h)
            hidden = self.model(batch)  # [T, d]
            logits = self.model.compute_logits(hidden[batch.logits_indices]) if sample else None
        if prompt_rows is not None:
            follow_prompt_logits(self.model.compute_logits, hidden, prompt_rows)
        self._last_sampled = None
        if sample and self.share_sampled_tokens is not None:  # rank 0 shares every sampling pass's, as its launch
            assert logits is not None
            tokens = torch.empty(logits.shape[0], dtype=torch.long, device=self.device)
            self.share_sampled_tokens(tokens)  # rank 0's, into this rank's copy
            self._last_sampled = (tokens, {})
        return logits

    def _replay_decode(self, num_seqs: int, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The decode graph of the padded batch `tensors` (to_device of host_arrays(pad_to=Bp)): logits
        [num_seqs, V]."""
        assert self.graphs is not None
        ids, pos, _, seq_lens, bt, slots, _, *state = tensors
        ssm_pages, conv_pages = state if state else (None, None)  # a hybrid's state page ids: -1 in the padding rows
        return self.graphs.run(num_seqs, ids, pos, seq_lens, bt, slots, ssm_pages, conv_pages)

    def _replay_mixed(self, h: HostBatch, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The mixed graph of the padded batch `tensors` (to_device of host_arrays(pad_tokens=, pad_seqs=)): logits
        [h.num_sampled, V]; a hybrid's state page ids (-1 past the real sequences) and layout go to its graphs'
        eager stretches."""
        assert self.graphs is not None
        ids, pos, qsl, seq_lens, bt, slots, li, qts, *state = tensors
        ssm_pages, conv_pages = state if state else (None, None)
        return self.graphs.run_mixed(h.num_sampled, ids, pos, qsl, seq_lens, bt, slots, li, qts, ssm_pages,
                                     conv_pages, h.layout if ssm_pages is not None else None)

    # ---- the step --------------------------------------------------------------------------------------
    def _fill_pending(self, input_ids: torch.Tensor, h: HostBatch) -> None:
        """Async scheduling: input rows of tokens sampled by the previous launch, copied on the device."""
        if h.pending_rows is None:
            return
        last = self._last_sampled
        assert last is not None and h.pending_src is not None, "a pending token without a launched step"
        tokens = last[0]
        idx = torch.tensor([h.pending_rows, h.pending_src], dtype=torch.int64)
        if self.device.type == "cuda":
            idx = idx.pin_memory().to(self.device, non_blocking=True)
        input_ids.index_copy_(0, idx[0], tokens.index_select(0, idx[1]))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, trace: StepTrace) -> SampledTokens:
        """Queues one step on the device and returns its sampled tokens, to be read later (`tolist()`): the
        host may schedule and launch the next step meanwhile (async scheduling). Rows of tokens that the
        previous launch sampled are filled on the device from its output."""
        sampling = [s.request for s in sched.scheduled if s.samples]
        if sched.state_copies:  # prefix caching's state snapshots, behind the last pass on the same stream
            self.copy_states(sched.state_copies)
        if sched.kv_moves is not None:  # KV compaction, likewise
            self.copy_kv(sched.kv_moves)
        prompt = prompt_logprob_rows(sched.scheduled, self.model.spec.vocab_size, self.batch_order)
        hidden = None  # the pass's hidden states, where prompt rows are read (eager passes, mixed graphs)
        graphs = self.graphs
        if graphs is not None and graphs.can_run(sched):
            assert prompt is None, "a decode step has no prompt rows: each of its rows samples"
            B = len(sched.scheduled)
            h = self.host_arrays(sched, pad_to=graphs.padded_size(B))
            if self.peers is not None:
                self.peers(h, True, sched.state_copies, sched.kv_moves, GraphStep("decode", B))
            tensors = self.to_device(h)
            self._fill_pending(tensors[0], h)
            trace.mark("prepare")
            trace.forward_begin()
            logits = self._replay_decode(B, tensors)
            self.graph_steps += 1
        elif graphs is not None and graphs.can_run_mixed(sched):
            h = self.host_arrays(sched, pad_tokens=graphs.padded_tokens(sched.num_tokens), pad_seqs=graphs.max_seqs)
            if prompt is not None:
                h.prompt_rows = prompt.hidden_rows
            if self.peers is not None:
                self.peers(h, bool(sampling), sched.state_copies, sched.kv_moves,
                           GraphStep("mixed", h.num_sampled, h.layout if h.ssm_pages is not None else None))
            tensors = self.to_device(h)
            self._fill_pending(tensors[0], h)
            trace.mark("prepare")
            trace.forward_begin()
            logits = self._replay_mixed(h, tensors)
            if prompt is not None:
                hidden = graphs.mixed_hidden()  # valid until the next replay: read below, in this launch
            self.graph_steps += 1
            self.mixed_graph_steps += 1
        else:
            h = self.host_arrays(sched)
            if prompt is not None:
                h.prompt_rows = prompt.hidden_rows
            if self.peers is not None:
                self.peers(h, bool(sampling), sched.state_copies, sched.kv_moves, None)
            batch = self.device_batch(h)
            trace.mark("prepare")
            trace.forward_begin()
            hidden = self.model(batch)  # [T, d]
            # [B', V] float32 logits of the sampled rows; a step that samples nothing (prefill chunks) needs none
            logits = self.model.compute_logits(hidden[batch.logits_indices]) if sampling else None
        trace.forward_end()
        trace.mark("forward")
        if not sampling:
            self._last_sampled = None
            packed = None if prompt is None else (self._prompt_logprobs(hidden, prompt), prompt)
            return SampledTokens(None, self.device, trace, prompt=packed)
        params = [r.params for r in sampling]
        penalties = self.penalties.prepare(sampling, logits.shape[-1], self._last_sampled)
        tokens = self.sampler(logits, params, [r.generator for r in sampling],
                              logit_edits(sampling, logits.shape[-1], logits.device), penalties)
        self._last_sampled = (tokens, {r.seq_id: i for i, r in enumerate(sampling)})
        # the raw logits (the sampler never writes them; a graph's logits_out is not replayed before this)
        asked = logprob_rows([p.logprobs for p in params], logits.shape[-1])
        logprobs = None if asked is None else (compute_logprobs(logits, tokens, asked), asked)
        # after the sampler: the prompt rows' chunks reuse its working set
        packed = None if prompt is None else (self._prompt_logprobs(hidden, prompt), prompt)
        if self.share_sampled_tokens is not None:  # the pass's last collective, as in `follow`
            self.share_sampled_tokens(tokens)
        out = SampledTokens(tokens, self.device, trace, logprobs, packed)
        trace.mark("sample")
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor | None, sel: PromptLogprobRows) -> torch.Tensor:
        assert hidden is not None, "prompt rows in a pass whose hidden states are not kept"
        return compute_prompt_logprobs(self.model.compute_logits, hidden, sel)


def _token_slice(req: Request, start: int, end: int) -> list[int]:
    p = len(req.prompt_token_ids)
    if start >= p:
        return req.output_token_ids[start - p : end - p]
    if end <= p:
        return req.prompt_token_ids[start:end]
    return req.prompt_token_ids[start:] + req.output_token_ids[: end - p]
