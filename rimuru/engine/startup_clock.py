"""Where an engine's start-up time goes: wall seconds per phase, logged once when the engine is ready.

A server of a 30B model starts in 30 s to over 2 minutes depending on the mode (building the model, the workspace
profile, pinning the host expert store, drawing or reading the weights, capturing the graphs); this names the
phases so that a slow start says which one it was.
"""

from __future__ import annotations

import time


class StartupClock:
    def __init__(self) -> None:
        self._last = self._start = time.monotonic()
        self.phases: list[tuple[str, float, list[tuple[str, float]]]] = []  # (phase, seconds, parts), in order
        self._parts: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        """The phase that ends now (since the previous mark or the clock's start)."""
        now = time.monotonic()
        self.phases.append((phase, now - self._last, self._parts))
        self._parts = []
        self._last = now

    def add(self, part: str, seconds: float) -> None:
        """A part of the phase the next `mark` closes, timed by its caller."""
        self._parts.append((part, seconds))

    @property
    def total_s(self) -> float:
        return self._last - self._start

    def describe(self) -> str:
        def one(name: str, seconds: float, parts: list[tuple[str, float]]) -> str:
            inner = ", ".join(f"{p} {s:.1f} s" for p, s in parts)
            return f"{name} {seconds:.1f} s" + (f" (of which {inner})" if inner else "")

        return ", ".join(one(*phase) for phase in self.phases) + f"; total {self.total_s:.1f} s"
