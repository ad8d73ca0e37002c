"""Where the time of an engine step goes: host phases, GPU forward time, expert waits, kernel counts.

`LLMEngine.enable_step_profiler(n)` profiles the next n steps. Each step is cut into contiguous host
phases, so that the phases sum to the step's wall time (the same two clock readings as
`StepMetrics.step_time_s`):

    schedule   inbox, aborts, elastic grows entering the tables, the scheduler
    prepare    batch arrays on the host + the host->device copy of the inputs
    forward    launching the model (a graph replay, or every kernel eagerly; on the CPU: the compute)
    sample     launching the sampler
    adjust     after the launch, the expert runtime's plan (evictions begin, grow copies are queued) and its pass
               bookkeeping (evictions leave the tables, routing counts read); with async steps while the GPU runs
    compact    after the adjust, KV pages moved out of the mid pages that grows wait for (engine/kv_compaction.py)
    readback   the one device->host read of the sampled tokens: on a GPU, waiting for the GPU
    process    appending tokens, detokenising, stop checks, outputs (also the previous pass's, when it is
               drained before the launch)
    finish     deferred pages return, per-step metrics

The engine calls a `StepTrace` at these points every step, whether or not it profiles: `NULL_TRACE` does
nothing; a `StepProfiler` records its first `num_steps` steps and then does nothing too.

Besides the host phases, per step:
  * gpu_forward: GPU time of the forward pass (+ logits) between two CUDA events recorded around it;
    the events are read only in `report()`, so profiling adds no synchronisation to the loop;
  * expert_wait: host time inside the offloading expert provider's `table()` (fixed / elastic modes; the
    runtime's `expert_wait_s`): the one routing read per MoE layer waits there for the GPU, on-demand expert
    copies included, and the loads are issued there. None when experts are static (nothing can block on them);
  * kernels: for the first `trace_steps` steps of each kind, torch.profiler counts the GPU kernels,
    memory copies and host launch calls (CUDA only; on the CPU "unavailable"); traced steps are left out
    of the time means, as the tracer slows the host;
  * offloaded: routed experts not resident when the step's tables were set (after the scheduler, whose phase
    lets grows in), and context tokens: every scheduled sequence's length after the step, what the attention
    reads, stalled requests (running ones that sit the step out for evictions' pages) and, under direct access,
    the offloaded experts read in host memory (by the pass the step took the routing counts of). `decode_by_batch`
    in the report sets decode steps with experts out beside all-resident ones at the same batch, with their
    context tokens: the KV room evictions free lets contexts grow, which costs a pass as well as its reads
    from host memory.

Between passes (CUDA only): `gpu_gap`, the GPU time from the previous step's forward end to this step's forward
begin (the sampler, copies and fills queued between the passes, and any idle wait), and `starved`, whether the GPU
had finished everything the previous step queued when this step launched its forward (a query, no sync): the GPU
idled waiting for the host. With async steps (the GPU's default) a starved step's host chain is every phase of the
previous step after its launch (adjust, compact, readback, process, finish) and its own schedule and prepare
(`gpu_gaps` in the report: starved and fed decode steps side by side).

Step kinds: decode-graph (a decode CUDA-graph replay), decode-eager (one token for every request, eager),
mixed-graph / prefill-graph (a mixed-step CUDA-graph replay), prefill (no decode row, eager), mixed (prefill
chunks and decodes, eager), idle (nothing scheduled).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rimuru.engine.scheduler import SchedulerOutput

PHASES = ("schedule", "prepare", "forward", "sample", "adjust", "compact", "readback", "process", "finish")
KINDS = ("decode-graph", "decode-eager", "mixed-graph", "prefill-graph", "prefill", "mixed", "idle")
KERNELS_UNAVAILABLE = "unavailable (CPU: torch.profiler counts CUDA kernels only)"


@dataclass
class StepRecord:
    kind: str = "idle"
    num_tokens: int = 0
    num_seqs: int = 0
    wall_s: float = 0.0
    host_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    expert_wait_s: float | None = None
    traced: bool = False  # torch.profiler ran during this step: not in the time means
    kernels: dict[str, int | str] | None = None  # counts, or {"error": why the tracer failed}
    gpu_events: tuple[Any, Any] | None = None  # (start, end) torch.cuda.Event, read in report()
    gpu_forward_s: float | None = None
    offloaded: int = 0
    context_tokens: int = 0  # tokens the batch's attention reads: every scheduled sequence's length after the step
    stalled: int = 0  # running requests that sit the step out, waiting for evictions' pages
    # offloaded experts read in host memory by the passes whose routing counts the step took in (direct access;
    # with async steps that is the pass launched the step before)
    host_reads: int = 0
    # GPU time from the previous step's forward end to this step's forward begin (its sampler, the fills and
    # copies queued between the passes, and any idle wait for the host); None where the previous step had no pass
    gpu_gap_s: float | None = None
    # at this step's forward launch the GPU had finished everything the previous step queued: it idled, waiting
    # for the host (None: no previous step with a pass to ask, or not on a GPU)
    starved: bool | None = None
    done_event: Any = None  # recorded at the step's end, after everything the step queued (read by the next step)
    after_trace: bool = False  # the previous step was traced: its synchronisation starves this one


class StepTrace(Protocol):
    """What the engine and the runner report during a step (the phases of the module docstring)."""

    def begin(self, t0: float) -> None: ...

    def scheduled(self, sched: SchedulerOutput) -> None: ...

    def mark(self, phase: str) -> None: ...

    def forward_begin(self) -> None: ...

    def forward_end(self) -> None: ...

    def end(self, t_end: float) -> None: ...


class NullTrace:
    def begin(self, t0: float) -> None:
        return None

    def scheduled(self, sched: SchedulerOutput) -> None:
        return None

    def mark(self, phase: str) -> None:
        return None

    def forward_begin(self) -> None:
        return None

    def forward_end(self) -> None:
        return None

    def end(self, t_end: float) -> None:
        return None


NULL_TRACE = NullTrace()


class StepProfiler:
    def __init__(self, num_steps: int, device: torch.device, step_kind: Callable[[SchedulerOutput], str],
                 trace_steps: int = 1, expert_wait_s: Callable[[], float | None] = lambda: None,
                 offloaded: Callable[[], int] = lambda: 0, host_reads: Callable[[], int] = lambda: 0) -> None:
        """`step_kind`: the kind of a scheduled step (ModelRunner.step_kind); `expert_wait_s`: the runtime's
        cumulative host seconds inside offloading table decisions (None: experts are static); `offloaded`: routed
        experts not resident now; `host_reads`: offloaded experts passes read in host memory so far."""
        if num_steps < 1:
            raise ValueError(f"the step profiler needs at least one step, got {num_steps}")
        self.num_steps = num_steps
        self.device = device
        self.cuda = device.type == "cuda"
        self.step_kind = step_kind
        self.trace_steps = trace_steps if self.cuda else 0
        self.records: list[StepRecord] = []
        self._cur: StepRecord | None = None
        self._last = 0.0
        self._tracer: Any = None
        self._traced_kinds: dict[str, int] = {}
        self.expert_wait_s = expert_wait_s
        self.offloaded = offloaded
        self.host_reads = host_reads
        self._reads0 = 0  # host_reads() at the step's begin
        self._prev: StepRecord | None = None  # the step recorded last, when it is the one just before this step
        self._wait0: float | None = None  # expert_wait_s() at the step's begin

    # ---- recording (called by the engine and the runner) ---------------------------------------
    @property
    def active(self) -> bool:
        return len(self.records) < self.num_steps

    def begin(self, t0: float) -> None:
        if not self.active:
            return
        self._wait0 = self.expert_wait_s()
        self._reads0 = self.host_reads()
        self._cur = StepRecord(expert_wait_s=None if self._wait0 is None else 0.0)
        self._last = t0

    def scheduled(self, sched: SchedulerOutput) -> None:
        """The scheduler is done: its time is `schedule`, and the step's kind is known."""
        if self._cur is None:
            return
        self.mark("schedule")
        self.set_kind(self.step_kind(sched), sched.num_tokens, len(sched.scheduled))
        self._cur.offloaded = self.offloaded()
        self._cur.context_tokens = sum(s.start + s.num_new_tokens for s in sched.scheduled)
        self._cur.stalled = len(sched.stalled)

    def mark(self, phase: str) -> None:
        """The host time since the previous mark belongs to `phase`."""
        cur = self._cur
        if cur is None:  # not profiling this step (done, or not begun)
            return
        now = time.monotonic()
        cur.host_s[phase] += now - self._last
        self._last = now

    def set_kind(self, kind: str, num_tokens: int, num_seqs: int) -> None:
        cur = self._cur
        if cur is None:
            return
        cur.kind, cur.num_tokens, cur.num_seqs = kind, num_tokens, num_seqs
        if self.trace_steps and self._traced_kinds.get(kind, 0) < self.trace_steps:
            self._traced_kinds[kind] = self._traced_kinds.get(kind, 0) + 1
            self._start_trace()

    def forward_begin(self) -> None:
        if self.cuda and self._cur is not None:
            prev = self._prev
            if prev is not None and prev.done_event is not None:
                self._cur.starved = bool(prev.done_event.query())
                self._cur.after_trace = prev.traced
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._cur.gpu_events = (start, None)

    def forward_end(self) -> None:
        cur = self._cur
        if self.cuda and cur is not None and cur.gpu_events is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            cur.gpu_events = (cur.gpu_events[0], end)

    def end(self, t_end: float) -> None:
        """Closes the step at `t_end` (the rest since the last mark is `finish`)."""
        cur = self._cur
        if cur is None:
            return
        cur.host_s["finish"] += t_end - self._last
        if self._tracer is not None:
            cur.traced = True
            cur.kernels = self._stop_trace()
        wait = self.expert_wait_s()
        if wait is not None and self._wait0 is not None:
            cur.expert_wait_s = wait - self._wait0
        cur.host_reads = self.host_reads() - self._reads0
        cur.wall_s = sum(cur.host_s.values())
        if self.cuda and cur.gpu_events is not None:
            cur.done_event = torch.cuda.Event()
            cur.done_event.record()
        self.records.append(cur)
        self._prev = cur if cur.gpu_events is not None else None
        self._cur = None

    # ---- kernel counts --------------------------------------------------------------------------
    def _start_trace(self) -> None:
        try:
            from torch.profiler import ProfilerActivity, profile

            self._tracer = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._tracer.__enter__()
        except Exception as e:  # a profiler that cannot start must not stop the engine
            self._tracer = None
            if self._cur is not None:
                self._cur.kernels = {"error": repr(e)}

    def _stop_trace(self) -> dict[str, int | str] | None:
        tracer, self._tracer = self._tracer, None
        try:
            torch.cuda.synchronize(self.device)
            tracer.__exit__(None, None, None)
            return count_kernels(tracer.events())
        except Exception as e:
            return {"error": repr(e)}

    # ---- results --------------------------------------------------------------------------------
    def _read_gpu_times(self) -> None:
        prev_end = None  # the forward end event of the record before, while it is the step just before
        for r in self.records:
            events, r.gpu_events, r.done_event = r.gpu_events, None, None
            if events is None or events[1] is None:
                prev_end = None
                continue
            start, end = events
            end.synchronize()
            r.gpu_forward_s = start.elapsed_time(end) / 1e3
            if prev_end is not None and r.starved is not None:
                r.gpu_gap_s = prev_end.elapsed_time(start) / 1e3
            prev_end = end

    def report(self) -> dict[str, Any]:
        """JSON-ready: per step kind the means of the host phases, wall, GPU forward, expert waits, kernels;
        and every step as a row."""
        self._read_gpu_times()
        kinds: dict[str, Any] = {}
        for kind in KINDS:
            rows = [r for r in self.records if r.kind == kind]
            if rows:
                kinds[kind] = _summary(rows, self.cuda)
        timed = [r for r in self.records if not r.traced]
        return {
            "steps_profiled": len(self.records),
            "device": str(self.device),
            "phases": list(PHASES),
            "note": ("host phases are contiguous and sum to wall_ms (means over untraced steps); gpu_forward_ms: "
                     "CUDA events around the forward pass + logits; expert_wait_ms: host time inside offloading "
                     "providers' table() (routing read + on-demand copies); kernels: torch.profiler on the first "
                     "traced step(s) of each kind"),
            "all": _summary(self.records, self.cuda) if self.records else {},
            "kinds": kinds,
            "decode_by_batch": decode_by_batch(self.records, self.cuda),
            "gpu_gaps": gpu_gaps(self.records),
            "host_ms_total": round(sum(r.wall_s for r in timed) * 1e3, 3),
            "steps": [_row(r) for r in self.records],
        }

    def table(self) -> str:
        return format_table(self.report())


