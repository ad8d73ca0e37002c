"""What every route handler reads: the frozen config and the running parts, built once by `build_app`."""

from __future__ import annotations

from dataclasses import dataclass

from rimuru.server.async_engine import AsyncEngine
from rimuru.server.config import ServerConfig
from rimuru.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerState:
    config: ServerConfig
    engine: AsyncEngine  # the only way to the engine: its thread owns it
    metrics: ServerMetrics
