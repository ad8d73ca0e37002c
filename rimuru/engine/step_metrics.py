"""Per-step numbers of the engine, kept in a bounded ring: what the paper plots, read by benchmarks."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StepMetrics:
    t: float  # seconds since the engine started, at the end of the step
    step_time_s: float  # host wall time of the whole step (scheduling, adjusting, forward, outputs)
    num_tokens: int  # tokens in the forward pass (0: nothing ran)
    cuda_graph: bool  # the forward pass replayed a decode graph
    running: int
    waiting: int
    kv_pages_used: int
    resident_experts: int
    evictions: int  # decided this step
    grows: int  # decided this step
    bytes_loaded: int  # expert bytes copied host -> device during this step (loads, prefetches, grows)
    expert_bytes: int  # pool bytes held by expert pages (resident experts + load buffers)
    kv_bytes: int  # pool bytes held by KV pages
    free_bytes: int  # the rest of the pool
    state_bytes: int = 0  # pool bytes held by requests' state pages (hybrid models)


class StepMetricsRing:
    def __init__(self, capacity: int = 100_000) -> None:
        self.steps: deque[StepMetrics] = deque(maxlen=capacity)

    def append(self, m: StepMetrics) -> None:
        self.steps.append(m)

    def clear(self) -> None:
        self.steps.clear()

    def __len__(self) -> int:
        return len(self.steps)

    def timeline(self) -> dict[str, list[Any]]:
        """Column-wise: {"t": [...], "running": [...], ...} (the shape rimuru.sim.plot draws)."""
        rows = [asdict(m) for m in self.steps]
        keys = list(StepMetrics.__dataclass_fields__)
        return {k: [r[k] for r in rows] for k in keys}
