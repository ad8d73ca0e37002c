"""FastAPI app factory: the OpenAI routes over an `AsyncEngine`.

Request lifecycle (one generation request):
1. `auth.py` checks the API key (401).
2. `request_body.py` enforces the size limit (413), parses JSON (400), validates fields (400) and the
   model name (404).
3. `prompts.py` turns the prompt or chat messages into token ids (`openai_routes.py`).
4. `serving.py` rejects unsupported fields (400), builds one engine request per prompt x choice with
   `sampling.py`, and `AsyncEngine.add` adds them all or none (the engine's ValueError -> 400).
5. Outputs arrive on the request's `RequestStream`: streamed as SSE deltas (`streaming.py`) or collected
   into one body (`responses.py`).
6. Whatever happens (finish, client gone, error), `RequestStream.close()` aborts what is left.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from rimuru.server.async_engine import AsyncEngine, EngineLike
from rimuru.server.config import ServerConfig
from rimuru.server.debug_routes import debug_router
from rimuru.server.errors import install_error_handlers
from rimuru.server.health_routes import health_router
from rimuru.server.metrics import ServerMetrics
from rimuru.server.openai_routes import openai_router
from rimuru.server.state import ServerState

__all__ = ["ServerConfig", "build_app"]


def build_app(engine: EngineLike, config: ServerConfig, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine`; `on_shutdown` runs once the engine thread has stopped, at the end of
    the app's lifespan (the CLI's server shuts its engine down there: its tensor-parallel workers exit before the
    process does, also on SIGTERM, after which uvicorn ends the process with the signal's status)."""
    # The metrics read the AsyncEngine's stats snapshot and observe the requests it finishes, so each needs
    # the other: the snapshot is read through a closure over the AsyncEngine made on the next line.
    metrics = ServerMetrics(lambda: async_engine.stats(), config.served_model_name, engine.max_model_len,
                            engine.step_metrics)
    async_engine = AsyncEngine(engine, on_finished=metrics.observe_finished)
    state = ServerState(config, async_engine, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        async_engine.shutdown()
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="Rimuru", lifespan=lifespan)
    install_error_handlers(app, metrics.count_error)
    app.include_router(openai_router(state))
    app.include_router(health_router(state))
    app.include_router(debug_router(state))
    return app
