"""ForwardBatch: what the model runner hands the model for one forward pass.

All scheduled sequences are flattened into one token axis T; prefill chunks and decodes mix freely.
Sequence b owns tokens `query_start_loc[b] : query_start_loc[b + 1]`; its context after this step
is `seq_lens[b]` tokens, so its new tokens sit at positions `seq_lens[b] - q_len_b ... seq_lens[b] - 1`.

    tokens      | seq 0 (prefill chunk) | seq 1 (decode) | seq 2 (prefill) |
    query_start 0                       5                6                 9

Every attention layer has its own KV pages, hence one block table and one slot mapping per
attention layer, indexed by the layer's ordinal among attention layers (not its layer index). Hybrid
models' linear-attention layers read and write each sequence's state through its state page ids, one ssm and
one conv page per linear-attention layer (models/state_cache.py), and split an eager pass by its `StepLayout`:
the leading single-token sequences (decodes, which the runner puts first) take the paged decode kernels, the
sequences after them (prefill chunks) the chunk form, with every shape the split needs a host int.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor


@dataclass(frozen=True)
class StepLayout:
    """Host ints of one pass's real rows, for the split of a hybrid model's linear-attention layers: sequences
    0..num_decodes-1 have one token each at rows 0..num_decodes-1; sequences num_decodes..num_seqs-1 (the prefill
    sequences) own rows num_decodes..num_tokens-1, the longest max_prefill_len tokens. A CUDA graph's padded batch
    has more rows and sequences (padding); its replay is handed the layout of the step it serves."""

    num_decodes: int
    num_seqs: int
    num_tokens: int
    max_prefill_len: int
    # each prefill sequence's rows, in order (() where a layout is built by hand: the prefills then go as one group)
    prefill_lens: tuple[int, ...] = field(default=(), compare=False)

    @classmethod
    def of(cls, query_lens: Sequence[int]) -> StepLayout:
        """The layout of sequences with these new-token counts, in batch order (every count >= 1)."""
        d = 0
        while d < len(query_lens) and query_lens[d] == 1:
            d += 1
        rest = [int(n) for n in query_lens[d:]]
        return cls(num_decodes=d, num_seqs=len(query_lens), num_tokens=int(sum(query_lens)),
                   max_prefill_len=max(rest) if rest else 0, prefill_lens=tuple(rest))

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes


@dataclass
class ForwardBatch:
    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64
    query_start_loc: Tensor  # [B+1] int32
    seq_lens: Tensor  # [B] int32, context length including this step's tokens
    block_tables: Tensor  # [L_attn, B, max_blocks] int32, KV page ids
    slot_mapping: Tensor  # [L_attn, T] int64, kv_page_id * block_size + offset; < 0 = do not write
    logits_indices: Tensor  # [B'] int64, rows of the hidden states whose logits are sampled
    max_query_len: int
    max_seq_len: int
    # [B+1] int32, mixed-step CUDA graphs only: attention's tile-mapped launch (kernels/paged_attention.py)
    q_tile_start: Tensor | None = None
    # hybrid models only: [L_lin, B] int64 page ids of each sequence's recurrent (ssm) and conv state per
    # linear-attention layer; < 0 = a padding row (reads page 0, writes nothing)
    ssm_pages: Tensor | None = None
    conv_pages: Tensor | None = None
    # hybrid models' eager passes: the host ints of the split (StepLayout); None in CUDA graphs' static batches,
    # and where a caller does not know it (the layers then take the gather / scatter reference path)
    layout: StepLayout | None = None
    # a CUDA graph's static batch (engine/cuda_graphs.py): padding rows and sequences, the real ones known only when
    # a replay is handed its step's layout
    padded: bool = False

    def attention_rows(self, attn_idx: int) -> tuple[Tensor, Tensor]:
        """(block_tables[attn_idx], slot_mapping[attn_idx]): views made once per pass for every attention layer
        (one unbind each) instead of two index ops per layer."""
        rows = self.__dict__.get("_rows")
        if rows is None or rows[0] is not self.block_tables or rows[1] is not self.slot_mapping:
            rows = (self.block_tables, self.slot_mapping, self.block_tables.unbind(0), self.slot_mapping.unbind(0))
            self.__dict__["_rows"] = rows
        return rows[2][attn_idx], rows[3][attn_idx]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
