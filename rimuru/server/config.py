"""The HTTP server's configuration, built once from the command line (`cli.py`) or by a caller."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str  # the `model` clients must send; any other name gets a 404
    model_path: str = ""  # shown as the model card's `root`
    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 8 * 2**20  # larger request bodies get a 413 before they are parsed
