"""Mixtral: plain GQA attention, top-k renormalised; original checkpoints name the MoE block
`block_sparse_moe` and its experts' matrices w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from rimuru.models.causal_lm import MoECausalLM


class MixtralForCausalLM(MoECausalLM):
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)
    expert_weight_names = ("w1", "w3", "w2")
