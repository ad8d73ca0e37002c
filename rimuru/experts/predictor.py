"""Which experts the next MoE layer will want, guessed one layer early (Fate-style).

While MoE layer l runs, MoE layer l+1's own router (its post-attention norm, and its gate with whatever the layer
adds to it: `SparseMoE.router_logits` and `router_bias`) is applied to layer l's input hidden states.
Consecutive residual streams are close, so its top-k picks are a good guess of layer l+1's real routing; the
loader prefetches them. The real routing always decides: a wrong guess costs a wasted copy and an on-demand load,
never a different result.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rimuru.models.moe import SparseMoE


class ExpertPredictor:
    def __init__(self, routers: list[tuple[nn.Module, SparseMoE]], top_k: int) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        self.routers = routers  # per MoE layer: (the norm before its MoE block, the block)
        self.top_k = top_k

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def scores(self, moe_layer: int, hidden: Tensor, row_mask: Tensor | None = None) -> Tensor:  # hidden [T, d]
        """[E] fp32 on hidden's device: summed top-k routing probability each expert of MoE layer
        `moe_layer` would get from these hidden states (0 = not picked by any token). Rows where `row_mask` [T]
        is False (padding of a CUDA-graph batch) add nothing."""
        norm, moe = self.routers[moe_layer]
        # the layer's own routing, bias included: a bias-blind guess prefetches the cold experts of a skewed router
        # every step (on the H200, 67 copied against 4 routed per decode step)
        probs = torch.softmax(moe.router_logits(norm(hidden)).float() + moe.router_bias, dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, min(self.top_k, probs.shape[-1]), dim=-1)  # [T, k]
        if row_mask is not None:
            weights = weights * row_mask[:, None]
        out = torch.zeros(probs.shape[-1], dtype=torch.float32, device=hidden.device)  # [E]
        return out.index_add_(0, ids.reshape(-1), weights.reshape(-1))

