"""What this machine's host can do for the CPU expert tier, measured once at start-up and printed.

    bandwidth      bytes/s of a STREAM-like read (a sum over a buffer far larger than the caches): decode on the
                   host is bound by it, since an expert's weights are read once per step for a few tokens
    expert times   seconds one expert of the model's shapes and dtype takes on the host at 1, 2, 4, 8, 16 tokens,
                   computed alone on every thread (host_compute.py, the engine's thread count, over a scratch store
                   of random experts, up to 64 and 512 MiB, so that the weights come from memory where they are
                   larger than the caches; the real store may still be empty at start-up), dispatch and combine
                   included
    spread         how much faster than one after another the host computes m experts in one call (host_compute.py
                   spreads them over the threads), at m = 1, 2, 4, 8, 16 and one token each: S(m) = m x time(1) /
                   time(m), 1 at m = 1
    matrix ISA     torch's CPU capability and the bf16 matrix extensions (AVX-512 BF16, AMX): without them a
                   bf16 GEMV is upcast and slower
    NUMA nodes     host memory controllers; the store is not yet placed per node

The tier's cost model (host_tier.py, step_cost.py) reads the expert times; nothing here is a constant of some
other machine. A measurement takes about 0.2 s for the tiny test models (each token count is timed for at
least 30 ms) and under a second for Qwen3-30B-A3B shapes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from rimuru.experts.host_compute import HostAssignments, HostExpertCompute
from rimuru.experts.host_store import HostExpertStore

MEASURED_TOKENS = (1, 2, 4, 8, 16)
MEASURED_SPREAD = (1, 2, 4, 8, 16)  # experts in one call
BANDWIDTH_PROBE_BYTES = 256 * 2**20  # far beyond any L3: a read from memory
SCRATCH_EXPERT_BYTES = 512 * 2**20  # the most the expert-time probe allocates


@dataclass(frozen=True)
class HostExpertTimes:
    """One expert's host time by routed tokens: measured points, linear between them and past the last two."""

    tokens: tuple[int, ...]  # ascending
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.seconds) or not self.tokens:
            raise ValueError(f"need as many times as token counts (at least one), got {self.tokens}, {self.seconds}")
        if list(self.tokens) != sorted(set(self.tokens)) or self.tokens[0] < 1:
            raise ValueError(f"token counts must be ascending and >= 1, got {self.tokens}")
        if min(self.seconds) < 0:
            raise ValueError(f"times must be >= 0, got {self.seconds}")

    def __call__(self, tokens: float) -> float:
        ts, ss = self.tokens, self.seconds
        if tokens <= ts[0] or len(ts) == 1:
            return ss[0] if tokens <= ts[0] else ss[0] * tokens / ts[0]
        for i in range(1, len(ts)):
            if tokens <= ts[i] or i == len(ts) - 1:
                slope = max(0.0, (ss[i] - ss[i - 1]) / (ts[i] - ts[i - 1]))
                return ss[i - 1] + slope * (tokens - ts[i - 1])
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class HostSpread:
    """S(m): m experts in one host call take m / S(m) times one expert's time. Linear between the measured counts,
    the last value past them; 1 below the first (one expert is alone)."""

    experts: tuple[int, ...]  # ascending, from 1
    speedup: tuple[float, ...]
    call_seconds: tuple[float, ...] = ()  # the measured call of each count, where measured

    def __post_init__(self) -> None:
        if len(self.experts) != len(self.speedup) or not self.experts or self.experts[0] != 1:
            raise ValueError(f"need a speedup for each expert count, the first count 1, got {self.experts}, "
                             f"{self.speedup}")
        if list(self.experts) != sorted(set(self.experts)) or min(self.speedup) <= 0:
            raise ValueError(f"expert counts must be ascending and speedups > 0, got {self.experts}, {self.speedup}")

    def __call__(self, experts: float) -> float:
        if experts <= 1:
            return 1.0
        return float(np.interp(experts, self.experts, self.speedup))

    @property
    def helps(self) -> bool:
        """Whether some measured count of several experts ran faster spread than one after another."""
        return any(s > 1.0 for m, s in zip(self.experts, self.speedup, strict=True) if m > 1)

    @property
    def used(self) -> HostSpread:
        """The spread the host compute runs with: this one where it helps, else experts one after another."""
        return self if self.helps else NO_SPREAD


NO_SPREAD = HostSpread((1,), (1.0,))  # experts one after another


@dataclass(frozen=True)
class HostProfile:
    bandwidth: float  # bytes/s
    expert_times: HostExpertTimes
    expert_bytes: int
    threads: int
    matrix_isa: str
    numa_nodes: int
    spread: HostSpread = NO_SPREAD

    def describe(self) -> str:
        times = ", ".join(f"{t} tok {1e3 * s:.3f} ms" for t, s in zip(self.expert_times.tokens,
                                                                      self.expert_times.seconds, strict=True))
        one = self.expert_times.seconds[0]
        spread = ", ".join(f"{m}: {s:.2f}x" for m, s in zip(self.spread.experts, self.spread.speedup, strict=True))
        if not self.spread.helps:
            spread += " (slower: experts run one after another)"
        return (f"host: {self.bandwidth / 1e9:.1f} GB/s read, {self.threads} threads, {self.matrix_isa}, "
                f"{self.numa_nodes} NUMA node(s); one expert ({self.expert_bytes / 1e6:.2f} MB): {times} "
                f"({self.expert_bytes / max(one, 1e-12) / 1e9:.1f} GB/s at 1 token); experts in one call, "
                f"speedup over one after another: {spread}")


