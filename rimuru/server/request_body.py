"""Reading an OpenAI request body: size limit (413), JSON (400), pydantic fields (400), model name (404)."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import ValidationError

from rimuru.server.config import ServerConfig
from rimuru.server.errors import APIError
from rimuru.server.protocol import UNION_FIELD_HELP, GenerationRequest

G = TypeVar("G", bound=GenerationRequest)


async def read_request(request: Request, model: type[G], config: ServerConfig) -> G:
    body = await _read_limited(request, config.max_body_bytes)
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
        field = str(err["loc"][0]) if err["loc"] else None
        if field in UNION_FIELD_HELP:
            raise APIError(400, UNION_FIELD_HELP[field], param=field, code="invalid_value") from exc
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}", param=param, code="invalid_value") from exc
    if req.model not in config.served_model_names:
        raise APIError(
            404,
            f"the model '{req.model}' does not exist; this server serves "
            f"{', '.join(repr(n) for n in config.served_model_names)}",
            param="model",
            code="model_not_found",
        )
    return req


async def _read_limited(request: Request, limit: int) -> bytes:
    # The declared length turns a too-large body away unread; the running count catches a body that lies
    # about its length or is chunked.
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body exceeds the {limit}-byte limit", code="body_too_large")
    return bytes(body)
