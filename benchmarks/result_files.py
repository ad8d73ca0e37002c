"""Names of committed result files: `benchmarks/results/DATE-sN-...` (DATE the day, N the session that day)."""

from __future__ import annotations

import re
from pathlib import Path

_RUN = re.compile(r"(\d{4}-\d{2}-\d{2})-s(\d+)-")


def run_of(path: str | Path) -> str | None:
    """`DATE-sN` of a committed result file's name, or None for another name."""
    m = _RUN.match(Path(path).name)
    return f"{m.group(1)}-s{m.group(2)}" if m else None


def session_of(path: str | Path) -> str | None:
    """`sN`, the short form a plot's legend uses, or None."""
    run = run_of(path)
    return run.rpartition("-")[2] if run else None


def run_order(run: str) -> tuple[str, int]:
    """Sort key: `2026-11-30-s10` after `2026-11-30-s8` (a string sort puts it first)."""
    date, _, n = run.rpartition("-s")
    return date, int(n)
