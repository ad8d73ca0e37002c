"""The API key check: a FastAPI dependency on the routes that need it (/v1 and /debug, not /health or /metrics)."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from fastapi import Request

from rimuru.server.errors import APIError


def require_api_key(api_key: str | None) -> Callable[[Request], None]:
    def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not header:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        scheme, _, key = header.partition(" ")
        # compare_digest: the time taken must not tell how much of a guessed key was right
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip(), api_key):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    return check
