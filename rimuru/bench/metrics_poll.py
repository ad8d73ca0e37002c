"""Polls a server's Prometheus `/metrics` during a run: the time series behind the memory-split plot."""

from __future__ import annotations

import asyncio
import re
import time

import httpx

_LINE = re.compile(r"^(rimuru:[a-zA-Z_:]+)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)$")
_MODEL_ONLY = re.compile(r'^\{model_name="(?:[^"\\]|\\.)*"\}$')  # the one label every rimuru: sample carries


def parse_metrics(text: str) -> dict[str, float]:
    """`rimuru:` samples labelled only with the served model (histogram buckets and per-layer series are skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m and (not m.group(2) or _MODEL_ONLY.match(m.group(2))):
            out[m.group(1)] = float(m.group(3))
    return out


class MetricsPoller:
    """Background task sampling `/metrics` every `interval` seconds; `samples` holds (t, values)."""

    def __init__(self, base_url: str, interval: float = 0.5) -> None:
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval = interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._task: asyncio.Task | None = None

    async def _loop(self) -> None:
        t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                try:
                    resp = await client.get(self.url)
                    self.samples.append((time.perf_counter() - t0, parse_metrics(resp.text)))
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
