"""What the engine returns to callers: vLLM-shaped `RequestOutput` / `CompletionOutput`.

Outputs are cumulative (the whole text and token list so far), as in vLLM; streaming callers
compute deltas themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

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
