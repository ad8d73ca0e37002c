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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rimuru", description="Elastic expert offloading MoE serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in _SUBCOMMANDS.values():
        try:
            importlib.import_module(module).register(sub)
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("rimuru"):
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
