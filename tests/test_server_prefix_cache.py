"""Prefix caching seen from the OpenAI API: `usage.prompt_tokens_details.cached_tokens` with
--enable-prompt-tokens-details (vLLM's flag), read with the official `openai` client."""

from __future__ import annotations

import openai

from rimuru.config import EngineConfig
from rimuru.engine.llm_engine import LLMEngine
from rimuru.server.app import ServerConfig
from rimuru.server.background import BackgroundServer

MODEL = "tiny-moe"


def _usage(url: str, prompt: list[int], n: int = 1) -> openai.types.CompletionUsage:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0, n=n)
    assert out.usage is not None
    return out.usage


def test_cached_prompt_tokens_are_reported_when_asked(tiny_checkpoint) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("qwen2_moe")), device="cpu",
                                    gpu_memory_budget="64MiB"))
    prompt = list(range(3, 3 + 40))  # two full 16-token blocks and a partial one
    with BackgroundServer(engine, ServerConfig(served_model_name=MODEL, enable_prompt_tokens_details=True)) as srv:
        first = _usage(srv.url, prompt)
        again = _usage(srv.url, prompt)
        twice = _usage(srv.url, prompt, n=2)
    assert first.prompt_tokens_details is not None and first.prompt_tokens_details.cached_tokens == 0
    assert again.prompt_tokens_details is not None and again.prompt_tokens_details.cached_tokens == 32
    # n choices of one prompt: the prompt's cached tokens counted once, as its prompt tokens are
    assert twice.prompt_tokens == 40 and twice.prompt_tokens_details.cached_tokens == 32


def test_no_details_unless_asked(tiny_checkpoint) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("qwen2_moe")), device="cpu",
                                    gpu_memory_budget="64MiB"))
    prompt = list(range(3, 3 + 40))
    with BackgroundServer(engine, ServerConfig(served_model_name=MODEL)) as srv:
        _usage(srv.url, prompt)
        again = _usage(srv.url, prompt)
    assert again.prompt_tokens_details is None
