"""What monitoring and clients ask about the server: GET /health, /metrics (Prometheus) and /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from rimuru.server.auth import require_api_key
from rimuru.server.errors import error_body
from rimuru.server.protocol import ModelCard, ModelList
from rimuru.server.state import ServerState


def health_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    # /health and /metrics need no key: load balancers and scrapers do not hold one
    @router.get("/health")
    async def health() -> Response:
        if not state.engine.healthy:
            return JSONResponse(error_body(503, "engine loop is not running", code="engine_dead"), 503)
        return Response(status_code=200)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.get("/v1/models", dependencies=[Depends(require_api_key(state.config.api_key))])
    async def show_available_models() -> dict:
        config = state.config
        cards = [ModelCard(id=name, root=config.model_path or config.served_model_name,
                           max_model_len=state.engine.max_model_len) for name in config.served_model_names]
        return ModelList(data=cards).model_dump()

    return router
