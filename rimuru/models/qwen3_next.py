"""Qwen3-Next (`qwen3_next`, e.g. Qwen3-Next-80B-A3B): the Qwen3.5-MoE hybrid with another checkpoint layout.

The layers are Qwen3.5-MoE's (models/qwen3_5_moe.py): gated DeltaNet or gated full attention by layer_types[i]
(every 4th layer full attention when the config names none), zero-centred RMSNorms but the gated one, partial
rotary, routed experts plus a sigmoid-gated shared expert. What differs:

    checkpoint  the gated DeltaNet's input projections are two fused tensors, laid out per key-head group
                (Hk groups, each reading g = Hv / Hk value heads):
                    in_proj_qkvz [Hk * (2 dk + 2 g dv), d]  group h: q_h [dk] | k_h [dk] | v [g dv] | z [g dv]
                    in_proj_ba   [Hk * 2 g, d]              group h: b [g] | a [g]
                split here, at load time, into Rimuru's in_proj_qkv ([all q | all k | all v]), in_proj_z,
                in_proj_b and in_proj_a: value head h * g + i is row block i of group h, as transformers'
                `fix_query_key_value_ordering` orders them
    MoE         Qwen2-MoE's rule: layer i is dense (a gated MLP of `intermediate_size`) when listed in
                mlp_only_layers or when (i + 1) % decoder_sparse_step != 0; top-k weights renormalised only
                with norm_topk_prob (the config's, default true)
    config      flat (no text_config); rotary over the first partial_rotary_factor (default 0.25) of each head,
                plain 1-D (no mrope sections)
    mtp.*       the multi-token-prediction weights are skipped, as for Qwen3.5
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from rimuru.model_spec import ModelSpec
from rimuru.models.causal_lm import CheckpointSplit
from rimuru.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from rimuru.models.rotary import check_rope_config

MODEL_TYPES = ("qwen3_next",)

_FUSED_LINEAR = re.compile(r"^(model\.layers\.\d+\.linear_attn)\.(in_proj_qkvz|in_proj_ba)\.weight$")


def split_qkvz(w: Tensor, num_k_heads: int, num_v_heads: int, head_k_dim: int,
               head_v_dim: int) -> tuple[Tensor, Tensor]:  # [Hk * (2 dk + 2 g dv), d]
    """in_proj_qkvz -> (in_proj_qkv [2 Hk dk + Hv dv, d] rows [q | k | v], in_proj_z [Hv dv, d])."""
    g = num_v_heads // num_k_heads
    groups = w.reshape(num_k_heads, 2 * head_k_dim + 2 * g * head_v_dim, -1)  # [Hk, per group, d]
    q, k, v, z = groups.split([head_k_dim, head_k_dim, g * head_v_dim, g * head_v_dim], dim=1)
    d = w.shape[-1]
    qkv = (q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d))  # heads in order: value head h * g + i
    return torch.cat(qkv, dim=0), z.reshape(-1, d)


def split_ba(w: Tensor, num_k_heads: int, num_v_heads: int) -> tuple[Tensor, Tensor]:  # [Hk * 2g, d]
    """in_proj_ba -> (in_proj_b [Hv, d], in_proj_a [Hv, d])."""
    g = num_v_heads // num_k_heads
    b, a = w.reshape(num_k_heads, 2 * g, -1).split([g, g], dim=1)  # [Hk, g, d] each
    return b.reshape(num_v_heads, -1), a.reshape(num_v_heads, -1)


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    checkpoint_renames = ()
    checkpoint_skipped = (r"^mtp\.",)  # multi-token prediction is out of scope, as for Qwen3.5

    def split_checkpoint_tensor(self, name: str) -> CheckpointSplit | None:
        m = _FUSED_LINEAR.match(name)
        if m is None:
            return None
        prefix, kind = m.groups()
        s = self.spec  # whole-model head counts: the checkpoint's tensor is whole, any cut comes after
        hk, hv = s.linear_num_key_heads, s.linear_num_value_heads
        if kind == "in_proj_qkvz":
            return ((f"{prefix}.in_proj_qkv.weight", f"{prefix}.in_proj_z.weight"),
                    lambda w: split_qkvz(w, hk, hv, s.linear_key_head_dim, s.linear_value_head_dim))
        return (f"{prefix}.in_proj_b.weight", f"{prefix}.in_proj_a.weight"), lambda w: split_ba(w, hk, hv)

    @staticmethod
    def _check_supported(spec: ModelSpec) -> None:
        if spec.model_type not in MODEL_TYPES:
            raise ValueError(f"Qwen3NextForCausalLM does not run model_type {spec.model_type!r}")
        act = spec.hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"{spec.model_type}: hidden_act={act!r} is not supported (only 'silu')")
        if spec.shared_expert_intermediate_size <= 0:
            raise NotImplementedError(f"{spec.model_type}: every MoE layer has a shared expert "
                                      "(shared_expert_intermediate_size > 0)")
        if spec.linear_num_value_heads % max(spec.linear_num_key_heads, 1):
            raise ValueError(f"{spec.model_type}: linear_num_value_heads={spec.linear_num_value_heads} is not a "
                             f"multiple of linear_num_key_heads={spec.linear_num_key_heads}")
        check_rope_config(spec.hf_config, allow_partial=True)
