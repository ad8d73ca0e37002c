"""The per-request state of linear-attention layers in pool pages, and the one place that reads and writes it.

    ssm      [n_ssm_pages, Hv, dk, dv]       fp32         view of the pool's ssm pages (memory/pool.py ssm_view)
    conv     [n_conv_pages, conv_dim, K-1]   model dtype  view of the pool's conv pages (conv_view)
    batch.ssm_pages, batch.conv_pages  [L_lin, B] int64   page of sequence b in linear-attention layer l

L_lin counts linear-attention layers (indexed by their ordinal among them, as attention layers index block
tables). A request holds one ssm and one conv page per linear-attention layer from its admission until it ends
(engine/state_cache_manager.py). A pass gathers its sequences' states by page id, runs the layer, and scatters
the final states back into the same pages; a sequence with no context before this pass starts from zero,
SELECTED inside GatedDeltaNet (a page's previous bytes are garbage: another request's state, an expert's
weights, NaN), so what a fresh request's page held never matters. A page id < 0 is a padding row: it reads
page 0 (its state is not used) and writes nothing.

Three paths, picked per pass:

  * `decode` (`decodes_in_place`: a pure-decode pass, one token per sequence, on CUDA with Triton):
    GatedDeltaNet.decode_paged, whose conv and recurrent kernels read and write each sequence's state in its pages
    in place through the page ids (no gather, no scatter; the recurrent state's read and write of its [Hv, dk, dv]
    fp32 page is the whole memory cost of the step there).
  * `mixed` (`splits`: a pass with prefill rows where the paged kernels run, its StepLayout known on the host):
    the runner puts the single-token sequences first, so rows 0..D-1 are decodes and take the same paged decode
    kernels (`begin_pass` names their pages once per pass), and only the prefill sequences D..B-1 take the chunk
    form (`prefill_rows`), their rows num_decodes..T-1 contiguous, their states gathered and scattered by page id,
    in groups of a bounded state size (`PREFILL_STATE_GROUP_BYTES`).
    Every size is a host int of the layout (the longest prefill, the row ranges) and the pages of real sequences
    are never < 0, so nothing reads the device from the host; the offsets of the prefill rows are one int64 tensor
    per pass, so fla-core (whose chunk indices it derives from it on the host, cached by the tensor's identity)
    syncs in the first layer only.
  * the gather / scatter reference (the CPU's, and a batch without a layout): every sequence's states gathered
    (`read`), the layer, the final states scattered (`write`, whose padding-row test syncs the host).

CUDA graphs (engine/cuda_graphs.py): the decode path has no host sync and no data-dependent branch on the host
(launch grids depend on B and the shapes only; fresh sequences and padding rows are decided on the device from
`has_initial_state` and the page ids), so a pure-decode step of a hybrid model replays a decode graph: its batch
carries `ssm_pages` / `conv_pages` as static [L_lin, B_graph] buffers updated in place each step, -1 in padding rows
(the kernels neither read nor write their pages). A mixed step replays a piecewise graph over a static batch
(`ForwardBatch.padded`, no layout): `begin_pass` finds its decode rows on the device, `mixed` runs them inside the
pieces and, while capturing, cuts the pass (`capture`, a PassCut) where the prefill sequences' chunk form goes; a
replay runs `prefill_rows` there eagerly with the step's layout, on the static rows the pieces share
(`reserve_graph_rows`). No graph is captured where `in_place_decode` is off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from rimuru.kernels.triton_import import triton
from rimuru.models.forward_batch import ForwardBatch, StepLayout

if TYPE_CHECKING:
    from rimuru.models.gated_deltanet import GatedDeltaNet


class PassCut(Protocol):
    """What captures a pass as CUDA-graph pieces (engine/piecewise_graphs.py PieceCapture): `cut(run)` ends the
    piece being captured and begins the next; a replay calls `run(layout)` between the two, eagerly, with the
    layout of the step it serves."""

    @property
    def capturing(self) -> bool: ...

    def cut(self, run: Callable[[StepLayout | None], None]) -> None: ...


@dataclass
class _DecodeRows:
    """This pass's rows 0..n-1 that the paged decode kernels take: their state pages [L_lin, n] per kind, -1 where
    the row is not a decode (nothing read or written there), and whether each continues a state [n]."""

    n: int
    ssm: Tensor
    conv: Tensor
    has_state: Tensor


@dataclass
class _GraphRows:
    """Static rows a mixed step's graph pieces and eager stretches share (one set for every layer and every graph
    size: graphs never replay at once): each gated DeltaNet layer's projections, copied in by the piece before its
    cut, read by the stretch, and its output, written by both and read by the piece after."""

    mixed: Tensor  # [R, conv_dim] model dtype
    g: Tensor  # [R, Hv] fp32
    beta: Tensor  # [R, Hv] model dtype
    o: Tensor  # [R, Hv, dv] model dtype


@dataclass
class _SinglePrefill:
    """A graph's pass with exactly one prefill sequence (the single-prefill mixed graphs, engine/cuda_graphs.py),
    found on the device from its static batch: the first sequence of more than one row. Its rows sit in a window of
    the pass's W rows from its first: `read` [W] the rows to gather (clamped into the pass), `valid` [W] which are
    its own, `write` [W] where its outputs go (past it: the static rows' scratch row, which no pass reads)."""

    seq: Tensor  # [1] int64: its index among the batch's sequences
    length: Tensor  # [1] int64: its rows
    has_state: Tensor  # [1] bool: it continues a state
    read: Tensor
    valid: Tensor
    write: Tensor


# The chunk form of a pass's prefill sequences holds each one's initial and final recurrent state at once ([P, Hv,
# dk, dv] fp32 twice: 1 GiB for 256 fresh prompts at Qwen3.5-35B-A3B, which the start-up profile's largest step
# has). Sequences go through it in groups of at most this many bytes of ssm state, so that the workspace holds two
# groups' states, not every sequence's; a pass of fewer sequences runs as one group, as before.
PREFILL_STATE_GROUP_BYTES = 128 * 2**20


@dataclass
class _PrefillGroup:
    """Prefill sequences first..last-1 of a pass (indices among its prefills), owning its prefill rows
    row_start..row_end-1 (offsets from row num_decodes); their rows' offsets from row_start [n+1] int64, one tensor
    object for every layer of the pass (fla-core caches what it derives from it on the host by identity)."""

    first: int
    last: int
    row_start: int
    row_end: int
    max_len: int
    cu_seqlens: Tensor


@dataclass
class _PrefillSeqs:
    """The prefill sequences of one pass (layout.num_decodes .. num_seqs-1), from the batch's tensors: whether each
    continues a state [P], and the groups they go through the chunk form in."""

    layout: StepLayout
    batch: ForwardBatch
    has_state: Tensor
    groups: list[_PrefillGroup]


def prefill_groups(lens: tuple[int, ...], per_group: int) -> list[tuple[int, int, int, int, int]]:
    """(first, last, row_start, row_end, max_len) of consecutive groups of at most `per_group` sequences with these
    row counts."""
    out, row = [], 0
    for first in range(0, len(lens), per_group):
        part = lens[first : first + per_group]
        out.append((first, first + len(part), row, row + sum(part), max(part)))
        row += sum(part)
    return out


class LinearStateCache:
    def __init__(self, ssm: Tensor, conv: Tensor, in_place_decode: bool | None = None) -> None:
        if ssm.dim() != 4 or conv.dim() != 3:
            raise ValueError(f"ssm view must be [pages, Hv, dk, dv] and conv view [pages, conv_dim, K-1], got "
                             f"{tuple(ssm.shape)} and {tuple(conv.shape)}")
        self.ssm = ssm  # [n_ssm_pages, Hv, dk, dv] fp32
        self.conv = conv  # [n_conv_pages, conv_dim, K-1] model dtype
        # pure-decode passes through the paged kernels: by default on CUDA with Triton (the tests force it on the
        # CPU, where the kernels' dispatchers run their torch references, or Triton's interpreter when patched)
        self.in_place_decode = (ssm.is_cuda and triton is not None) if in_place_decode is None else in_place_decode
        self.capture: PassCut | None = None  # set while CUDA graphs of mixed steps are captured
        self.step_layout: StepLayout | None = None  # set while a graph's pass is run eagerly for a step (the CPU's)
        self._rows: _DecodeRows | None = None  # this pass's (begin_pass)
        self._graph_rows: _GraphRows | None = None  # reserve_graph_rows
        self._prefill: _PrefillSeqs | None = None  # the last pass's prefill sequences, by (layout, batch)
        # set while the single-prefill mixed graphs are captured: a graph's pass takes its one prefill sequence in a
        # static window inside the graph (`_single_prefill_rows`) instead of cutting at an eager stretch
        self.single_prefill = False
        self._single: _SinglePrefill | None = None  # this pass's (begin_pass)

    @staticmethod
    def _pages(batch: ForwardBatch, linear_idx: int) -> tuple[Tensor, Tensor]:
        if batch.ssm_pages is None or batch.conv_pages is None:
            raise ValueError("a hybrid model's batch needs ssm_pages and conv_pages for its linear-attention layers")
        ssm, conv = batch.ssm_pages[linear_idx], batch.conv_pages[linear_idx]  # [B] each
        if ssm.shape[0] != batch.num_seqs or conv.shape[0] != batch.num_seqs:
            raise ValueError(f"the batch names state pages for {ssm.shape[0]} / {conv.shape[0]} sequences, it has "
                             f"{batch.num_seqs}")
        return ssm, conv

    def read(self, linear_idx: int, batch: ForwardBatch) -> tuple[Tensor, Tensor]:
        """This pass's (conv [B, conv_dim, K-1], recurrent [B, Hv, dk, dv]) states of one layer: gathered copies."""
        ssm, conv = self._pages(batch, linear_idx)
        return self.conv[conv.clamp(min=0)], self.ssm[ssm.clamp(min=0)]

    def decodes_in_place(self, batch: ForwardBatch) -> bool:
        """True when this pass is pure decode (every sequence one token; host ints only, no sync) and the paged
        decode kernels run: the layer then calls `decode` instead of read -> forward -> write."""
        return self.in_place_decode and batch.max_query_len == 1 and batch.num_tokens == batch.num_seqs

    def splits(self, batch: ForwardBatch) -> bool:
        """True when a pass with prefill rows takes the split (`mixed`): the paged decode kernels run, and the batch's
        layout is known on the host (an eager pass) or comes with the replay (a CUDA graph's static batch)."""
        return self.in_place_decode and (batch.layout is not None or batch.padded)

    def begin_pass(self, batch: ForwardBatch) -> None:
        """Once per pass, before the first layer: which rows the paged decode kernels take in every layer. An eager
        pass's are its leading decodes (host ints); a graph's static batch finds them on the device (row t is a
        decode when the sequences before it are single tokens: query_start_loc[t] == t and [t + 1] == t + 1),
        among its first min(T, B) rows, so the graph's decode work is bounded by the batch's sequences."""
        self._rows = None
        self._single = None
        if not self.splits(batch) or self.decodes_in_place(batch):
            return
        ssm, conv = batch.ssm_pages, batch.conv_pages
        if ssm is None or conv is None:
            raise ValueError("a hybrid model's batch needs ssm_pages and conv_pages for its linear-attention layers")
        layout = batch.layout
        if layout is not None:
            d = layout.num_decodes
            if d:
                self._rows = _DecodeRows(d, ssm[:, :d], conv[:, :d], batch.seq_lens[:d] > 1)
            return
        n = min(batch.num_tokens, batch.num_seqs)
        qsl = batch.query_start_loc.long()
        t = torch.arange(n, device=qsl.device)
        decode = (qsl[:n] == t) & (qsl[1 : n + 1] == t + 1)  # [n]
        self._rows = _DecodeRows(n, torch.where(decode[None], ssm[:, :n], -1),
                                 torch.where(decode[None], conv[:, :n], -1), decode & (batch.seq_lens[:n] > 1))
        self._single = self._find_single_prefill(batch, qsl) if self.single_prefill else None

    def _find_single_prefill(self, batch: ForwardBatch, qsl: Tensor) -> _SinglePrefill:
        W = batch.num_tokens
        io = self._graph_rows
        if io is None or io.mixed.shape[0] <= W:
            raise RuntimeError(f"no static rows and scratch row reserved for a mixed graph of {W} rows")
        lens = qsl[1:] - qsl[:-1]  # [B]; the graph's padding sequences have none
        seq = (lens > 1).float().argmax().reshape(1)  # the first of more than one row (0 in a warm-up)
        start, length = qsl.index_select(0, seq), lens.index_select(0, seq)
        steps = torch.arange(W, device=qsl.device)
        valid = steps < length
        rows = start + steps
        return _SinglePrefill(seq=seq, length=length, has_state=batch.seq_lens.index_select(0, seq).long() > length,
                              read=rows.clamp(max=W - 1), valid=valid,
                              write=torch.where(valid, rows, io.o.shape[0] - 1))

    def _single_prefill_rows(self, layer: GatedDeltaNet, linear_idx: int, batch: ForwardBatch, mixed: Tensor,
                             g: Tensor, beta: Tensor) -> None:
        """The one prefill sequence of a graph's pass, all in static shapes (no host int of the step): its rows
        gathered into a window of W rows (zeros past it, and beta = g = 0, so the state passes them unchanged), its
        states read by page id (zero selected for a fresh one), the conv and delta rule (`window_core`), the outputs
        scattered to its rows and the final states written back. A warm-up or capture batch names no page (-1):
        page 0 is read and its own bytes written back."""
        sp, io = self._single, self._graph_rows
        assert sp is not None and io is not None
        ssm_id = batch.ssm_pages[linear_idx].index_select(0, sp.seq)  # type: ignore[index]
        conv_id = batch.conv_pages[linear_idx].index_select(0, sp.seq)  # type: ignore[index]
        named = ssm_id >= 0
        ssm_id, conv_id = ssm_id.clamp(min=0), conv_id.clamp(min=0)
        conv0, state0 = self._initial_states(conv_id, ssm_id, ~(sp.has_state & named))
        valid = sp.valid[:, None]
        window = [torch.where(valid, t.index_select(0, sp.read), 0) for t in (mixed, g, beta)]
        out, conv_f, state_f = layer.window_core(*window, conv0, state0, sp.length)
        io.o.index_copy_(0, sp.write, torch.where(valid[..., None], out, 0))
        conv_f = torch.where(named[:, None, None], conv_f.to(self.conv.dtype), self.conv.index_select(0, conv_id))
        state_f = torch.where(named[:, None, None, None], state_f.to(self.ssm.dtype), self.ssm.index_select(0, ssm_id))
        self._store_states(conv_id, ssm_id, conv_f, state_f)

    def _initial_states(self, conv_ids: Tensor, ssm_ids: Tensor, fresh: Tensor) -> tuple[Tensor, Tensor]:
        """The conv [n, conv_dim, K-1] and recurrent [n, Hv, dk, dv] states in these pages, gathered, a fresh
        sequence's selected as zero in the gathered copy itself (its page holds garbage; nothing is multiplied)."""
        return (self.conv.index_select(0, conv_ids).masked_fill_(fresh[:, None, None], 0),
                self.ssm.index_select(0, ssm_ids).masked_fill_(fresh[:, None, None, None], 0))

    def _store_states(self, conv_ids: Tensor, ssm_ids: Tensor, conv: Tensor, recurrent: Tensor) -> None:
        """Final states [n, ...] into these pages."""
        self.conv.index_copy_(0, conv_ids, conv.to(self.conv.dtype))
        self.ssm.index_copy_(0, ssm_ids, recurrent.to(self.ssm.dtype))

    def reserve_graph_rows(self, rows: int) -> None:
        """The static buffers of mixed-step graphs of up to `rows` token rows (engine/cuda_graphs.py, before capture):
        what a piece hands its layer's eager stretch and takes back. Without them a stretch's inputs would have to
        live in the graph pool, one set per layer."""
        _, conv_dim, _ = self.conv.shape
        _, hv, _, dv = self.ssm.shape
        dtype, dev = self.conv.dtype, self.conv.device
        rows += 1  # a scratch row past every graph's: where a single-prefill window's rows past its sequence go
        self._graph_rows = _GraphRows(mixed=torch.zeros(rows, conv_dim, dtype=dtype, device=dev),
                                      g=torch.zeros(rows, hv, dtype=torch.float32, device=dev),
                                      beta=torch.zeros(rows, hv, dtype=dtype, device=dev),
                                      o=torch.zeros(rows, hv, dv, dtype=dtype, device=dev))

    def mixed(self, layer: GatedDeltaNet, linear_idx: int, batch: ForwardBatch, x: Tensor) -> Tensor:
        """One layer over a pass with prefill rows, split (`splits`): the projections of every row, the paged decode
        kernels over the decode rows (their states in place), the chunk form over the prefill sequences
        (`prefill_rows`: their states gathered and scattered by page id), the output of every row. No step reads the
        device from the host. While graphs are captured the prefill sequences are a cut between two pieces, run
        eagerly at each replay."""
        T = x.shape[0]
        mixed, g, beta = layer.project(x)
        rows = self._rows
        if batch.layout is not None:  # eager: every row is written below (decodes, then the prefill rows)
            o = x.new_empty(T, layer.num_v_heads, layer.head_v_dim)  # [T, Hv, dv]
        else:  # a graph's static batch: the rows its eager stretch reads and writes, static
            io = self._graph_rows
            if io is None or io.mixed.shape[0] < T:
                raise RuntimeError(f"no static rows reserved for a mixed graph of {T} rows (reserve_graph_rows)")
            for buf, t in ((io.mixed, mixed), (io.g, g), (io.beta, beta)):
                buf[:T].copy_(t)
            mixed, g, beta, o = io.mixed[:T], io.g[:T], io.beta[:T], io.o[:T]
            # padding rows belong to no sequence: zeros, so no stale value flows through the layers after
            o[rows.n if rows is not None else 0 :].zero_()
        if rows is not None:
            n = rows.n
            o[:n] = layer.decode_rows(mixed[:n], g[:n], beta[:n], self.conv, rows.conv[linear_idx], self.ssm,
                                      rows.ssm[linear_idx], rows.has_state)
        if self._single is not None and batch.layout is None:  # a single-prefill graph's pass: no stretch to cut
            self._single_prefill_rows(layer, linear_idx, batch, mixed, g, beta)
            return layer._output(x, o)
        run = functools.partial(self._stretch, layer, linear_idx, batch, mixed, g, beta, o)
        if self.capture is not None and self.capture.capturing:
            self.capture.cut(run)
        else:
            layout = batch.layout or self.step_layout
            if layout is not None:  # None: a graph's warm-up, which has no step
                run(layout)
        return layer._output(x, o)

    def prefill_rows(self, layer: GatedDeltaNet, linear_idx: int, batch: ForwardBatch, mixed: Tensor, g: Tensor,
                     beta: Tensor, o: Tensor, layout: StepLayout | None) -> None:
        """The chunk form over the prefill sequences of `layout` (rows num_decodes..num_tokens-1 of the projections
        mixed / g / beta): their states read by page id (fresh ones selected as zero), the final ones written back,
        their outputs into those rows of `o`. Every size is a host int of the layout: no host sync."""
        if layout is None or layout.num_prefills == 0:
            return
        d, b = layout.num_decodes, layout.num_seqs
        seqs = self._prefill_seqs(batch, layout)
        ssm_all, conv_all = self._pages(batch, linear_idx)
        ssm_all, conv_all = ssm_all[d:b], conv_all[d:b]  # [P]: real sequences, every page >= 0
        for grp in seqs.groups:
            ssm_ids, conv_ids = ssm_all[grp.first : grp.last], conv_all[grp.first : grp.last]
            conv0, state0 = self._initial_states(conv_ids, ssm_ids, ~seqs.has_state[grp.first : grp.last])
            r0, r1 = d + grp.row_start, d + grp.row_end
            out, conv_f, state_f = layer.varlen_core(mixed[r0:r1], g[r0:r1], beta[r0:r1], conv0, state0,
                                                     grp.cu_seqlens, grp.max_len)
            del conv0, state0
            self._store_states(conv_ids, ssm_ids, conv_f, state_f)
            o[r0:r1] = out

    def _stretch(self, *args: object) -> None:
        """`prefill_rows`, looked up when it runs: what a graph's cut calls at replay (so a wrapper of prefill_rows,
        a profiler's, sees the replays' stretches too)."""
        self.prefill_rows(*args)  # type: ignore[arg-type]

    def _prefill_seqs(self, batch: ForwardBatch, layout: StepLayout) -> _PrefillSeqs:
        cached = self._prefill
        if cached is not None and cached.layout is layout and cached.batch is batch:
            return cached
        d, b = layout.num_decodes, layout.num_seqs
        qsl = batch.query_start_loc[d : b + 1].long()
        cu = qsl - d  # decodes are one row each: the prefill rows start at row d
        per_group = max(1, PREFILL_STATE_GROUP_BYTES // (self.ssm[0].numel() * self.ssm.element_size()))
        if len(layout.prefill_lens) <= per_group:  # one group (a layout made by hand names no lengths)
            groups = [_PrefillGroup(0, b - d, 0, layout.num_tokens - d, layout.max_prefill_len, cu)]
        else:
            groups = [_PrefillGroup(first, last, r0, r1, max_len, cu[first : last + 1] - r0)
                      for first, last, r0, r1, max_len in prefill_groups(layout.prefill_lens, per_group)]
        self._prefill = _PrefillSeqs(layout, batch, batch.seq_lens[d:b] > cu[1:] - cu[:-1], groups)
        return self._prefill

    def decode(self, layer: GatedDeltaNet, linear_idx: int, batch: ForwardBatch, x: Tensor,
               has_initial_state: Tensor) -> Tensor:
        """One decode step of `layer` (x [B, hidden], token b = sequence b), its states updated in their pages."""
        ssm, conv = self._pages(batch, linear_idx)
        return layer.decode_paged(x, self.conv, conv, self.ssm, ssm, has_initial_state)

    def copy(self, src_ssm: list[int], dst_ssm: list[int], src_conv: list[int], dst_conv: list[int]) -> None:
        """Copies whole states page to page, one ssm and one conv page per linear-attention layer (prefix caching:
        a request's state into a snapshot, or a snapshot into a request's pages; engine/state_cache_manager.py)."""
        dev = self.ssm.device
        s = torch.tensor(src_ssm, dtype=torch.int64, device=dev)
        c = torch.tensor(src_conv, dtype=torch.int64, device=dev)
        self.ssm.index_copy_(0, torch.tensor(dst_ssm, dtype=torch.int64, device=dev), self.ssm[s])
        self.conv.index_copy_(0, torch.tensor(dst_conv, dtype=torch.int64, device=dev), self.conv[c])

    def write(self, linear_idx: int, batch: ForwardBatch, conv: Tensor, recurrent: Tensor) -> None:
        """Stores one layer's final states [B, ...] of this pass into the sequences' pages (padding rows: nowhere)."""
        ssm_ids, conv_ids = self._pages(batch, linear_idx)
        if bool((ssm_ids < 0).any()):
            keep = ssm_ids >= 0
            ssm_ids, conv_ids, conv, recurrent = ssm_ids[keep], conv_ids[keep], conv[keep], recurrent[keep]
        self._store_states(conv_ids, ssm_ids, conv, recurrent)


def no_state_cache(device: torch.device | str, dtype: torch.dtype) -> LinearStateCache:
    """A cache of no pages, for a model whose pool does not exist yet (as `torch.empty(0)` stands for its KV)."""
    return LinearStateCache(torch.empty(0, 1, 1, 1, device=device), torch.empty(0, 1, 1, dtype=dtype, device=device))
