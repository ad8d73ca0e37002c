"""Rimuru: MoE serving with expert weights and KV cache in one elastic page pool."""

from rimuru.engine.outputs import CompletionOutput, RequestOutput
from rimuru.engine.sampling_params import SamplingParams


def __getattr__(name: str):  # LLM pulls in torch and the models: import it only when asked for
    if name == "LLM":
        from rimuru.engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
