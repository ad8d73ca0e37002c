"""Self-attention over the paged KV cache: project, rotate, write this step's K/V, attend.

Every attention layer reads and writes its own pages of one shared KV view
`kv_cache [n_pages, 2, block_size, Hkv, D]`, through its own block table and slot mapping
(`batch.block_tables[attn_idx]`, `batch.slot_mapping[attn_idx]`).

Tensor-parallel over N ranks: each rank holds Hq / N query heads and their KV heads (Hkv / N, or one KV head
replicated on N / Hkv ranks when N > Hkv), so attention itself needs no communication; o_proj is row-parallel
and its all-reduce sums the ranks' heads.
"""

from __future__ import annotations

from torch import Tensor, nn

from rimuru.distributed.parallel_state import SINGLE, TensorParallel
from rimuru.kernels.paged_attention import paged_attention
from rimuru.kernels.rotary import rotary_write_kv
from rimuru.models.forward_batch import ForwardBatch
from rimuru.models.layers import MergedLinear
from rimuru.models.parallel_linear import RowParallelLinear, kv_head_shard, rank_shard


class Attention(nn.Module):
    """Plain GQA attention (Mixtral, Qwen1.5-MoE). Architectures with q/k norms override `qkv`."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        attn_idx: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        self.tp = tp
        num_heads = tp.part(num_heads, "num_attention_heads")
        num_kv_heads, kv_cut = kv_head_shard(tp, num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim  # this rank's
        self.attn_idx = attn_idx  # ordinal among attention layers: which block table / slot mapping
        self.scale = head_dim**-0.5
        # q, k and v in one GEMM; checkpoints' q_proj / k_proj / v_proj are its shards
        self.qkv_proj = MergedLinear(hidden_size, {"q_proj": num_heads * head_dim,
                                                   "k_proj": num_kv_heads * head_dim,
                                                   "v_proj": num_kv_heads * head_dim}, bias=qkv_bias,
                                     cuts={"q_proj": rank_shard(tp, 0), "k_proj": kv_cut, "v_proj": kv_cut})
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias, tp=tp)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per-head q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] before rotary."""
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D] views
        return (q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim),
                v.view(T, self.num_kv_heads, self.head_dim))

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, batch: ForwardBatch
    ) -> Tensor:  # x [T, d], cos/sin [T, D/2]
        q, k, v = self.qkv(x)
        block_table, slots = batch.attention_rows(self.attn_idx)  # this layer's rows, views made once per pass
        # q rotated [T, Hq, D]; k rotated and v written to this step's slots: one kernel on CUDA
        q = rotary_write_kv(q, k, v, cos, sin, kv_cache, slots)
        out = paged_attention(
            q,
            kv_cache,
            block_table,
            batch.query_start_loc,
            batch.seq_lens,
            self.scale,
            batch.max_query_len,
            batch.max_seq_len,
            q_tile_start=batch.q_tile_start,
        )  # [T, Hq, D]
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))  # [T, d]
