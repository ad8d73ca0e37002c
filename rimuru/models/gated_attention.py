"""Gated full attention (Qwen3.5-MoE, Qwen3-Next): attention whose output each head gates before o_proj.

    q_proj(x) per head = [q_h | gate_h]  (2D wide; q first)    k = k_proj(x), v = v_proj(x)
    q, k = zero-centred RMSNorm per head (x_hat * (1 + w)), then partial rotary (the first R dims)
    o = attention(q, k, v);  out = o_proj(o * sigmoid(gate))

The projection is one GEMM: the checkpoint's q_proj (2 * Hq * D rows), k_proj and v_proj are the shards of
`qkv_proj`, as in `Attention`. `project` and `gate_output` are the parts around the attention itself, so a
caller may attend over the paged KV (`forward`) or over any other KV layout.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rimuru.distributed.parallel_state import SINGLE, TensorParallel
from rimuru.kernels.paged_attention import paged_attention, write_kv
from rimuru.models.attention import Attention
from rimuru.models.forward_batch import ForwardBatch
from rimuru.models.layers import MergedLinear, RMSNorm
from rimuru.models.rotary import rotate_qk


class GatedAttention(Attention):
    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, attn_idx: int,
        eps: float, bias: bool = False, tp: TensorParallel = SINGLE,
    ) -> None:  # fmt: skip
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, attn_idx, bias, bias, tp=tp)
        # the q shard is twice as wide: each head's query and its output gate, adjacent rows, so a rank's 1/N of
        # the rows is its heads' [q | gate] pairs; k and v are cut by KV heads as in Attention
        H, Hkv = self.num_heads, self.num_kv_heads  # this rank's
        self.qkv_proj = MergedLinear(hidden_size, {"q_proj": 2 * H * head_dim, "k_proj": Hkv * head_dim,
                                                   "v_proj": Hkv * head_dim}, bias=bias, cuts=self.qkv_proj.cuts)
        self.q_norm = RMSNorm(head_dim, eps, zero_centred=True)
        self.k_norm = RMSNorm(head_dim, eps, zero_centred=True)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [T, d], cos/sin [T, R/2] -> rotated q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], gate [T, Hq*D]."""
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(x))  # [T, 2*Hq*D], [T, Hkv*D], [T, Hkv*D]
        q, gate = q_gate.view(T, H, 2 * D).split(D, dim=-1)  # [T, Hq, D] each
        q = self.q_norm(q)
        k = self.k_norm(k.view(T, self.num_kv_heads, D))
        q, k = rotate_qk(q, k, cos, sin)
        return q, k, v.view(T, self.num_kv_heads, D), gate.reshape(T, H * D)

    def gate_output(self, attn: Tensor, gate: Tensor) -> Tensor:
        """attn [T, Hq, D], gate [T, Hq*D] -> o_proj(attn * sigmoid(gate)) [T, d]."""
        return self.o_proj(attn.reshape(gate.shape) * torch.sigmoid(gate))

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, batch: ForwardBatch
    ) -> Tensor:  # x [T, d], cos/sin [T, R/2]
        q, k, v, gate = self.project(x, cos, sin)
        block_table, slots = batch.attention_rows(self.attn_idx)  # this layer's rows, views made once per pass
        write_kv(k, v, kv_cache, slots)
        out = paged_attention(
            q, kv_cache, block_table, batch.query_start_loc, batch.seq_lens, self.scale,
            batch.max_query_len, batch.max_seq_len, q_tile_start=batch.q_tile_start,
        )  # [T, Hq, D]
        return self.gate_output(out, gate)
