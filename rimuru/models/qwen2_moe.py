"""Qwen1.5-MoE / Qwen2-MoE: q/k/v bias (o_proj without), a shared expert behind a sigmoid gate."""

from __future__ import annotations

from torch import nn

from rimuru.model_spec import ModelSpec
from rimuru.models.attention import Attention
from rimuru.models.causal_lm import MoECausalLM
from rimuru.models.moe import SharedExpertMoE


class Qwen2MoeForCausalLM(MoECausalLM):
    def make_attention(self, spec: ModelSpec, attn_idx: int) -> Attention:
        qkv_bias = bool(spec.hf_config.get("qkv_bias", True))  # older configs have no flag: bias on
        return Attention(
            spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, attn_idx,
            qkv_bias=qkv_bias, o_bias=False, tp=self.tp,
        )

    def make_moe(self, spec: ModelSpec, moe_idx: int) -> nn.Module:
        if spec.shared_expert_intermediate_size <= 0:
            return super().make_moe(spec, moe_idx)
        return SharedExpertMoE(shared_intermediate_size=spec.shared_expert_intermediate_size,
                               **self.moe_kwargs(spec, moe_idx))
