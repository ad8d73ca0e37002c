"""The OpenAI response bodies we send, one builder per shape, as plain dicts ready for `json.dumps`.

    endpoint              whole body (stream=false)     each SSE event (stream=true)
    /v1/completions       completion_response           completion_chunk
    /v1/chat/completions  chat_completion_response      chat_completion_chunk

A stream's last event before `[DONE]`, when the client asked for usage, is its endpoint's chunk with no
choice and `usage_info`. Field names and the always-present nulls (`logprobs`, `usage`) follow vLLM, whose
clients (`vllm bench serve`, the `openai` package) parse these bodies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rimuru.engine.outputs import CompletionOutput, RequestOutput

Body = dict[str, Any]
Choices = list[tuple[int, CompletionOutput]]  # (choice index, its final output), by index


@dataclass(frozen=True)
class ResponseHead:
    """What every body and chunk of one HTTP response repeats."""

    id: str
    created: int  # unix seconds
    model: str  # the served model name


@dataclass(frozen=True)
class ChoiceDelta:
    """What one streamed chunk adds to one choice."""

    index: int
    text: str  # the text the client has not seen yet
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool  # the choice's first chunk: a chat chunk names the assistant role in it


def usage_info(prompts: list[list[int]], outputs: Iterable[RequestOutput]) -> Body:
    # prompt tokens count each prompt once, however many choices (n) it has, as OpenAI does
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _body(head: ResponseHead, object_name: str, choices: list[Body], usage: Body | None) -> Body:
    return {"id": head.id, "object": object_name, "created": head.created, "model": head.model,
            "choices": choices, "usage": usage}


def _completion_choice(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> Body:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}


def completion_response(head: ResponseHead, choices: Choices, usage: Body) -> Body:
    return _body(head, "text_completion",
                 [_completion_choice(i, c.text, c.finish_reason, c.stop_reason) for i, c in choices], usage)


def chat_completion_response(head: ResponseHead, choices: Choices, usage: Body) -> Body:
    bodies = [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
               "finish_reason": c.finish_reason} for i, c in choices]
    return _body(head, "chat.completion", bodies, usage)


def completion_chunk(head: ResponseHead, delta: ChoiceDelta | None, usage: Body | None = None) -> Body:
    choices = [] if delta is None else [_completion_choice(delta.index, delta.text, delta.finish_reason,
                                                            delta.stop_reason)]
    # a completion chunk is the same object as the whole body, as in OpenAI's and vLLM's streams
    return _body(head, "text_completion", choices, usage)


def chat_completion_chunk(head: ResponseHead, delta: ChoiceDelta | None, usage: Body | None = None) -> Body:
    choices = []
    if delta is not None:
        message = {"role": "assistant", "content": delta.text} if delta.first else {"content": delta.text}
        choices = [{"index": delta.index, "delta": message, "logprobs": None, "finish_reason": delta.finish_reason}]
    return _body(head, "chat.completion.chunk", choices, usage)


@dataclass(frozen=True)
class ResponseShapes:
    """The two shapes of one endpoint's answer, so one generation path serves both endpoints."""

    id_prefix: str
    response: Callable[[ResponseHead, Choices, Body], Body]
    chunk: Callable[[ResponseHead, ChoiceDelta | None, Body | None], Body]


COMPLETION = ResponseShapes("cmpl", completion_response, completion_chunk)
CHAT_COMPLETION = ResponseShapes("chatcmpl", chat_completion_response, chat_completion_chunk)
