"""What benchmarks/serve_sweep.py reads of a serving engine over HTTP.

POST /debug/step_profile?steps=N profiles the next N engine steps (engine/step_profiler.py); GET
/debug/step_profile reads the report (per step kind: host phases, GPU forward time, expert waits).
POST /debug/expert_routing marks the routing counted so far; GET /debug/expert_routing gives what the engine's
passes routed since the mark (since the start without one), per layer and expert: the counts (`routed_counts`)
beside their shares in the format of `rimuru profile`'s ranking file (elastic mode counts them; 404 elsewhere).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter, Depends

from rimuru.experts.popularity import ExpertPopularity
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

    routing_mark: list[np.ndarray] = []  # the counts at the last POST (none yet: from the start)

    async def routed() -> tuple[np.ndarray, str]:
        counts = await state.engine.run_in_engine_thread(lambda e: e.observed_routing())
        if counts is None:
            raise APIError(404, "no routing observed: only elastic mode counts it", code="not_found")
        return counts, state.config.served_model_name

    @router.post("/debug/expert_routing")
    async def mark_expert_routing() -> dict[str, int]:
        counts, _ = await routed()
        routing_mark[:] = [counts]
        return {"marked_assignments": int(counts.sum())}

    @router.get("/debug/expert_routing")
    async def expert_routing() -> dict[str, Any]:
        counts, model = await routed()
        if routing_mark:
            counts = counts - routing_mark[0]
        try:
            profile = ExpertPopularity.from_counts(model, counts)
        except ValueError as e:
            raise APIError(404, f"no routing observed: {e}", code="not_found") from None
        return {**profile.to_json(), "routed_counts": counts.tolist()}

    return router