def measure_host_bandwidth(nbytes: int = BANDWIDTH_PROBE_BYTES, reps: int = 3) -> float:
    """Bytes/s of a read of `nbytes` (capped at an eighth of the available memory), best of `reps`."""
    nbytes = max(2**20, min(nbytes, available_host_bytes() // 8))
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()  # warm-up: the pages are touched, the threads are up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / max(best, 1e-9)


def _best_time(call, reps: int, min_time_s: float) -> float:
    """The best of at least `reps` calls and of as many as `min_time_s` holds. A stall of the host (a shared
    machine's CPU quota stops a process for tens of ms after a burst) lasts longer than a few sub-millisecond
    calls, so a fixed few repetitions can all fall in one; calls spread over `min_time_s` cannot."""
    call()  # warm-up
    best, done, start = float("inf"), 0, time.perf_counter()
    while done < reps or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
        done += 1
    return best


def _work(m: int, n: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[Tensor, HostAssignments]:
    """Hidden rows [n, d] and every one of the n tokens routed to each of experts 0..m-1."""
    hidden = (0.1 * torch.randn(n, d, generator=gen)).to(dtype)  # [n, d]
    rows = torch.arange(n).repeat(m)  # [m*n]
    ids = torch.arange(m).repeat_interleave(n)
    return hidden, HostAssignments(rows=rows, experts=ids, weights=torch.full((m * n,), 1.0 / m))


def measure_expert_times(compute: HostExpertCompute, tokens: tuple[int, ...] = MEASURED_TOKENS,
                         experts: int | None = None, reps: int = 5, layer: int = 0,
                         min_time_s: float = 0.03) -> HostExpertTimes:
    """Per expert, seconds of one host compute call of one expert of `layer` with n tokens (the dispatch and the
    combine included), for every n in `tokens`: a pass calls each of `experts` experts (default: all the store
    holds) in turn, so that their weights come from memory; the best pass over its experts."""
    store = compute.store
    m = store.num_experts if experts is None else min(experts, store.num_experts)
    gen = torch.Generator().manual_seed(0)
    seconds = []
    for n in tokens:
        hidden, one = _work(1, n, store.d, store.dtype, gen)
        works = [HostAssignments(rows=one.rows, experts=torch.full_like(one.experts, e), weights=one.weights)
                 for e in range(m)]

        def one_pass(works=works, hidden=hidden) -> None:
            for work in works:
                compute.compute(layer, hidden, work)

        seconds.append(_best_time(one_pass, reps, min_time_s) / m)
    return HostExpertTimes(tokens=tuple(tokens), seconds=tuple(seconds))


def measure_spread(compute: HostExpertCompute, counts: tuple[int, ...] = MEASURED_SPREAD, reps: int = 5,
                   layer: int = 0, min_time_s: float = 0.03) -> HostSpread:
    """S(m) of HostSpread for each m in `counts` that the store holds (m experts of `layer` in one call, one token
    each, against m one-expert calls). A pass calls disjoint sets of m experts in turn, as many as the store holds,
    so that the weights come from memory, not from a cache that one set would fit in."""
    store = compute.store
    gen = torch.Generator().manual_seed(0)
    ms = [m for m in counts if m <= store.num_experts]
    if not ms or ms[0] != 1:
        raise ValueError(f"the spread is measured from one expert up, got counts {counts} for a store of "
                         f"{store.num_experts} experts")
    times = []
    for m in ms:
        hidden, one = _work(m, 1, store.d, store.dtype, gen)
        sets = [HostAssignments(rows=one.rows, experts=one.experts + i * m, weights=one.weights)
                for i in range(store.num_experts // m)]

        def one_pass(sets=sets, hidden=hidden) -> None:
            for work in sets:
                compute.compute(layer, hidden, work)

        times.append(_best_time(one_pass, reps, min_time_s) / len(sets))
    return HostSpread(experts=tuple(ms), speedup=tuple(m * times[0] / t for m, t in zip(ms, times, strict=True)),
                      call_seconds=tuple(times))


def cpu_matrix_isa() -> str:
    """torch's CPU capability and the bf16 matrix extensions the CPU reports (Linux /proc/cpuinfo)."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    extras = [name for flag, name in (("avx512_bf16", "AVX-512 BF16"), ("amx_bf16", "AMX-BF16")) if flag in flags]
    return f"{torch.backends.cpu.get_cpu_capability()}" + (f" + {' + '.join(extras)}" if extras else
                                                          " (no bf16 matrix extensions: bf16 is upcast)")


def numa_nodes() -> int:
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return max(1, len(nodes))


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo, else the physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def scratch_compute(intermediate_size: int, hidden_size: int, dtype: torch.dtype,
                    experts: int = 64) -> HostExpertCompute:
    """A host compute over one layer of random experts of the model's shapes (at most SCRATCH_EXPERT_BYTES)."""
    expert_bytes = 3 * intermediate_size * hidden_size * torch.empty((), dtype=dtype).element_size()
    n = max(1, min(experts, SCRATCH_EXPERT_BYTES // expert_bytes))
    store = HostExpertStore(1, n, intermediate_size, hidden_size, dtype, pin=False, progress=False)
    store.fill_random(seed=0)
    return HostExpertCompute(store)


def profile_host(intermediate_size: int, hidden_size: int, dtype: torch.dtype) -> HostProfile:
    """Every measurement above for experts of these shapes, with the intra-op threads as they are set now."""
    compute = scratch_compute(intermediate_size, hidden_size, dtype)
    times = measure_expert_times(compute)  # before the bandwidth probe's burst of all threads
    spread = measure_spread(compute)
    return HostProfile(bandwidth=measure_host_bandwidth(), expert_times=times, expert_bytes=compute.store.expert_bytes,
                       threads=compute.threads, matrix_isa=cpu_matrix_isa(), numa_nodes=numa_nodes(), spread=spread)
