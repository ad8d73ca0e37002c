"""Models: layers shared by every architecture, one file per architecture, weight loading."""

from rimuru.models.causal_lm import MoECausalLM
from rimuru.models.expert_provider import ExpertProvider
from rimuru.models.forward_batch import ForwardBatch
from rimuru.models.loader import (
    CheckpointError,
    init_dummy_expert_pages,
    init_dummy_weights,
    load_checkpoint,
    write_expert_to_pages,
)
from rimuru.models.registry import MODEL_CLASSES, build_model, model_class

__all__ = [
    "MODEL_CLASSES",
    "CheckpointError",
    "ExpertProvider",
    "ForwardBatch",
    "MoECausalLM",
    "build_model",
    "init_dummy_expert_pages",
    "init_dummy_weights",
    "load_checkpoint",
    "model_class",
    "write_expert_to_pages",
]
