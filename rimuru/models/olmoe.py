"""OLMoE: RMSNorm over the whole q and k projections (not per head), then optional clipping of q/k/v.

Tensor-parallel, a rank holds only its heads' columns of q and k: the norm's mean square is the all-reduced sum of
the ranks' squares over N times the local width (a KV head replicated on r ranks is counted r times, as is every
other: the mean is the same), and each rank keeps its slice of the norm weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rimuru.distributed.parallel_state import SINGLE, TensorParallel
from rimuru.model_spec import ModelSpec
from rimuru.models.attention import Attention
from rimuru.models.causal_lm import MoECausalLM
from rimuru.models.layers import RMSNorm
from rimuru.models.parallel_linear import kv_head_shard, rank_shard, set_shard


class FullQKNormAttention(Attention):
    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, attn_idx: int,
        qkv_bias: bool, o_bias: bool, eps: float, clip_qkv: float | None, tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, attn_idx, qkv_bias, o_bias, tp=tp)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, eps)
        set_shard(self.q_norm, "weight", rank_shard(tp, 0))
        set_shard(self.k_norm, "weight", kv_head_shard(tp, num_kv_heads)[1])
        self.clip_qkv = clip_qkv

    def _full_width_norm(self, norm: RMSNorm, x: Tensor) -> Tensor:  # [T, local width]
        """norm(x) over the columns of every rank: x / rms(all ranks' x) * this rank's weights."""
        xf = x.float()
        squares = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))  # [T, 1]
        mean = squares / (x.shape[-1] * self.tp.size)
        return (xf * torch.rsqrt(mean + norm.eps)).to(x.dtype) * norm.weight

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D] views
        if self.tp.size == 1:
            q, k = self.q_norm(q), self.k_norm(k)
        else:
            q, k = self._full_width_norm(self.q_norm, q), self._full_width_norm(self.k_norm, k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        return (
            q.view(T, self.num_heads, self.head_dim),
            k.view(T, self.num_kv_heads, self.head_dim),
            v.view(T, self.num_kv_heads, self.head_dim),
        )


class OlmoeForCausalLM(MoECausalLM):
    def make_attention(self, spec: ModelSpec, attn_idx: int) -> Attention:
        bias = spec.attention_bias
        clip = spec.hf_config.get("clip_qkv")
        return FullQKNormAttention(
            spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, attn_idx,
            qkv_bias=bias, o_bias=bias, eps=spec.rms_norm_eps, clip_qkv=None if clip is None else float(clip),
            tp=self.tp,
        )
