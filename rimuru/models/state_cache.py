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

This gather/scatter is the CPU path, and the path of every pass with a prefill chunk. A pure-decode pass (one token
per sequence) on CUDA with Triton takes `decode` instead: GatedDeltaNet.decode_paged, whose conv and recurrent
kernels read and write each sequence's state in its pages in place through the page ids (no gather, no scatter;
the recurrent state's read and write of its [Hv, dk, dv] fp32 page is the whole memory cost of the step there).
`decodes_in_place` is the one test that picks it.

CUDA graphs: that decode has no host sync and no data-dependent branch on the host (launch grids depend on B and
the shapes only; fresh sequences and padding rows are decided on the device from `has_initial_state` and the page
ids), so a pure-decode step of a hybrid model replays a decode graph (engine/cuda_graphs.py): its batch carries
`ssm_pages` / `conv_pages` as static [L_lin, B_graph] buffers updated in place each step, -1 in padding rows (the
kernels neither read nor write their pages). The gather/scatter path syncs the host (`write`'s padding test, the
chunk form's lengths), so passes with a prefill chunk run eagerly, and no graph is captured where `in_place_decode`
is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rimuru.kernels.triton_import import triton
from rimuru.models.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from rimuru.models.gated_deltanet import GatedDeltaNet


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
        self.conv.index_copy_(0, conv_ids, conv.to(self.conv.dtype))
        self.ssm.index_copy_(0, ssm_ids, recurrent.to(self.ssm.dtype))


def no_state_cache(device: torch.device | str, dtype: torch.dtype) -> LinearStateCache:
    """A cache of no pages, for a model whose pool does not exist yet (as `torch.empty(0)` stands for its KV)."""
    return LinearStateCache(torch.empty(0, 1, 1, 1, device=device), torch.empty(0, 1, 1, dtype=dtype, device=device))
