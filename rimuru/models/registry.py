"""model_type -> model class, and `build_model`, the one way to make a model."""

from __future__ import annotations

import torch
from torch import Tensor

from rimuru.distributed.parallel_state import SINGLE, TensorParallel
from rimuru.model_spec import ModelSpec
from rimuru.models.causal_lm import MoECausalLM
from rimuru.models.expert_provider import ExpertProvider
from rimuru.models.mixtral import MixtralForCausalLM
from rimuru.models.olmoe import OlmoeForCausalLM
from rimuru.models.qwen2_moe import Qwen2MoeForCausalLM
from rimuru.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from rimuru.models.qwen3_moe import Qwen3MoeForCausalLM
from rimuru.models.qwen3_next import Qwen3NextForCausalLM

MODEL_CLASSES: dict[str, type[MoECausalLM]] = {
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "olmoe": OlmoeForCausalLM,
    # hybrids: gated DeltaNet layers whose per-request state lives in ssm and conv pages of the pool
    "qwen3_5_moe": Qwen3_5MoeForCausalLM,  # the multimodal checkpoint, served as text only
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,  # Qwen3.5-MoE's layers; fused linear-attention projections in the checkpoint
}


def model_class(model_type: str) -> type[MoECausalLM]:
    if model_type not in MODEL_CLASSES:
        supported = ", ".join(sorted(MODEL_CLASSES))
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {supported}")
    return MODEL_CLASSES[model_type]


def build_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, kv_cache: Tensor,
                experts: ExpertProvider | None = None, tp: TensorParallel = SINGLE) -> MoECausalLM:
    """The model with UNINITIALISED non-expert weights on `device`; fill them with
    `load_checkpoint` or `init_dummy_weights`. Built on the meta device first, so nothing is
    initialised twice and full-size models appear on the GPU without a host copy. Routed experts are
    attached with `experts` here or `MoECausalLM.attach_experts` later. With `tp` of size N the model holds this
    rank's shard of every weight (models/parallel_linear.py)."""
    return build_model_of_class(model_class(spec.model_type), spec, dtype, device, kv_cache, experts, tp)


def build_model_of_class(cls: type[MoECausalLM], spec: ModelSpec, dtype: torch.dtype, device: torch.device | str,
                         kv_cache: Tensor, experts: ExpertProvider | None = None,
                         tp: TensorParallel = SINGLE) -> MoECausalLM:
    """`build_model` for a given class, registered or not."""
    with torch.device("meta"):
        model = cls(spec, kv_cache, tp)
    # dtype first, still on meta: materialising in float32 and casting after held a float32 copy of every
    # non-expert weight at once (2x their size: ~3.7 GB beyond the budget at the start for Qwen1.5-MoE)
    model = model.to(dtype).to_empty(device=device)
    for block in model.moe_blocks():  # buffers are not weights: no checkpoint fills them, so set them here
        block.reset_buffers()
    model.requires_grad_(False)
    if experts is not None:
        model.attach_experts(experts)
    return model.eval()
