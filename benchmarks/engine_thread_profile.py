"""Where the serving engine thread's time goes, from py-spy samples (benchmarks/runs/engine_thread_sample.sh).

py-spy's raw format has one collapsed stack a line (`thread (tid): name;outer frame;...;leaf frame count`), native
frames included when it sampled with --native. Of the engine thread's samples (thread "rimuru-engine") this
counts, per callee of `LLMEngine.step` (the frame right below it: the scheduler, the runtime's plan, the launch,
the drain, the runtime's after_pass, ...), the share of the step's samples and what the thread was doing there:

    gil      waiting to take the GIL back: a condition wait in libc right after a C call that released it (a torch
             op's gil_scoped_release ending, numpy's threads), or take_gil / PyEval_RestoreThread where the
             interpreter's symbols resolve
    lock     waiting on a Python lock (PyThread_acquire_lock_timed: a queue, an event), e.g. for work
    device   waiting for the GPU (a stream / event synchronisation, a blocking copy)
    host     running: Python or native work on the host

and the functions with the most samples (inclusive) inside the step. Samples outside `LLMEngine.step` are the
thread waiting for work or running commands between steps (`outside step`).

    python benchmarks/engine_thread_profile.py benchmarks/results/*-pyspy-*.txt.gz --output-json out.json
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import metadata, write_json  # noqa: E402

ENGINE_THREAD = "rimuru-engine"
STEP_FRAME = "LLMEngine.step"
GIL_FRAMES = ("take_gil", "PyEval_RestoreThread", "PyEval_AcquireThread", "PyGILState_Ensure")
DEVICE_FRAMES = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cuStreamSynchronize",
                 "cuEventSynchronize", "cuCtxSynchronize", "cudaMemcpy ", "cuMemcpyDtoH", "cuMemcpyHtoD")
CATEGORIES = ("host", "gil", "lock", "device")
LOCK_FRAMES = ("PyThread_acquire_lock_timed", "PyThread_acquire_lock")
COND_WAIT = "pthread_cond_timedwait"
_LINE = re.compile(r"^thread \((?P<tid>[^)]*)\): (?P<rest>.*) (?P<count>\d+)$")
_PY_FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:()]+\.py):\d+\)$")


@dataclass
class ThreadProfile:
    samples: int = 0
    in_step: int = 0
    by_callee: dict[str, Counter] = field(default_factory=dict)  # callee -> category -> samples
    inclusive: Counter = field(default_factory=Counter)  # python function -> samples within the step


def python_name(frame: str) -> str | None:
    """`Class.method` of a Python frame (`func (file.py:line)`), None for a native one."""
    m = _PY_FRAME.match(frame)
    return m.group("func") if m else None


def category(frames: list[str]) -> str:
    """What a sample was doing, from its frames (outermost first): the innermost GIL, lock or device wait decides.
    A condition wait is the GIL's unless a Python lock's acquire called it."""
    cond_wait = False
    for frame in reversed(frames):
        name = frame.split(" (", 1)[0]
        if name.startswith(LOCK_FRAMES):
            return "lock"
        if name.startswith(COND_WAIT):
            cond_wait = True
            continue
        if name.startswith(GIL_FRAMES):
            return "gil"
        if any(name.startswith(d.strip()) for d in DEVICE_FRAMES) or python_name(frame) in ("Event.synchronize",
                                                                                          "synchronize"):
            return "device"
    return "gil" if cond_wait else "host"


def parse(lines: list[str], thread_name: str = ENGINE_THREAD) -> ThreadProfile:
    prof = ThreadProfile()
    for line in lines:
        m = _LINE.match(line.strip())
        if not m:
            continue
        name, *frames = m.group("rest").split(";")
        if name != thread_name:
            continue
        n = int(m.group("count"))
        prof.samples += n
        py = [python_name(f) for f in frames]
        if STEP_FRAME not in py:
            prof.by_callee.setdefault("outside step", Counter())[category(frames)] += n
            continue
        prof.in_step += n
        at = len(py) - 1 - py[::-1].index(STEP_FRAME)  # the innermost step frame
        below = [p for p in py[at + 1 :] if p is not None]
        callee = below[0] if below else "LLMEngine.step (itself)"
        prof.by_callee.setdefault(callee, Counter())[category(frames[at + 1 :])] += n
        for func in set(below):
            prof.inclusive[func] += n
    return prof


def summary(prof: ThreadProfile, top: int) -> dict[str, Any]:
    total = max(prof.samples, 1)
    step = max(prof.in_step, 1)
    callees = sorted(prof.by_callee.items(), key=lambda kv: -sum(kv[1].values()))
    return {
        "samples": prof.samples,
        "in_step_share": round(prof.in_step / total, 4),
        "callees": [{"callee": name, "samples": sum(c.values()),
                     "share_of_step": None if name == "outside step" else round(sum(c.values()) / step, 4),
                     **{f"{k}_share": round(c[k] / max(sum(c.values()), 1), 3) for k in CATEGORIES}}
                    for name, c in callees],
        "top_functions": [{"function": f, "share_of_step": round(n / step, 4)}
                          for f, n in prof.inclusive.most_common(top)],
    }


def format_table(name: str, s: dict[str, Any]) -> str:
    lines = [f"{name}: {s['samples']} engine-thread samples, {100 * s['in_step_share']:.1f} % inside a step",
             f"  {'callee of LLMEngine.step':<44} {'step %':>7} {'host':>6} {'gil':>6} {'lock':>6} {'device':>7}"]
    for c in s["callees"]:
        share = "-" if c["share_of_step"] is None else f"{100 * c['share_of_step']:.1f}"
        lines.append(f"  {c['callee'][:44]:<44} {share:>7} {100 * c['host_share']:>5.0f}% {100 * c['gil_share']:>5.0f}%"
                     f" {100 * c['lock_share']:>5.0f}% {100 * c['device_share']:>6.0f}%")
    lines.append("  functions with most step samples (inclusive): "
                 + ", ".join(f"{t['function']} {100 * t['share_of_step']:.1f}%" for t in s["top_functions"][:12]))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path,
                   help="py-spy raw outputs (record --format raw --threads), gzipped where they end in .gz")
    p.add_argument("--thread", default=ENGINE_THREAD, help="the thread to summarise (default: %(default)s)")
    p.add_argument("--top", type=int, default=40, help="functions listed by inclusive samples")
    p.add_argument("--output-json", type=Path)
    a = p.parse_args()
    out: dict[str, Any] = {}
    for f in a.files:
        text = gzip.decompress(f.read_bytes()).decode() if f.suffix == ".gz" else f.read_text()
        prof = parse(text.splitlines(), a.thread)
        if prof.samples == 0:
            print(f"{f}: no samples of thread {a.thread!r} (is it a py-spy raw file recorded with --threads?)",
                  file=sys.stderr)
            continue
        out[f.name] = summary(prof, a.top)
        print(format_table(f.name, out[f.name]))
    # the header is this summary's (where it ran); the samples' card and commit are in their file names
    # (engine_thread_sample.sh names them), kept as `source`
    write_json(a.output_json, metadata("engine_thread_profile", thread=a.thread,
                                       note="samples taken on the card and at the commit their file names carry"),
               [{"source": name, **s} for name, s in out.items()])
    if not out:
        sys.exit(1)


if __name__ == "__main__":
    main()
