"""Qwen3-MoE: RMSNorm on every q and k head before rotary; head_dim is its own config field."""

from __future__ import annotations

from torch import Tensor

from rimuru.distributed.parallel_state import SINGLE, TensorParallel
from rimuru.model_spec import ModelSpec
from rimuru.models.attention import Attention
from rimuru.models.causal_lm import MoECausalLM
from rimuru.models.layers import RMSNorm


class HeadQKNormAttention(Attention):
    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, attn_idx: int,
        qkv_bias: bool, o_bias: bool, eps: float, tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, attn_idx, qkv_bias, o_bias, tp=tp)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().qkv(x)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        return self.q_norm(q), self.k_norm(k), v


class Qwen3MoeForCausalLM(MoECausalLM):
    def make_attention(self, spec: ModelSpec, attn_idx: int) -> Attention:
        bias = spec.attention_bias
        return HeadQKNormAttention(
            spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, attn_idx,
            qkv_bias=bias, o_bias=bias, eps=spec.rms_norm_eps, tp=self.tp,
        )
