"""ForwardBatch: what the model runner hands the model for one forward pass.

All scheduled sequences are flattened into one token axis T; prefill chunks and decodes mix freely.
Sequence b owns tokens `query_start_loc[b] : query_start_loc[b + 1]`; its context after this step
is `seq_lens[b]` tokens, so its new tokens sit at positions `seq_lens[b] - q_len_b ... seq_lens[b] - 1`.

    tokens      | seq 0 (prefill chunk) | seq 1 (decode) | seq 2 (prefill) |
    query_start 0                       5                6                 9

Every attention layer has its own KV pages, hence one block table and one slot mapping per
attention layer, indexed by the layer's ordinal among attention layers (not its layer index). Hybrid
models' linear-attention layers read and write each sequence's state through its state page ids, one ssm and
one conv page per linear-attention layer (models/state_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


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

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
