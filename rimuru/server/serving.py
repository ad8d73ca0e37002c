"""One generation request, shared by /v1/completions and /v1/chat/completions once their prompts are tokens.

    prompts x n choices --submit--> one RequestStream --stream=true--> SSE chunks (streaming.py)
                                                       --stream=false-> collect -> one body (responses.py)

Every engine request is added or none is (`AsyncEngine.add`), and every path out, including a client
that vanished, closes the stream, which aborts what is still running.
"""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rimuru.engine.outputs import RequestOutput
from rimuru.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from rimuru.server.echo import Echo
from rimuru.server.errors import APIError
from rimuru.server.generation_config import SamplingDefaults
from rimuru.server.protocol import GenerationRequest
from rimuru.server.responses import ResponseHead, ResponseShapes, response_usage
from rimuru.server.sampling import NO_DEFAULTS, reject_unsupported, to_sampling_params
from rimuru.server.state import ServerState
from rimuru.server.streaming import event_stream_response, stream_events

logger = logging.getLogger("rimuru")

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


async def create_response(
    request: Request, state: ServerState, req: GenerationRequest, prompts: list[list[int]], shapes: ResponseShapes,
    echo: Echo | None = None,
) -> Response:
    """`echo`: completions' echo of the prompts (server/echo.py)."""
    head = ResponseHead(f"{shapes.id_prefix}-{uuid.uuid4().hex}", int(time.time()), state.config.served_model_name,
                        req.num_logprobs(), state.config.enable_prompt_tokens_details, req.n, echo)
    stream = await submit(state.engine, req, prompts, head.id, state.config.sampling_defaults)
    if state.config.enable_log_requests:
        logger.info("request %s: %d prompt(s) of %s tokens, n=%d, max_tokens=%s, temperature=%s, top_p=%s, "
                    "stream=%s", head.id, len(prompts), [len(p) for p in prompts], req.n, req.max_tokens,
                    req.temperature, req.top_p, req.stream)
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        events = stream_events(stream, head, shapes.chunk, prompts, include_usage, state.metrics.count_error)
        return event_stream_response(events)
    outs = await collect(request, stream)
    return JSONResponse(shapes.response(head, sorted(outs.items()), response_usage(head, prompts, outs)))


async def submit(
    engine: AsyncEngine, req: GenerationRequest, prompts: list[list[int]], response_id: str,
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> RequestStream:
    """Adds one engine request per prompt and choice, `{response_id}-{prompt}-{choice}`; the stream numbers
    them in that order, which is the OpenAI choice index."""
    reject_unsupported(req)
    batch = [
        (f"{response_id}-{p}-{i}", ids, to_sampling_params(req, len(ids), engine.max_model_len, i, defaults))
        for p, ids in enumerate(prompts)
        for i in range(req.n)
    ]
    try:
        return await engine.add(batch, n=req.n)
    except ValueError as exc:  # the engine's reasons: too long, can never fit in the pool, over max_logprobs, ...
        raise APIError(400, str(exc), param=getattr(exc, "param", None), code="invalid_request") from exc
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from exc


async def collect(request: Request, stream: RequestStream) -> dict[int, RequestOutput]:
    """The final output of each choice; stops early (and aborts the rest) when the client disconnects."""
    final: dict[int, RequestOutput] = {}
    next_check = time.monotonic() + DISCONNECT_POLL_S
    try:
        while not stream.done():
            try:
                index, out = await stream.next(timeout=DISCONNECT_POLL_S)
                if out.finished:
                    final[index] = out
            except TimeoutError:
                pass
            # checked by the clock, not only when outputs pause: a busy engine streams one per step
            if time.monotonic() >= next_check:
                if await request.is_disconnected():
                    return final
                next_check = time.monotonic() + DISCONNECT_POLL_S
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from exc
    except Exception as exc:
        raise APIError(500, f"generation failed: {exc}", code="engine_error") from exc
    finally:
        stream.close()
    return final
