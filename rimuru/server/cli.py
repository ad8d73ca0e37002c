"""`rimuru serve MODEL [engine flags] --host --port --api-key --served-model-name`."""

from __future__ import annotations

import argparse
import logging
import os

from rimuru.config import EngineConfig, add_engine_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("RIMURU_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (env RIMURU_API_KEY)",
    )
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model names clients may send, the first one in responses (default: MODEL)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger request bodies get 413")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from rimuru.engine.llm_engine import LLMEngine
    from rimuru.engine.setup import start_or_exit
    from rimuru.server.app import build_app
    from rimuru.server.config import ServerConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig.from_cli_args(args)
    engine = start_or_exit(lambda: LLMEngine(config))
    server_config = ServerConfig.from_cli_args(args.served_model_name, args.model, args.api_key, args.max_body_bytes)
    app = build_app(engine, server_config)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
