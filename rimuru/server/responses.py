"""The OpenAI response bodies we send, one builder per shape, as plain dicts ready for `json.dumps`.

    endpoint              whole body (stream=false)     each SSE event (stream=true)
    /v1/completions       completion_response           completion_chunk
    /v1/chat/completions  chat_completion_response      chat_completion_chunk

A stream's last event before `[DONE]`, when the client asked for usage, is its endpoint's chunk with no
choice and `usage_info`. Field names and the always-present nulls (`logprobs`, `usage`) follow vLLM, whose
clients (`vllm bench serve`, the `openai` package) parse these bodies.

Logprobs, when asked, take each endpoint's OpenAI form (a chunk carries those of the tokens it adds):

    completions  {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}], "text_offset": [int]}
                 top_logprobs: the sampled token and the k most likely (up to k+1 entries, as OpenAI's legacy API);
                 with echo the prompt's tokens come first, the first one's logprob and top_logprobs null
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
                 top_logprobs: the top_logprobs most likely tokens, best first

vLLM's `prompt_logprobs` (the whole body only): on each completions choice, and once on a chat body, as vLLM's

    [null, {"<token id>": {"logprob": float, "rank": int, "decoded_token": str}, ...}, ...]   one per prompt token
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rimuru.engine.outputs import Logprob, PromptLogprobs, RequestOutput
from rimuru.server.echo import Echo, echoed

Body = dict[str, Any]
Choices = list[tuple[int, RequestOutput]]  # (choice index, its final output), by index
# logprob entries of tokens in order: a generated token's, or a prompt token's (None: the prompt's first)
TokenEntries = list[dict[int, Logprob] | None]


@dataclass(frozen=True)
class ResponseHead:
    """What every body and chunk of one HTTP response repeats."""

    id: str
    created: int  # unix seconds
    model: str  # the served model name
    num_logprobs: int | None = None  # top logprobs per token the request asked for; None: no logprobs
    prompt_tokens_details: bool = False  # usage carries prompt_tokens_details.cached_tokens
    n: int = 1  # choices per prompt
    echo: Echo | None = None  # completions' echo (server/echo.py)


@dataclass(frozen=True)
class ChoiceDelta:
    """What one streamed chunk adds to one choice."""

    index: int
    text: str  # the text the client has not seen yet
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool  # the choice's first chunk: a chat chunk names the assistant role in it
    token_ids: list[int] | None = None  # the tokens this chunk adds, for their logprobs
    logprobs: TokenEntries | None = None  # theirs, one entry per token
    text_offset: int = 0  # completions' logprobs: the characters of the token texts sent before this chunk
    first_token_text: str | None = None  # echo: the text of the prompt's first token (its entry is None)


def usage_info(prompts: list[list[int]], outputs: Iterable[RequestOutput], prompt_tokens_details: bool = False,
               n: int = 1) -> Body:
    """`outputs` in choice order (prompt p's choices at p*n ... p*n+n-1). With `prompt_tokens_details` (vLLM's
    --enable-prompt-tokens-details) the usage says how many prompt tokens came from the prefix cache, each prompt
    counted once (its first choice's)."""
    outputs = list(outputs)
    # prompt tokens count each prompt once, however many choices (n) it has, as OpenAI does
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs)
    usage: Body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                   "total_tokens": prompt_tokens + completion_tokens}
    if prompt_tokens_details:
        cached = sum(o.num_cached_tokens or 0 for o in outputs[::n])
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def response_usage(head: ResponseHead, prompts: list[list[int]], by_choice: Mapping[int, RequestOutput]) -> Body:
    """The usage of one response: its choices' outputs by choice index."""
    return usage_info(prompts, [o for _, o in sorted(by_choice.items())], head.prompt_tokens_details, head.n)


# JSON has no -inf: OpenAI and vLLM send this floor instead
_LOGPROB_FLOOR = -9999.0


def _token_text(token_id: int, lp: Logprob) -> str:
    # an engine without a tokenizer names tokens as vLLM's --return-tokens-as-token-ids does
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def _entry_text(token_id: int, entry: dict[int, Logprob] | None, first_token_text: str | None) -> str:
    if entry is None:  # an echoed prompt's first token
        assert first_token_text is not None, "a token without logprobs is an echoed prompt's first"
        return first_token_text
    return _token_text(token_id, entry[token_id])


def token_texts_length(token_ids: list[int], logprobs: TokenEntries, first_token_text: str | None = None) -> int:
    """How far the tokens' texts move completions' text_offset: a stream counts it as the whole body does, so the
    chunks' logprobs put together are the whole body's (lone bytes of one character each count as U+FFFD)."""
    return sum(len(_entry_text(t, entry, first_token_text)) for t, entry in zip(token_ids, logprobs, strict=True))


def completion_logprobs(token_ids: list[int], logprobs: TokenEntries, text_offset: int,
                        first_token_text: str | None = None) -> Body:
    """The legacy completions form; text_offset: where the first token's text starts in the choice's text. A None
    entry (an echoed prompt's first token, `first_token_text`) has null logprob and top_logprobs, as vLLM's."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        text = _entry_text(token_id, entry, first_token_text)
        tokens.append(text)
        if entry is None:
            token_logprobs.append(None)
            top.append(None)
        else:
            token_logprobs.append(max(entry[token_id].logprob, _LOGPROB_FLOOR))
            top.append({_token_text(t, lp): max(lp.logprob, _LOGPROB_FLOOR) for t, lp in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs_body(prompt_logprobs: PromptLogprobs | None) -> list[Body | None] | None:
    """vLLM's prompt_logprobs field: per prompt token, null for the first, then {token id: {logprob, rank,
    decoded_token}} (-inf floored, as every logprob we send)."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": max(lp.logprob, _LOGPROB_FLOOR), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in entry.items()}
            for entry in prompt_logprobs]


