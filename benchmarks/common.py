"""Shared benchmark plumbing: run metadata, CUDA-graph and eager timing, JSON / Markdown output.

Timing (see .library/device/METHOD.md): a small op launched eagerly measures the host (Python,
Triton's launcher, the caching allocator), not the GPU. `time_op` reports both:

    graph_us   the op captured in a CUDA graph (several copies per graph, over rotated input sets),
               replayed back to back between two events; median over samples, per op. The GPU time.
    eager_us   the op called back to back from Python between two events, per call: what an
               un-captured caller pays, launch overhead included. eager_us / graph_us > 1: host-bound.

Input sets are rotated (one per fn) so that repeated runs do not read weights or K/V from L2 when a
single set would fit there; callers pick how many sets from `rotation_sets`.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rimuru.bench.cli import git_commit as source_commit

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """RIMURU_COMMIT when set, else HEAD (rimuru.bench.cli.git_commit: why the variable wins)."""
    return source_commit() or "unknown"


TIMING_NOTE = ("graph_us: median over samples of back-to-back CUDA-graph replays (per op); eager_us: median over "
               "samples of back-to-back eager calls (per call, host launch overhead included)")


def metadata(benchmark: str, **extra: Any) -> dict[str, Any]:
    """Device, date, commit, command and versions: the header of every result file."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {
        "benchmark": benchmark,
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({os.cpu_count()} cores)",
        "sms": props.multi_processor_count if props else None,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join(["python", *sys.argv]),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        # which of the host's GPUs ran it (two sweeps side by side on a 2-GPU machine, one GPU each)
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        **extra,
    }


def print_header(meta: dict[str, Any]) -> None:
    print(
        f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  commit {meta['git_commit'][:10]}  "
        f"{meta['date']}",
        flush=True,
    )


def rotation_sets(bytes_per_set: int, max_sets: int = 8) -> int:
    """Input sets to rotate so one pass over all of them is >= 4x L2 (capped: memory)."""
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
    return max(1, min(max_sets, math.ceil(4 * l2 / max(1, bytes_per_set))))


@dataclass(frozen=True)
class Timing:
    graph_us: float | None  # per op, CUDA-graph replays; None when capture failed (graph_error says why)
    eager_us: float  # per call, back-to-back eager launches
    ops_per_graph: int
    replays_per_sample: int
    graph_error: str | None = None

    @property
    def host_bound_ratio(self) -> float | None:
        return None if not self.graph_us else self.eager_us / self.graph_us


def _events_ms(body: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    body()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_op(
    fns: Sequence[Callable[[], Any]],
    samples: int = 15,
    sample_ms: float = 2.0,
    graph_min_us: float = 200.0,
    max_ops_per_graph: int = 64,
    capture: bool = True,
) -> tuple[Timing, list[Any]]:
    """Time one op over len(fns) rotated input sets (fns[i] runs the op on set i).

    Returns the timing and the outputs of fns[i] as produced by the LAST graph replay (None when the
    graph could not be captured), so callers can check the captured op against an eager call. An op known to
    sync with the host takes `capture=False` (eager time only): a capture that fails midway can leave torch's
    CUDA generator in capture state, and the next random tensor then fails.
    """
    n_sets = len(fns)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, autotune and warm the allocator outside any graph
        for _ in range(2):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    # Eager: calls issued back to back; the GPU runs them as fast as the host can launch them.
    est_ms = _events_ms(lambda: [fn() for fn in fns]) / n_sets
    calls = max(n_sets, min(20_000, math.ceil(sample_ms / max(est_ms, 1e-4))))

    def eager_body() -> None:
        for i in range(calls):
            fns[i % n_sets]()

    eager_us = statistics.median(_events_ms(eager_body) * 1e3 / calls for _ in range(samples))

    # Graph: enough copies per graph that one replay is >= graph_min_us of GPU time even when the eager
    # time (an upper bound on GPU time) is all host, so the graph launch itself is amortised.
    reps = max(1, min(max_ops_per_graph // n_sets, math.ceil(graph_min_us / max(eager_us, 1e-3) / n_sets)))
    ops = reps * n_sets
    outputs: list[Any] = [None] * n_sets
    if not capture:
        return Timing(None, eager_us, ops, 0, "not captured: the op syncs with the host"), outputs
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                outputs = [fn() for fn in fns]
    except Exception as err:  # noqa: BLE001 - report which op cannot be captured, keep benchmarking
        torch.cuda.synchronize()
        return Timing(None, eager_us, ops, 0, f"{type(err).__name__}: {err}"[:300]), [None] * n_sets
    for _ in range(3):
        graph.replay()
    replay_ms = _events_ms(graph.replay)
    replays = max(1, min(1000, math.ceil(sample_ms / max(replay_ms, 1e-4))))

    def graph_body() -> None:
        for _ in range(replays):
            graph.replay()

    graph_us = statistics.median(_events_ms(graph_body) * 1e3 / (replays * ops) for _ in range(samples))
    torch.cuda.synchronize()
    return Timing(graph_us, eager_us, ops, replays), outputs


def timing_fields(prefix: str, t: Timing) -> dict[str, Any]:
    """Row fields for one timed op: `{prefix}_us` is the graph time (None if not capturable)."""
    row = {
        f"{prefix}_us": None if t.graph_us is None else round(t.graph_us, 2),
        f"{prefix}_eager_us": round(t.eager_us, 2),
    }
    if t.graph_error:
        row[f"{prefix}_graph_error"] = t.graph_error
    return row


def write_json(path: Path | None, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


def write_markdown(
    path: Path | None, title: str, meta: dict[str, Any], cols: list[tuple[str, str]], rows: list[dict]
) -> None:
    """A results table: cols are (row key, column header)."""
    if path is None:
        return
    lines = [
        f"# {title}: {meta['device']}, {meta['date']}",
        "",
        f"commit `{meta['git_commit']}`, torch {meta['torch']}, triton {meta['triton']}; command: `{meta['command']}`",
        "",
        f"Timing: {meta['timing']}.",
        "",
        "| " + " | ".join(h for _, h in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(_md_cell(r.get(key)) for key, _ in cols) + " |" for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def _md_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


__all__ = [
    "Timing",
    "git_commit",
    "metadata",
    "print_header",
    "rotation_sets",
    "time_op",
    "timing_fields",
    "write_json",
    "write_markdown",
]


def table_cell(row: dict[str, Any], key: str, fmt: str, width: int) -> str:
    """`row[key]` formatted with `fmt` right-aligned in `width` columns, or '-' where it is None or missing."""
    v = row.get(key)
    return f"{'-':>{width}}" if v is None else f"{v:>{width}{fmt}}"
