"""Completions' `echo`, as OpenAI defines it and vLLM serves it: a choice's text is its prompt's text, then the
completion; with logprobs, the prompt's tokens come first (their logprobs are the prompt logprobs the engine
computed, the first one null: nothing predicts it), then the generated ones. With max_tokens=0 the prompt alone
comes back: the engine generates one token, which the response leaves out (its usage still counts it, as vLLM's).

A prompt sent as text is echoed as sent; one sent as token ids is echoed decoded, as vLLM detokenizes it.

    whole body     text = prompt text + completion         logprobs over prompt tokens + generated tokens
    stream         the first chunk of each choice carries the prompt part before its own delta
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rimuru.engine.outputs import PromptLogprobs, RequestOutput
from rimuru.server.errors import APIError
from rimuru.server.prompts import prompt_items
from rimuru.server.protocol import PromptInput


@dataclass(frozen=True)
class Echo:
    """What a response echoes, by prompt (choice i belongs to prompt i // n)."""

    texts: tuple[str, ...]  # each prompt's text
    first_token_texts: tuple[str, ...]  # the text of each prompt's first token, whose logprob entry is null
    without_generation: bool  # max_tokens=0: the prompt alone


def make_echo(tokenizer: Any, prompt: PromptInput, prompts: list[list[int]], without_generation: bool) -> Echo:
    """The echo of a completions request's prompts (`prompts`: their token ids, in order)."""
    if tokenizer is None:
        raise APIError(400, "echo needs a tokenizer to give the prompt's text; this model is served without one",
                       param="echo", code="no_tokenizer")
    texts = [item if isinstance(item, str) else tokenizer.decode(item) for item in prompt_items(prompt)]
    return Echo(tuple(texts), tuple(tokenizer.decode([ids[0]]) for ids in prompts), without_generation)


def echoed(out: RequestOutput, prompt_text: str, text: str, token_ids: list[int], logprobs: list | None,
           without_generation: bool) -> tuple[str, list[int], PromptLogprobs | None]:
    """The prompt's part followed by a generated part (`text`, `token_ids` and `logprobs`: the whole completion, or
    a stream's first delta), or the prompt's part alone without generation. Logprobs come only when the generated
    part has them (the request asked)."""
    prompt_ids = list(out.prompt_token_ids)
    prompt_lps = out.prompt_logprobs
    if without_generation:
        text, token_ids, logprobs = "", [], [] if logprobs is not None else None
    joined = None
    if logprobs is not None:
        assert prompt_lps is not None and len(prompt_lps) == len(prompt_ids), "echo with logprobs computes the prompt's"
        joined = [*prompt_lps, *logprobs]
    return prompt_text + text, prompt_ids + list(token_ids), joined
