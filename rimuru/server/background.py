"""Run the server in-process on a free loopback port (tests, soak runs, notebooks)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn

from rimuru.server.app import build_app
from rimuru.server.async_engine import EngineLike
from rimuru.server.config import ServerConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class BackgroundServer:
    """`with BackgroundServer(engine, config) as srv: srv.url` — uvicorn on a thread, stopped on exit."""

    def __init__(self, engine: EngineLike, config: ServerConfig, port: int | None = None) -> None:
        self.app = build_app(engine, config)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                     log_level="warning", timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._server.run, name="rimuru-http", daemon=True)

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
