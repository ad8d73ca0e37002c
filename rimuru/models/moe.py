"""The sparse MoE block: router -> fp32 softmax -> top-k -> (renormalise) -> paged fused MoE.

Routed experts are not parameters of this module: their weights live in expert pages of the pool,
which the ExpertProvider makes addressable and names in an expert table. The router (`gate`) and
an optional shared expert are ordinary parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rimuru.kernels.activation import sigmoid_mul_add
from rimuru.kernels.fused_moe import fused_moe
from rimuru.kernels.router import route_topk
from rimuru.models.expert_provider import ExpertProvider
from rimuru.models.layers import GatedMLP


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        moe_idx: int,
        experts: ExpertProvider,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.moe_idx = moe_idx  # ordinal among MoE layers: which expert table
        self.provider = experts  # a plain attribute: the provider's pages are not model state
        # Added to the router logits (fp32); zeros unless a dummy model is given a skewed routing on purpose
        # (EngineConfig.dummy_routing). Not checkpoint state; reset_buffers() sets it after meta-device builds.
        self.register_buffer("router_bias", torch.zeros(num_experts), persistent=False)

    def reset_buffers(self) -> None:
        """State that is not a weight: a model built on the meta device and moved with to_empty() holds
        garbage here until this runs (registry.build_model calls it)."""
        self.router_bias = torch.zeros(self.gate.out_features, dtype=torch.float32, device=self.gate.weight.device)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k routing weights [T, k] fp32 and expert ids [T, k] int64 (one launch on CUDA)."""
        return route_topk(self.gate(x), self.router_bias, self.top_k, self.renormalize)

    def forward(self, x: Tensor) -> Tensor:  # [T, d]
        weights, ids = self.route(x)  # [T, k]
        table = self.provider.table(self.moe_idx, ids)  # [E, 3] int32
        return fused_moe(x, weights, ids, self.provider.expert_view, table, self.intermediate_size)  # [T, d]


class SharedExpertMoE(SparseMoE):
    """Routed experts plus one always-on shared expert scaled by a sigmoid gate (Qwen MoE family)."""

    def __init__(self, shared_intermediate_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        hidden_size = self.gate.in_features
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [T, d]
        gate_logit, shared = self.shared_expert_gate(x), self.shared_expert(x)  # [T, 1], [T, d]
        return sigmoid_mul_add(gate_logit, shared, super().forward(x))  # routed + sigmoid(gate) * shared
