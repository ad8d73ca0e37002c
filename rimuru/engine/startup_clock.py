"""Where an engine's start-up time goes: wall seconds per phase, logged once when the engine is ready.

A server of a 30B model starts in 30 s to over 2 minutes depending on the mode (building the model, the workspace
profile, pinning the host expert store, drawing or reading the weights, capturing the graphs); this names the
phases so that a slow start says which one it was. Each phase also has a short key (`PHASE_KEYS`), under which
`seconds` holds its time: the engine's stats and /metrics carry them (`rimuru:startup_<key>_seconds`), so a serving
sweep records where each server's start went.
"""

from __future__ import annotations

import time

# the engine's start-up phases, in order (engine/llm_engine.py); a phase a start skips (graphs when eager) is absent
PHASE_KEYS = ("model", "memory_plan", "pool", "weights", "graphs")


class StartupClock:
    def __init__(self) -> None:
        self._last = self._start = time.monotonic()
        self.phases: list[tuple[str, float, list[tuple[str, float]]]] = []  # (phase, seconds, parts), in order
        self._parts: list[tuple[str, float]] = []
        self.seconds: dict[str, float] = {}  # PHASE_KEYS -> seconds, for the phases marked so far

    def mark(self, phase: str, key: str) -> None:
        """The phase that ends now (since the previous mark or the clock's start), `key` one of PHASE_KEYS."""
        if key not in PHASE_KEYS:
            raise ValueError(f"start-up phase key {key!r} is not one of {PHASE_KEYS}")
        now = time.monotonic()
        self.phases.append((phase, now - self._last, self._parts))
        self.seconds[key] = self.seconds.get(key, 0.0) + now - self._last
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
