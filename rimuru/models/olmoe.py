"""OLMoE: RMSNorm over the whole q and k projections (not per head), then optional clipping of q/k/v."""

from __future__ import annotations

from torch import Tensor

from rimuru.model_spec import ModelSpec
from rimuru.models.attention import Attention
from rimuru.models.causal_lm import MoECausalLM
from rimuru.models.layers import RMSNorm


class FullQKNormAttention(Attention):
    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, attn_idx: int,
        qkv_bias: bool, o_bias: bool, eps: float, clip_qkv: float | None,
    ) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, attn_idx, qkv_bias, o_bias)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, eps)
        self.clip_qkv = clip_qkv

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D] views
        q, k = self.q_norm(q), self.k_norm(k)
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
        )
