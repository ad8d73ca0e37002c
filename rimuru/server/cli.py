"""`rimuru serve MODEL [engine flags] --host --port --api-key --served-model-name --chat-template ...`."""

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
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template, or a file holding one, instead of the tokenizer's (vLLM's flag)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log every request's id, prompt length and sampling parameters")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage reports prompt_tokens_details.cached_tokens (prompt tokens from the prefix cache)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="default sampling parameters: the model's generation_config.json (auto), none (vllm), or "
                        "DIR/generation_config.json; a request's own values win")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines; no remote code runs (Rimuru's model classes are its own)")
    p.set_defaults(func=run)


def read_chat_template(value: str) -> str:
    """`--chat-template` as vLLM reads it: a path to a file holding the template, else the template itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:  # neither a file nor a Jinja template: most likely a mistyped path
        raise SystemExit(f"error: --chat-template {value!r} is neither a file nor a Jinja template")
    return value


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from rimuru.engine.llm_engine import LLMEngine
    from rimuru.engine.setup import start_or_exit
    from rimuru.server.app import build_app
    from rimuru.server.config import ServerConfig
    from rimuru.server.generation_config import load_sampling_defaults

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig.from_cli_args(args)
    if args.trust_remote_code:
        logging.getLogger("rimuru").info("--trust-remote-code: accepted; no remote code runs (Rimuru's model "
                                         "classes are its own)")
    template = read_chat_template(args.chat_template) if args.chat_template else None
    try:
        defaults = load_sampling_defaults(args.generation_config, args.model)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    engine = start_or_exit(lambda: LLMEngine(config))
    if template is not None:
        if engine.tokenizer is None:
            raise SystemExit("error: --chat-template needs a model with a tokenizer")
        engine.tokenizer.chat_template = template
    server_config = ServerConfig.from_cli_args(args.served_model_name, args.model, args.api_key, args.max_body_bytes,
                                               enable_log_requests=args.enable_log_requests,
                                               enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                                               sampling_defaults=defaults)
    app = build_app(engine, server_config, on_shutdown=engine.shutdown)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
