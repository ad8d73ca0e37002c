"""FastAPI app factory: the OpenAI routes over an `AsyncEngine`.

Request lifecycle (one HTTP request):
1. `_read_body` enforces the size limit (413) and parses JSON (400); pydantic validates fields (400).
2. API key (401), model name (404), unsupported fields (400).
3. Prompts become token ids (`prompts.py`); each prompt x n choices is one engine request.
4. `AsyncEngine.add` adds them all or none (the engine's ValueError -> 400 with its reason).
5. Outputs arrive on the request's queue; streamed as SSE deltas or collected into one body.
6. Whatever happens (finish, client gone, error), `RequestStream.close()` aborts what is left.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from rimuru.engine.outputs import RequestOutput
from rimuru.engine.sampling_params import SamplingParams
from rimuru.server.async_engine import AsyncEngine, EngineDeadError, EngineLike, RequestStream
from rimuru.server.errors import APIError, error_body, install_error_handlers
from rimuru.server.metrics import ServerMetrics
from rimuru.server.prompts import chat_prompt, completion_prompts
from rimuru.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

DISCONNECT_POLL_S = 0.5
T = TypeVar("T", bound=BaseModel)


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    model_path: str = ""
    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20


def build_app(engine: EngineLike, config: ServerConfig) -> FastAPI:
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(async_engine.stats)
    async_engine._on_finished = metrics.observe_finished
    # A model served without a tokenizer (a preset name, random weights) takes token-id prompts only.
    vocab_size = max(len(engine.tokenizer) if engine.tokenizer is not None else 0,
                     int(getattr(engine, "vocab_size", 0) or 0),
                     int(getattr(getattr(engine, "spec", None), "vocab_size", 0) or 0))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="Rimuru", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    install_error_handlers(app, lambda status: metrics.http_errors.labels(str(status)).inc())

    # ---- helpers -----------------------------------------------------------------------------
    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not header:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip(), config.api_key):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    async def read_body(request: Request, model: type[T]) -> T:
        check_auth(request)
        limit = config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(
                413, f"request body of {declared} bytes exceeds the {limit}-byte limit", code="body_too_large"
            )
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body exceeds the {limit}-byte limit", code="body_too_large")
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from exc
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            req = model.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise APIError(400, f"{param}: {err['msg']}", param=param, code="invalid_value") from exc
        if req.model != config.served_model_name:  # type: ignore[attr-defined]
            raise APIError(
                404,
                f"the model '{req.model}' does not exist; "  # type: ignore[attr-defined]
                f"this server serves '{config.served_model_name}'",
                param="model",
                code="model_not_found",
            )
        return req

    def reject_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
        checks = [
            ("logprobs", req.logprobs not in (None, False, 0)),
            ("presence_penalty", req.presence_penalty not in (None, 0.0)),
            ("frequency_penalty", req.frequency_penalty not in (None, 0.0)),
            ("repetition_penalty", req.repetition_penalty not in (None, 1.0)),
            ("best_of", req.best_of not in (None, req.n)),
        ]
        if isinstance(req, CompletionRequest):
            checks += [("echo", req.echo), ("suffix", bool(req.suffix))]
        for name, bad in checks:
            if bad:
                raise APIError(400, f"'{name}' is not supported by this server", param=name, code="unsupported")

    def sampling_params(
        req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, prompt_len: int, i: int
    ) -> SamplingParams:
        if max_tokens is not None and max_tokens < 1:
            raise APIError(
                400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens", code="invalid_value"
            )
        limit = async_engine.max_model_len
        if prompt_len >= limit:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens; this model's maximum context length is {limit} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise APIError(
                400,
                f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
                f"maximum context length of {limit} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        try:
            return SamplingParams(
                n=1,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                seed=None if req.seed is None else req.seed + i,
                max_tokens=max_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc

    async def submit(
        req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]], max_tokens: int | None, prefix: str
    ) -> RequestStream:
        reject_unsupported(req)
        base = f"{prefix}-{uuid.uuid4().hex}"
        batch = []
        for p, ids in enumerate(prompts):
            for i in range(req.n):
                batch.append((f"{base}-{p}-{i}", ids, sampling_params(req, max_tokens, len(ids), i)))
        try:
            return await async_engine.add(batch)
        except ValueError as exc:  # the engine's reasons: too long, can never fit in the pool, ...
            raise APIError(400, str(exc), code="invalid_request") from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from exc

    async def collect(request: Request, stream: RequestStream) -> dict[int, RequestOutput]:
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

    def usage(prompts: list[list[int]], outs: dict[int, RequestOutput]) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(len(o.outputs[0].token_ids) for o in outs.values() if o.outputs)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def sse(payload: dict | str) -> str:
        return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

    async def stream_events(
        stream: RequestStream, prompts: list[list[int]], chat: bool, rid: str, include_usage: bool
    ) -> AsyncIterator[str]:
        # Running outputs never carry a possible start of a stop string (the engine holds it back, as vLLM's
        # detokenizer does), so text only ever grows and each delta is what the client has not seen.
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        last: dict[int, RequestOutput] = {}

        def chunk(index: int, out: RequestOutput) -> str | None:
            """The SSE event of what `out` adds for its choice (None: nothing new)."""
            last[index] = out
            c = out.outputs[0]
            if len(c.token_ids) == sent_tokens.get(index, 0) and c.finish_reason is None:
                return None
            start = sent_text.get(index, 0)
            end = len(c.text)
            delta = c.text[start:end]
            if chat:
                d: dict = {"content": delta}
                if index not in sent_tokens:
                    d = {"role": "assistant", "content": delta}
                choice = {"index": index, "delta": d, "logprobs": None, "finish_reason": c.finish_reason}
            else:
                choice = {
                    "index": index,
                    "text": delta,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            sent_text[index] = end
            sent_tokens[index] = len(c.token_ids)
            return sse({"id": rid, "object": obj, "created": created, "model": config.served_model_name,
                        "choices": [choice], "usage": None})

        try:
            while not stream.done():
                # a batch: every output queued for this stream, the latest per choice (a lagging loop coalesces)
                for index, out in await stream.next_batch():
                    event = chunk(index, out)
                    if event is not None:
                        yield event
            if include_usage:
                yield sse(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": config.served_model_name,
                        "choices": [],
                        "usage": usage(prompts, last),
                    }
                )
        except Exception as exc:  # headers are gone: report in-band, as OpenAI does
            status = 503 if isinstance(exc, EngineDeadError) else 500
            metrics.http_errors.labels(str(status)).inc()
            yield sse(error_body(status, f"generation failed: {exc}", code="engine_error"))
        finally:
            stream.close()
        yield sse("[DONE]")

    def streaming_response(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    # ---- routes ------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not async_engine.healthy:
            return JSONResponse(error_body(503, "engine loop is not running", code="engine_dead"), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # Step profiler (engine/step_profiler.py) of a serving engine: POST starts it for `steps` steps, GET reads
    # the report (per step kind: host phases, GPU forward time, expert waits). For benchmarks/serve_sweep.py.
    @app.post("/debug/step_profile")
    async def start_step_profile(request: Request, steps: int = 2000) -> dict:
        check_auth(request)
        if not 1 <= steps <= 1_000_000:
            raise APIError(400, f"steps must be in [1, 1000000], got {steps}", param="steps")
        if not hasattr(engine, "enable_step_profiler"):
            raise APIError(404, "this engine has no step profiler", code="not_found")
        await async_engine.run_in_engine_thread(lambda: engine.enable_step_profiler(steps, trace_steps=0))
        return {"profiling_steps": steps}

    @app.get("/debug/step_profile")
    async def step_profile(request: Request) -> dict:
        check_auth(request)
        prof = getattr(engine, "step_profiler", None)
        if prof is None:
            raise APIError(404, "no step profile: POST /debug/step_profile first", code="not_found")
        report = await async_engine.run_in_engine_thread(prof.report)
        report.pop("steps", None)  # per-step rows: too long for a sweep row; the per-kind means stay
        return report

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_auth(request)
        card = ModelCard(
            id=config.served_model_name,
            root=config.model_path or config.served_model_name,
            max_model_len=async_engine.max_model_len,
        )
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await read_body(request, CompletionRequest)
        prompts = completion_prompts(async_engine.tokenizer, req.prompt, vocab_size)
        stream = await submit(req, prompts, req.max_tokens, "cmpl")
        rid = stream.request_ids[0].rsplit("-", 2)[0]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return streaming_response(stream_events(stream, prompts, False, rid, include_usage))
        outs = await collect(request, stream)
        choices = [
            {
                "index": i,
                "text": o.outputs[0].text,
                "logprobs": None,
                "finish_reason": o.outputs[0].finish_reason,
                "stop_reason": o.outputs[0].stop_reason,
            }
            for i, o in sorted(outs.items())
        ]
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": config.served_model_name,
                "choices": choices,
                "usage": usage(prompts, outs),
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await read_body(request, ChatCompletionRequest)
        prompts = [chat_prompt(async_engine.tokenizer, req.messages)]
        stream = await submit(req, prompts, req.token_limit(), "chatcmpl")
        rid = stream.request_ids[0].rsplit("-", 2)[0]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return streaming_response(stream_events(stream, prompts, True, rid, include_usage))
        outs = await collect(request, stream)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": o.outputs[0].text},
                "logprobs": None,
                "finish_reason": o.outputs[0].finish_reason,
            }
            for i, o in sorted(outs.items())
        ]
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": config.served_model_name,
                "choices": choices,
                "usage": usage(prompts, outs),
            }
        )

    return app
