"""Which run a committed result file belongs to, read from its metadata (benchmarks/common.metadata), not its name.

A run is one build of the engine: files whose `git_commit` agrees were measured by the same code, so a plot may
join their rows into one line and a comparison may pair them; rows of different commits are kept apart. The
file's `date` (ISO 8601, UTC) orders runs in time.
"""

from __future__ import annotations

from typing import Any


def run_of(doc: dict[str, Any]) -> str | None:
    """The short commit (7 hex digits) a result file was measured with, or None when it records none."""
    commit = doc.get("git_commit") or doc.get("commit")
    return str(commit)[:7] if commit else None


def measured_at(doc: dict[str, Any]) -> str:
    """The file's ISO date ('' when it has none): sorting by it sorts runs in time."""
    return str(doc.get("date") or "")