def count_kernels(events: Iterable[Any]) -> dict[str, int]:
    """GPU kernels, GPU memory copies/sets, host kernel launches and graph launches in a torch.profiler trace."""
    out = {"gpu_kernels": 0, "gpu_memcpy": 0, "host_kernel_launches": 0, "graph_launches": 0, "host_memcpy_calls": 0}
    for e in events:
        name = e.name
        on_gpu = str(getattr(e, "device_type", "")).endswith("CUDA")
        if on_gpu:
            if name.startswith(("Memcpy", "Memset")):
                out["gpu_memcpy"] += 1
            else:
                out["gpu_kernels"] += 1
        elif "LaunchKernel" in name:
            out["host_kernel_launches"] += 1
        elif name.startswith(("cudaGraphLaunch", "cuGraphLaunch")):
            out["graph_launches"] += 1
        elif name.startswith(("cudaMemcpy", "cuMemcpy")):
            out["host_memcpy_calls"] += 1
    return out


def _ms(xs: list[float]) -> float:
    return round(statistics.fmean(xs) * 1e3, 4) if xs else 0.0


def _summary(rows: list[StepRecord], cuda: bool) -> dict[str, Any]:
    timed = [r for r in rows if not r.traced] or rows
    gpu = [r.gpu_forward_s for r in timed if r.gpu_forward_s is not None]
    waits = [r.expert_wait_s for r in timed if r.expert_wait_s is not None]
    traced = [r.kernels for r in rows if r.kernels is not None]
    wall = _ms([r.wall_s for r in timed])
    gaps = _gapped(timed)
    out: dict[str, Any] = {
        "steps": len(rows),
        "timed_steps": len(timed),
        "tokens_mean": round(statistics.fmean(r.num_tokens for r in timed), 2),
        "seqs_mean": round(statistics.fmean(r.num_seqs for r in timed), 2),
        "wall_ms": wall,
        "wall_ms_p50": round(statistics.median(r.wall_s for r in timed) * 1e3, 4),
        "host_ms": {p: _ms([r.host_s[p] for r in timed]) for p in PHASES},
        "gpu_forward_ms": _ms(gpu) if gpu else None,
        "gpu_busy_share": round(_ms(gpu) / wall, 3) if gpu and wall > 0 else None,
        "gpu_gap_ms": _ms([r.gpu_gap_s for r in gaps]) if gaps else None,
        "starved_share": round(sum(bool(r.starved) for r in gaps) / len(gaps), 3) if gaps else None,
        "expert_wait_ms": _ms(waits) if waits else None,
        "kernels": traced[0] if traced else (None if cuda else KERNELS_UNAVAILABLE),
    }
    return out