def _chat_logprob(token_id: int, lp: Logprob) -> Body:
    text = _token_text(token_id, lp)
    return {"token": text, "logprob": max(lp.logprob, _LOGPROB_FLOOR), "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(token_ids: list[int], logprobs: TokenEntries, num_top: int) -> Body:
    """The chat form; num_top: the request's top_logprobs (-1: every entry)."""
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        assert entry is not None, "chat has no echo: every token is a generated one"
        # the top entries are ranks 1..num_top; the sampled token's own entry is among them only if it ranks there
        top = sorted((item for item in entry.items() if num_top == -1 or item[1].rank <= num_top),
                     key=lambda item: item[1].rank)
        content.append({**_chat_logprob(token_id, entry[token_id]),
                        "top_logprobs": [_chat_logprob(t, lp) for t, lp in top]})
    return {"content": content}


def _logprobs(head: ResponseHead, token_ids: list[int] | None, logprobs: TokenEntries | None, text_offset: int,
              chat: bool, first_token_text: str | None = None) -> Body | None:
    if head.num_logprobs is None or token_ids is None or logprobs is None:
        return None
    if chat:
        return chat_logprobs(token_ids, logprobs, head.num_logprobs)
    return completion_logprobs(token_ids, logprobs, text_offset, first_token_text)


def _body(head: ResponseHead, object_name: str, choices: list[Body], usage: Body | None) -> Body:
    return {"id": head.id, "object": object_name, "created": head.created, "model": head.model,
            "choices": choices, "usage": usage}


def _completion_choice(index: int, text: str, logprobs: Body | None, finish_reason: str | None,
                       stop_reason: int | str | None) -> Body:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def completion_response(head: ResponseHead, choices: Choices, usage: Body) -> Body:
    bodies = []
    for i, out in choices:
        c = out.outputs[0]
        text, token_ids, logprobs, first = c.text, c.token_ids, c.logprobs, None
        if head.echo is not None:
            p = i // head.n
            text, token_ids, logprobs = echoed(out, head.echo.texts[p], text, token_ids, logprobs,
                                               head.echo.without_generation)
            first = head.echo.first_token_texts[p]
        body = _completion_choice(i, text, _logprobs(head, token_ids, logprobs, 0, False, first), c.finish_reason,
                                  c.stop_reason)
        body["prompt_logprobs"] = prompt_logprobs_body(out.prompt_logprobs)  # vLLM's field, null unless asked
        bodies.append(body)
    return _body(head, "text_completion", bodies, usage)


def chat_completion_response(head: ResponseHead, choices: Choices, usage: Body) -> Body:
    bodies = [{"index": i, "message": {"role": "assistant", "content": o.outputs[0].text},
               "logprobs": _logprobs(head, o.outputs[0].token_ids, o.outputs[0].logprobs, 0, chat=True),
               "finish_reason": o.outputs[0].finish_reason,
               "stop_reason": o.outputs[0].stop_reason}  # as vLLM: the stop string or token id that ended the choice
              for i, o in choices]
    body = _body(head, "chat.completion", bodies, usage)
    # vLLM's field: the one prompt's, once (every choice computed the same)
    body["prompt_logprobs"] = prompt_logprobs_body(choices[0][1].prompt_logprobs) if choices else None
    return body


def completion_chunk(head: ResponseHead, delta: ChoiceDelta | None, usage: Body | None = None) -> Body:
    choices = []
    if delta is not None:
        logprobs = _logprobs(head, delta.token_ids, delta.logprobs, delta.text_offset, False, delta.first_token_text)
        choices = [_completion_choice(delta.index, delta.text, logprobs, delta.finish_reason, delta.stop_reason)]
    # a completion chunk is the same object as the whole body, as in OpenAI's and vLLM's streams
    return _body(head, "text_completion", choices, usage)


def chat_completion_chunk(head: ResponseHead, delta: ChoiceDelta | None, usage: Body | None = None) -> Body:
    choices = []
    if delta is not None:
        message = {"role": "assistant", "content": delta.text} if delta.first else {"content": delta.text}
        logprobs = _logprobs(head, delta.token_ids, delta.logprobs, delta.text_offset, chat=True)
        choices = [{"index": delta.index, "delta": message, "logprobs": logprobs,
                    "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}]
    return _body(head, "chat.completion.chunk", choices, usage)


@dataclass(frozen=True)
class ResponseShapes:
    """The two shapes of one endpoint's answer, so one generation path serves both endpoints."""

    id_prefix: str
    response: Callable[[ResponseHead, Choices, Body], Body]
    chunk: Callable[[ResponseHead, ChoiceDelta | None, Body | None], Body]


COMPLETION = ResponseShapes("cmpl", completion_response, completion_chunk)
CHAT_COMPLETION = ResponseShapes("chatcmpl", chat_completion_response, chat_completion_chunk)
