"""Default sampling parameters from the model's `generation_config.json`, as vLLM's `--generation-config` reads them.

    --generation-config auto   the model directory's generation_config.json (vLLM's default)
    --generation-config vllm   none: the engine's own defaults (temperature 1, top-p 1, no top-k)
    --generation-config DIR    DIR/generation_config.json

A request's own value always wins; a default fills only what the request leaves out. The fields read are vLLM's:
temperature, top_p, top_k, repetition_penalty and max_new_tokens. Fields that are not applied are named in the
start-up log instead of being dropped without a word: min_p (not served), and presence_penalty and
frequency_penalty, which vLLM does not read from a generation config either (a request may still set them).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from rimuru.engine.sampling_params import SamplingParams

logger = logging.getLogger("rimuru")

_NOT_APPLIED = ("presence_penalty", "frequency_penalty", "min_p")


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None  # generation_config's max_new_tokens
    repetition_penalty: float | None = None


def load_sampling_defaults(choice: str, model_path: str) -> SamplingDefaults:
    if choice == "vllm":
        return SamplingDefaults()
    folder = Path(model_path) if choice == "auto" else Path(choice)
    if choice != "auto" and not folder.is_dir():
        raise ValueError(f"--generation-config {choice!r}: not 'auto', 'vllm' or a directory")
    path = folder / "generation_config.json"
    if not path.is_file():
        if choice != "auto":
            raise ValueError(f"--generation-config {choice!r}: the directory has no generation_config.json")
        return SamplingDefaults()  # a preset or a folder without one: nothing to default
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    unused = [k for k in _NOT_APPLIED if k in raw and raw[k] not in (None, 0, 0.0, 1, 1.0)]
    if unused:
        logger.warning("generation config %s sets %s, which this server does not apply", path, ", ".join(unused))
    defaults = SamplingDefaults(temperature=_number(raw, "temperature", float), top_p=_number(raw, "top_p", float),
                                top_k=_number(raw, "top_k", int), max_tokens=_number(raw, "max_new_tokens", int),
                                repetition_penalty=_number(raw, "repetition_penalty", float))
    if defaults.repetition_penalty is not None:  # a bad default would fail every request: say so at start
        try:
            SamplingParams(repetition_penalty=defaults.repetition_penalty)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    logger.info("default sampling parameters from %s: %s", path, defaults)
    return defaults


def _number(raw: dict, key: str, kind: type) -> float | int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"generation_config.json: {key} must be a number, got {value!r}")
    return kind(value)
