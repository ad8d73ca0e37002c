"""The time per output token of recently finished requests, as users measure it: (finish - first token) / (tokens - 1).

The elastic adjuster's SLO mode reads its p99 (engine -> StepDemand -> AdjusterState) to correct its model of a
decode step against what requests really saw: mixed prefill steps, routing reads and copies the model misses.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from rimuru.engine.outputs import RequestOutput

WINDOW = 64  # finished requests the p99 is taken over
MIN_SAMPLES = 16  # fewer than this: no estimate


def recent_p99(values: list[float] | deque[float], window: int = WINDOW,
               min_samples: int = MIN_SAMPLES) -> float | None:
    """The p99 of the last `window` values; None with fewer than `min_samples`."""
    recent = list(values)[-window:]
    if len(recent) < min_samples:
        return None
    return float(np.percentile(np.asarray(recent, dtype=np.float64), 99))


class RecentTpot:
    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need window >= 1 and 1 <= min_samples <= window, got {window}, {min_samples}")
        self._values: deque[float] = deque(maxlen=window)
        self.min_samples = min_samples
        self.count = 0  # requests observed since the start (the adjuster updates once per batch of new ones)
        self._p99: tuple[int, float | None] = (0, None)  # (count it was computed at, p99): the engine asks every step

    def observe(self, output: RequestOutput) -> None:
        """A finished request's TPOT, when it produced at least two tokens."""
        m = output.metrics
        if not output.finished or m is None or m.first_token_time is None or m.finished_time is None:
            return
        tokens = max((len(c.token_ids) for c in output.outputs), default=0)
        if tokens < 2:
            return
        self._values.append((m.finished_time - m.first_token_time) / (tokens - 1))
        self.count += 1

    def p99_s(self) -> float | None:
        """None until `min_samples` requests have finished. Recomputed only after a new observation."""
        if self._p99[0] != self.count:
            self._p99 = (self.count, recent_p99(self._values, self._values.maxlen or WINDOW, self.min_samples))
        return self._p99[1]