# decode steps are grouped by this many sequences (and by whether any expert was out) in `decode_by_batch`
BATCH_BIN = 8


def decode_by_batch(records: list[StepRecord], cuda: bool) -> list[dict[str, Any]]:
    """Decode steps (graph or eager) grouped by batch (BATCH_BIN sequences a bin) and by whether any expert was
    offloaded: per group its steps, mean batch and offloaded count, wall and GPU forward time. Side by side at one
    bin, the two groups show what offloading costs a decode pass (beside their mean context tokens)."""
    groups: dict[tuple[int, bool], list[StepRecord]] = {}
    for r in records:
        if r.kind in ("decode-graph", "decode-eager") and not r.traced:
            groups.setdefault((r.num_seqs // BATCH_BIN * BATCH_BIN, r.offloaded > 0), []).append(r)
    out = []
    for (low, offloaded), rows in sorted(groups.items()):
        s = _summary(rows, cuda)
        out.append({"seqs_from": low, "seqs_to": low + BATCH_BIN - 1, "offloaded": offloaded, "steps": s["steps"],
                    "seqs_mean": s["seqs_mean"],
                    "offloaded_mean": round(statistics.fmean(r.offloaded for r in rows), 1),
                    "context_tokens_mean": round(statistics.fmean(r.context_tokens for r in rows)),
                    "stalled_mean": round(statistics.fmean(r.stalled for r in rows), 2),
                    "host_reads_mean": round(statistics.fmean(r.host_reads for r in rows), 2),
                    "wall_ms": s["wall_ms"], "gpu_forward_ms": s["gpu_forward_ms"], "gpu_gap_ms": s["gpu_gap_ms"],
                    "starved_share": s["starved_share"]})
    return out


def _gap_measured(r: StepRecord) -> bool:
    """The gap to the previous pass was measured, and not right after a traced step (which synchronised)."""
    return r.gpu_gap_s is not None and not r.after_trace


def _gapped(rows: list[StepRecord]) -> list[StepRecord]:
    return [r for r in rows if _gap_measured(r)]


# a starved step waited for this host work (async steps): the previous step's phases after its launch, then its own
# up to the forward launch
CHAIN_BEFORE = ("adjust", "compact", "readback", "process", "finish")
CHAIN_OWN = ("schedule", "prepare")


def gpu_gaps(records: list[StepRecord]) -> dict[str, Any]:
    """Decode steps (graph or eager) whose GPU gap was measured, by starved (the GPU idled for the host before the
    forward launch) or fed and by whether an expert was offloaded ("starved-offloaded", "fed-resident", ...): steps,
    mean gap, GPU forward and the host chain the launch waited for (CHAIN_BEFORE of the previous step, CHAIN_OWN of
    this one, mean ms)."""
    groups: dict[str, list[tuple[StepRecord, StepRecord]]] = {}
    for prev, r in zip(records, records[1:], strict=False):
        if r.kind in ("decode-graph", "decode-eager") and not r.traced and _gap_measured(r):
            name = f"{'starved' if r.starved else 'fed'}-{'offloaded' if r.offloaded > 0 else 'resident'}"
            groups.setdefault(name, []).append((prev, r))
    out: dict[str, Any] = {}
    for name, rows in sorted(groups.items()):
        chain = {f"prev_{p}": _ms([prev.host_s[p] for prev, _ in rows]) for p in CHAIN_BEFORE}
        chain |= {p: _ms([r.host_s[p] for _, r in rows]) for p in CHAIN_OWN}
        out[name] = {"steps": len(rows), "seqs_mean": round(statistics.fmean(r.num_seqs for _, r in rows), 2),
                     "gpu_gap_ms": _ms([r.gpu_gap_s for _, r in rows if r.gpu_gap_s is not None]),
                     "gpu_forward_ms": _ms([r.gpu_forward_s for _, r in rows if r.gpu_forward_s is not None]),
                     "chain_ms": chain, "chain_total_ms": round(sum(chain.values()), 4)}
    return out


def _row(r: StepRecord) -> dict[str, Any]:
    return {"kind": r.kind, "tokens": r.num_tokens, "seqs": r.num_seqs, "wall_ms": round(r.wall_s * 1e3, 4),
            **{p: round(r.host_s[p] * 1e3, 4) for p in PHASES},
            "gpu_forward_ms": None if r.gpu_forward_s is None else round(r.gpu_forward_s * 1e3, 4),
            "expert_wait_ms": None if r.expert_wait_s is None else round(r.expert_wait_s * 1e3, 4),
            "offloaded": r.offloaded, "context_tokens": r.context_tokens, "stalled": r.stalled,
            "host_reads": r.host_reads, "traced": r.traced,
            "gpu_gap_ms": None if r.gpu_gap_s is None else round(r.gpu_gap_s * 1e3, 4), "starved": r.starved}


def format_table(report: dict[str, Any]) -> str:
    """One line per step kind: steps, tokens, host phases (ms), wall, GPU forward, expert wait, kernels."""
    heads = ["kind", "steps", "tok", *PHASES, "wall", "gpu fwd", "exp wait", "kernels"]
    lines = [" ".join(f"{h:>12}" if i else f"{h:<12}" for i, h in enumerate(heads))]
    for kind, s in [*report["kinds"].items(), ("all", report["all"])]:
        if not s:
            continue
        k = s["kernels"]
        kern = (f"{k.get('gpu_kernels')}k/{k.get('host_kernel_launches')}l" if isinstance(k, dict) and "error" not in k
                else "n/a")
        cells = [kind, s["steps"], s["tokens_mean"], *(s["host_ms"][p] for p in PHASES), s["wall_ms"],
                 "-" if s["gpu_forward_ms"] is None else s["gpu_forward_ms"],
                 "-" if s["expert_wait_ms"] is None else s["expert_wait_ms"], kern]
        lines.append(" ".join(f"{c:>12}" if i else f"{c:<12}" for i, c in enumerate(cells)))
    lines.append("host phases, wall, gpu fwd and expert wait: mean ms per step over untraced steps; "
                 "kernels: GPU kernels (k) / host launches (l) in one traced step")
    return "\n".join(lines)
