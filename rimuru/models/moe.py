"""The sparse MoE block: router -> fp32 softmax -> top-k -> (renormalise) -> paged fused MoE.

Routed experts are not parameters of this module: their weights live in expert pages of the pool,
which the ExpertProvider makes addressable and names in an expert table. The router (`gate`) and
an optional shared expert are ordinary parameters.

Tensor-parallel over N ranks: every rank routes the same tokens with the whole router (its hidden states are the
same bits on every rank); each expert page holds the rank's f/N rows of W1 and W3 and columns of W2, so the fused
MoE gives a partial sum that one all-reduce completes, after the shared expert's partial sum (row-parallel down
projection) is added to it. Under expert parallelism a rank's pages hold E/N whole experts and the others' table
rows are absent (-1): tokens routed to them contribute zeros here and their expert's rank adds them, so the same
one all-reduce completes the sum.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rimuru.distributed.parallel_state import SINGLE, TensorParallel
from rimuru.kernels.activation import sigmoid_mul_add
from rimuru.kernels.fused_moe import fused_moe
from rimuru.kernels.router import route_topk
from rimuru.models.expert_provider import ExpertProvider
from rimuru.models.layers import GatedMLP


class _NoExperts:
    """The provider of a model whose experts were never attached: a clear error instead of a missing attribute."""

    @property
    def expert_view(self) -> Tensor:
        raise RuntimeError("this model has no routed experts attached (MoECausalLM.attach_experts)")

    def before_layer(self, moe_layer: int, hidden: Tensor) -> None:
        return None

    def host_rows(self, moe_layer: int) -> Tensor | None:
        return None

    def table(self, moe_layer: int, topk_ids: Tensor) -> Tensor:
        raise RuntimeError("this model has no routed experts attached (MoECausalLM.attach_experts)")

    def host_experts(self, moe_layer: int, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> None:
        return None


NO_EXPERTS: ExpertProvider = _NoExperts()


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        moe_idx: int,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.top_k = top_k
        self.tp = tp
        self.intermediate_size = tp.expert_part(intermediate_size)  # this rank's f (the whole f under EP)
        self.renormalize = renormalize
        self.moe_idx = moe_idx  # ordinal among MoE layers: which expert table
        # a plain attribute, set by MoECausalLM.attach_experts: the provider's pages are not model state
        self.provider: ExpertProvider = NO_EXPERTS
        # A skewed router for dummy weights (EngineConfig.dummy_routing, models/dummy_routing.py): the bias is added
        # to the router logits (fp32), and with a nonzero noise scale the random logits are first made standard
        # Gumbel. Zeros otherwise. Not checkpoint state; reset_buffers() sets them after meta-device builds.
        self.register_buffer("router_bias", torch.zeros(num_experts), persistent=False)
        self.register_buffer("router_noise_scale", torch.zeros(num_experts), persistent=False)
        self.gumbel_routing = False  # set with router_noise_scale (set_dummy_routing)

    def reset_buffers(self) -> None:
        """State that is not a weight: a model built on the meta device and moved with to_empty() holds
        garbage here until this runs (registry.build_model calls it)."""
        self.router_bias = torch.zeros(self.gate.out_features, dtype=torch.float32, device=self.gate.weight.device)
        self.router_noise_scale = torch.zeros_like(self.router_bias)
        self.gumbel_routing = False

    def router_logits(self, x: Tensor) -> Tensor:  # [T, d] -> [T, E]
        """The logits the top-k is taken over, before `router_bias` is added (the expert predictor applies the
        same). A dummy skewed router maps each expert's random logit z to the standard Gumbel
        -log(-log(Phi(z / noise_scale))) (models/dummy_routing.py)."""
        logits = self.gate(x)
        if not self.gumbel_routing:
            return logits
        u = torch.special.ndtr(logits.float() / self.router_noise_scale).clamp(1e-7, 1.0 - 1e-7)
        return -torch.log(-torch.log(u))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k routing weights [T, k] fp32 and expert ids [T, k] int64 (one launch on CUDA)."""
        return route_topk(self.router_logits(x), self.router_bias, self.top_k, self.renormalize)

    def routed(self, x: Tensor) -> Tensor:  # [T, d] -> [T, d], this rank's partial sum under tensor parallelism
        weights, ids = self.route(x)  # [T, k]
        provider = self.provider
        table = provider.table(self.moe_idx, ids)  # [E, 3] int32
        host = provider.host_experts(self.moe_idx, x, weights, ids)  # experts left out of the table, started
        out = fused_moe(x, weights, ids, provider.expert_view, table, self.intermediate_size,
                        host_rows=provider.host_rows(self.moe_idx),
                        skip_absent=host is not None or self.tp.expert_parallel)  # [T, d]
        # the host computes its experts while the device runs the kernel queued above, then adds them
        return out if host is None else host.join(out)

    def forward(self, x: Tensor) -> Tensor:  # [T, d]
        return self.tp.all_reduce(self.routed(x))


class SharedExpertMoE(SparseMoE):
    """Routed experts plus one always-on shared expert scaled by a sigmoid gate (Qwen MoE family)."""

    def __init__(self, shared_intermediate_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        hidden_size = self.gate.in_features
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, tp=self.tp, reduce=False)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [T, d]
        gate_logit, shared = self.shared_expert_gate(x), self.shared_expert(x)  # [T, 1], [T, d]
        # routed + sigmoid(gate) * shared: both partial sums under tensor parallelism, so one all-reduce of the two
        return self.tp.all_reduce(sigmoid_mul_add(gate_logit, shared, self.routed(x)))
