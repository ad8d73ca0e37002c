"""The engine's step profiler (engine/step_profiler.py) over HTTP, for benchmarks/serve_sweep.py.

POST /debug/step_profile?steps=N profiles the next N engine steps; GET /debug/step_profile reads the
report (per step kind: host phases, GPU forward time, expert waits).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from rimuru.server.auth import require_api_key
from rimuru.server.errors import APIError
from rimuru.server.state import ServerState

MAX_PROFILE_STEPS = 1_000_000


def debug_router(state: ServerState) -> APIRouter:
    router = APIRouter(dependencies=[Depends(require_api_key(state.config.api_key))])

    @router.post("/debug/step_profile")
    async def start_step_profile(steps: int = 2000) -> dict[str, int]:
        if not 1 <= steps <= MAX_PROFILE_STEPS:
            raise APIError(400, f"steps must be in [1, {MAX_PROFILE_STEPS}], got {steps}", param="steps")
        # trace_steps=0: no kernel tracing, which would slow the very steps a sweep measures
        await state.engine.run_in_engine_thread(lambda e: e.enable_step_profiler(steps, trace_steps=0))
        return {"profiling_steps": steps}

    @router.get("/debug/step_profile")
    async def step_profile() -> dict[str, Any]:
        report = await state.engine.run_in_engine_thread(lambda e: e.step_profile_report())
        if report is None:
            raise APIError(404, "no step profile: POST /debug/step_profile first", code="not_found")
        # the per-step rows are too long for a sweep row; the per-kind means stay
        return {key: value for key, value in report.items() if key != "steps"}

    return router
