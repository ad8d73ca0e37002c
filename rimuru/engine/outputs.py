"""What the engine returns to callers: vLLM-shaped `RequestOutput` / `CompletionOutput`.

Outputs are cumulative (the whole text and token list so far, and the logprobs of every token so far), as in
vLLM; streaming callers compute deltas themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """One candidate token at one generated position, as vLLM's: its log-probability under the raw model
    distribution (before temperature, top-k and top-p), its rank there (1: the most likely), and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None  # None: the engine has no tokenizer


# Per generated token: the sampled token and the requested top tokens, by token id. The sampled token comes
# first, then the top ones by rank; a sampled token that is also a top one appears once, with its top rank.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token, as vLLM's: None for the first (nothing predicts it), then the prompt token's entry first and the
# requested top tokens, shaped as a SampleLogprobs entry.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: SampleLogprobs | None = None  # one entry per token of token_ids; None: not requested

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (vLLM's field); None: not admitted
    # SamplingParams.prompt_logprobs asked: one entry per prompt token, whole by the first output with a token
    prompt_logprobs: PromptLogprobs | None = None
