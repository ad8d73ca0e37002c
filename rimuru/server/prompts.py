"""Turn OpenAI prompts and chat messages into token ids.

User text is tokenized with `split_special_tokens=True`, so a string such as "<|im_end|>" typed by a
user stays plain text and never becomes a control token. For chat, the checkpoint's template is
rendered with a placeholder per message; the template's own text (which holds the real control
tokens) is tokenized normally and each message's content as user text.
"""

from __future__ import annotations

import uuid
from typing import Any, cast

from rimuru.server.errors import APIError
from rimuru.server.protocol import ChatMessage, PromptInput


def tokenize_user_text(tokenizer: Any, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """`text` as plain user text. JSON can carry a lone UTF-16 surrogate ("\\ud800") that is no Unicode text: it
    is refused as the request's mistake (a tokenizer would fail on it with a server error)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} holds {e.object[e.start:e.end]!a} at character {e.start}, a lone UTF-16 "
                            "surrogate: not valid Unicode text", param=param, code="invalid_text") from None
    return list(tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True).input_ids)


def prompt_items(prompt: PromptInput) -> list[str | list[int]]:
    """The prompts of a completions request, each a text or token ids; OpenAI allows str, [str], [int] and [[int]]."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt", code="empty_prompt")
    if isinstance(prompt[0], int):  # pydantic's union members are homogeneous lists
        return [cast(list[int], list(prompt))]
    return cast(list[str | list[int]], list(prompt))


def completion_prompts(tokenizer: Any, prompt: PromptInput, vocab_size: int) -> list[list[int]]:
    """One token-id list per prompt (`prompt_items`)."""
    result: list[list[int]] = []
    for item in prompt_items(prompt):
        if isinstance(item, str):
            if not item:
                raise APIError(400, "prompt must not be empty", param="prompt", code="empty_prompt")
            if tokenizer is None:
                raise APIError(400, "this model is served without a tokenizer: send the prompt as token ids",
                               param="prompt", code="no_tokenizer")
            ids = tokenize_user_text(tokenizer, item, add_special_tokens=True, param="prompt")
        else:
            ids = list(item)
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                msg = f"token id {bad[0]} is out of range for a vocabulary of {vocab_size}"
                raise APIError(400, msg, param="prompt", code="invalid_token_id")
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt", code="empty_prompt")
        result.append(ids)
    return result


def chat_prompt(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    if tokenizer is None or tokenizer.chat_template is None:
        raise APIError(400, "the model has no chat template; use /v1/completions", param="messages")
    if all(not m.text() for m in messages):
        raise APIError(400, "messages must not all be empty", param="messages", code="empty_prompt")
    marks = [f"\x00rimuru{uuid.uuid4().hex}\x00" for _ in messages]
    conv = [{"role": m.role, "content": mark} for m, mark in zip(messages, marks, strict=True)]
    try:
        rendered = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # templates may reject role orders (e.g. two system messages)
        raise APIError(400, f"chat template failed: {exc}", param="messages") from exc
    ids: list[int] = []
    rest = rendered
    for msg, mark in zip(messages, marks, strict=True):
        head, sep, tail = rest.partition(mark)
        if not sep:  # the template dropped or transformed the content: fall back to safe text only
            raise APIError(400, "chat template does not keep message content verbatim", param="messages")
        ids += tokenizer(head, add_special_tokens=False).input_ids if head else []
        ids += tokenize_user_text(tokenizer, msg.text(), add_special_tokens=False, param="messages") \
            if msg.text() else []
        rest = tail
    ids += tokenizer(rest, add_special_tokens=False).input_ids if rest else []
    return ids
