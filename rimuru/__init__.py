"""Rimuru: MoE serving with expert weights and KV cache in one elastic page pool."""

from importlib.metadata import PackageNotFoundError, version

from rimuru.engine.outputs import CompletionOutput, RequestOutput
from rimuru.engine.sampling_params import SamplingParams

try:
    __version__ = version("rimuru")
except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0.0.0+source"


def __getattr__(name: str):  # LLM pulls in torch and the models: import it only when asked for
    if name == "LLM":
        from rimuru.engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
