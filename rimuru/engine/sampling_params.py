"""Per-request sampling settings, named and validated as vLLM's `SamplingParams`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class InvalidParam(ValueError):
    """A sampling parameter's value refused, with the parameter's name (the server's 400 names it as `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    # vLLM's / OpenAI's penalties, applied to a row's raw logits before temperature (engine/penalties.py):
    # presence and frequency over the generated tokens, in [-2, 2]; repetition over the prompt's and the generated
    # tokens, > 0 (1: off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # top log-probabilities returned per generated token, beside the sampled token's own (-1: the whole
    # vocabulary); None: none. Bounded by the engine's max_logprobs.
    logprobs: int | None = None
    # vLLM's: the prompt tokens' logprobs (each after the first, given those before it) and this many top ones (-1:
    # the whole vocabulary); None: none. Bounded by max_logprobs; such a request does not start from a cached prefix.
    prompt_logprobs: int | None = None
    # vLLM's: before this many generated tokens neither EOS nor stop_token_ids can be sampled (the sampler masks
    # them) and stop strings do not stop
    min_tokens: int = 0
    # vLLM's / OpenAI's: token id -> value added to its logit before temperature (and top-k / top-p), in
    # [-100, 100]; the logprobs are the raw model's, without it
    logit_bias: dict[int, float] | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not -2.0 <= value <= 2.0:
                raise InvalidParam(name, f"{name} must be in [-2, 2], got {value!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r) or r <= 0.0:
            raise InvalidParam("repetition_penalty",
                               f"repetition_penalty must be a finite number greater than zero, got {r!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits ([-2**63, 2**64)), got {self.seed}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < -1):
            raise ValueError(f"logprobs must be a non-negative integer or -1 (the whole vocabulary), "
                             f"got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or self.prompt_logprobs < -1):
            raise InvalidParam("prompt_logprobs", f"prompt_logprobs must be a non-negative integer or -1 (the whole "
                                                  f"vocabulary), got {self.prompt_logprobs!r}")
        for t, bias in (self.logit_bias or {}).items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {t!r}")
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {t}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stop_strings = tuple(stops)
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on: only such requests hold penalty state (engine/penalties.py)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
