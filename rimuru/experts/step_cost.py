"""What a forward pass costs, as the cost-aware adjuster reads it every step: the compute time of the batch, and
how much slower than the nominal link the expert copies turn out in the engine.

Compute. A pass that copied nothing (`copy_s == 0`) is a clean measure of the batch's compute time. Those samples
feed an EMA per batch size (buckets of batched tokens, powers of two), and `compute_s` is the estimate for the
bucket asked for (the cost adjuster asks for a decode step of the running batch: tokens = running requests; else
the latest pass's), or the nearest measured bucket below (above when none is below): a smaller batch's time
underestimates, which makes copies look less hideable, the safe direction. (The latest pass's bucket alone would
make the estimate jump to a prefill-heavy step's time after each one, ~19 against ~8 ms in the simulator.)
Decode-only passes (`decode=True`: one token per sequence) also feed a table of their own, and the estimate asked
for by batch size reads it once it holds a sample: a bucket's mixed passes (a prefill chunk beside the decodes,
preemptions' recomputation) cost more at the same token count: on the H200 (Qwen1.5-MoE shapes) they held the
estimate for ~75 running requests at 16 ms while the served decode steps averaged 10.8 ms, which made every expert
read look two thirds as costly as it is. That table keeps the median of each bucket's last `decode_window` passes,
not an EMA: a pass is timed by the host's clock, and a burst of slow ones (a server thread busy with arrivals, a
garbage collection) moved an EMA of 33-64 running requests to 15.4 and 35.6 ms on the H200 while decode steps took
~9.5 ms, and the adjuster evicted for copies it then read as a third of their cost. The decode estimate for a batch
is also never more than a larger measured batch's (a decode step does not get cheaper with more sequences).
Copies are likewise learned against the clean estimate of the pass's own kind (decode passes against decode ones).
A request's TPOT, though, is the mean of every step it is in, prefill chunks included: `mixed_step_surcharge` is
what the mean clean pass costs beyond the mean decode-only one (EMAs over all batch sizes), which a TPOT bound adds
to the modelled decode step.
Passes with copies do not feed the compute estimate once any clean pass was seen. Subtracting from them the copy
time the model says is exposed, `forward - max(0, copy - overlap c)`, would bring every cost the model misses
(copies hiding less than `overlap`, on-demand misses, the host's per-layer routing reads) back into the estimate,
multiplied by up to 1 / (1 - overlap) = 5, until the copies look hidden; from then on the whole pass would count
as compute, which keeps them looking hidden, and the adjuster offloads its whole limit
(benchmarks/sim_step_cost_regression.py reproduces that runaway in the simulator; tests/test_step_cost.py pins it).
Forced offloading (the experts never all fit, e.g. Qwen3-30B-A3B at 48 GiB) has no clean pass. There the sample is
`forward - copy_s`, the compute time if the copies hid behind nothing, one EMA over all passes.

Copies. Against the clean estimate c of the same bucket (a neighbouring bucket's compute differs by more than
what is measured: no sample then), a pass with copies shows what they really cost: exposed X = forward - c. The
adjuster's model is X = max(0, slowdown x copy - overlap x c), with copy = bytes / nominal bandwidth; both
parameters are learned here (EMAs), from passes whose copies are at least `min_copy_share` of c:
  * X <= noise_share x c (passes of one bucket vary by a few per cent): the copies hid, so the overlap is at
    least copy / c (raised to it when below), and the slowdown 1;
  * X >= copy: nothing hid and the copies took longer than nominal: overlap 0, slowdown X / copy;
  * in between: part hid: overlap (copy - X) / c, slowdown 1.
The overlap stays within [0, the configured `copy_overlap`] and the slowdown within [1, max_slowdown]: never more
hiding than configured, never faster than the link. The slowdown starts at 1; the overlap at `initial_overlap`
(default: `copy_overlap`; the engine and the simulator start it at CostAdjusterConfig.initial_copy_overlap = 0,
see there). Without clean passes both keep their starting values.

Excess. The adjuster's model counts the offloaded experts the batch routes to; the engine copies more: prefetches
of experts the predictor guessed and the routing then did not pick. `observe_loads` keeps EMAs of both counts
(routed offloaded experts, and experts copied for passes), and `copy_excess` = (copied + 1) / (routed + 1) >= 1
scales the modelled copies. With a working predictor it stays near 1 (~1.2 on the H200); a predictor blind to a
skewed router's bias copies the cold experts every step (67 copied against 4 routed per decode step on the H200),
and without this factor the model would offload experts to save copies it believes are few.

Reads. Under direct access nothing is copied for a pass, so the excess above stays 1, but the model's expected
reads of the offloaded experts, 1 - (1 - p)^(tokens x top_k) with p from the popularity estimate, can still miss:
on the H200 (Qwen1.5-MoE shapes, 32 GiB, 60 req/s) an expert let go at 0.28 expected reads a decode step was read
at every step 3 s later, while the estimate followed over seconds (0.18 -> 0.74). `observe_reads` takes, per decode
pass with experts out, the reads the estimate expected of them and the reads the routing counts show, and
`read_excess` = (measured + 1) / (expected + 1) over the last `read_window` such passes, kept in [1, max_excess]: a
measured miss makes every offloaded expert costlier in the model until the estimate catches up, never cheaper
than the estimate says (reads below it mostly mean a batch whose tokens route alike, which the next batch need not).

Host tier. Where the host computes some routed offloaded experts instead of copying them (host_tier.py), the
start-up measurement (host_profile.py) and the PCIe probe are handed here (`use_host_tier`), and `observe_loads`
also counts the experts the host computed and the host seconds they took. Passes are timed without their host
seconds (`observe_forward(host_s=...)`: counted as exposed, so the compute estimate reads low, the safe side), and
`offload_cost_factor` gives what a routed offloaded expert costs in expert copies: the copied share at
`copy_excess`, the host share at its measured host time over one expert's copy time. The cost adjuster multiplies
its modelled copies by it (runtime_builders.build_adjuster); without host computations it is `copy_excess` times
`read_excess` (the host tier acts on the copy path, the reads are counted under direct access: one of the two is 1).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rimuru.experts.host_profile import HostProfile


class StepCostTracker:
    def __init__(self, alpha: float = 0.1, copy_overlap: float = 0.8, min_copy_share: float = 0.25,
                 max_slowdown: float = 10.0, noise_share: float = 0.05, max_excess: float = 100.0,
                 initial_overlap: float | None = None, decode_window: int = 32, read_window: int = 64) -> None:
        if not 0.0 < alpha <= 1.0 or not 0.0 <= copy_overlap <= 1.0:
            raise ValueError(f"need 0 < alpha <= 1 and 0 <= copy_overlap <= 1, got {alpha}, {copy_overlap}")
        if initial_overlap is None:
            initial_overlap = copy_overlap
        if not 0.0 <= initial_overlap <= copy_overlap:
            raise ValueError(f"need 0 <= initial_overlap <= copy_overlap, got {initial_overlap}, {copy_overlap}")
        if decode_window < 1 or read_window < 1:
            raise ValueError(f"decode_window and read_window must be >= 1, got {decode_window}, {read_window}")
        if min_copy_share <= 0 or max_slowdown < 1 or noise_share < 0 or max_excess < 1:
            raise ValueError(f"need min_copy_share > 0, max_slowdown >= 1, noise_share >= 0 and max_excess >= 1, "
                             f"got {min_copy_share}, {max_slowdown}, {noise_share}, {max_excess}")
        self.alpha = alpha
        self.copy_overlap = copy_overlap
        self.min_copy_share = min_copy_share
        self.max_slowdown = max_slowdown
        self.noise_share = noise_share  # exposed time within this share of compute counts as hidden
        self.decode_window = decode_window
        self._clean: dict[int, float] = {}  # token bucket -> EMA of copy-free pass times
        # token bucket -> the last decode_window decode-only copy-free pass times (their median is the estimate)
        self._decode_times: dict[int, deque[float]] = {}
        self._clean_decode: dict[int, float] = {}  # token bucket -> the median of its decode_window
        self._mean_clean: float | None = None  # EMA of every copy-free pass's time, whatever its batch
        self._mean_clean_decode: float | None = None  # the same over decode-only passes
        # EMA of forward - copy over every pass while no clean pass was seen (one for all batch sizes: per bucket,
        # decode passes whose copies take nearly all the pass give ~0, and the simulated Qwen3-30B at 48 GiB then
        # leaves requests waiting, TTFT p99 14.6 s against 0.85 s at 2 req/s)
        self._forced: float | None = None
        # EMA: share of compute the copies hide behind (<= copy_overlap), `initial_overlap` until measured
        self.overlap = initial_overlap
        self.slowdown = 1.0  # EMA: real copy time / nominal copy time (>= 1)
        self.compute_s: float | None = None  # the estimate for the latest pass's batch; None before any pass
        self.steps = 0
        self.max_excess = max_excess
        self._routed: float | None = None  # EMA: routed offloaded experts per observation
        self._copied: float | None = None  # EMA: experts copied for passes (prefetched or on demand)
        self.host_profile: HostProfile | None = None  # what start-up measured of the host (use_host_tier)
        self.expert_copy_s: float | None = None  # one expert's copy time at the measured PCIe bandwidth
        self._host: float | None = None  # EMA: routed offloaded experts the host computed, per observation
        self._host_s: float | None = None  # EMA: host seconds they took, per observation
        # the last read_window decode passes with experts out: (reads the estimate expected, reads measured)
        self._reads: deque[tuple[float, int]] = deque(maxlen=read_window)

    @staticmethod
    def bucket(tokens: int) -> int:
        """Batched tokens -> bucket: 0 for 0-1 tokens, k for 2^(k-1) < tokens <= 2^k."""
        return 0 if tokens <= 1 else math.ceil(math.log2(tokens))

    def _ema(self, old: float | None, sample: float) -> float:
        return sample if old is None else self.alpha * sample + (1.0 - self.alpha) * old

    @staticmethod
    def _nearest(table: dict[int, float], bucket: int) -> float | None:
        """The bucket's estimate, else the nearest measured bucket below, else the smallest one above."""
        if not table:
            return None
        if bucket in table:
            return table[bucket]
        below = [b for b in table if b < bucket]
        return table[max(below)] if below else table[min(table)]

    def _clean_estimate(self, bucket: int) -> float | None:
        return self._nearest(self._clean, bucket)

    def observe_compute(self, compute_s: float, tokens: int = 0, decode: bool = False) -> None:
        """A pass whose compute time is known (a copy-free pass, or the simulator's cost model); `decode`: it
        carried one token per sequence."""
        if compute_s < 0:
            raise ValueError(f"compute time must be >= 0, got {compute_s}")
        b = self.bucket(tokens)
        self._clean[b] = self._ema(self._clean.get(b), compute_s)
        self._mean_clean = self._ema(self._mean_clean, compute_s)
        if decode:
            window = self._decode_times.setdefault(b, deque(maxlen=self.decode_window))
            window.append(compute_s)
            self._clean_decode[b] = statistics.median(window)
            self._mean_clean_decode = self._ema(self._mean_clean_decode, compute_s)
        self.compute_s = self._clean_estimate(b)
        self.steps += 1

    def use_host_tier(self, profile: HostProfile, expert_copy_s: float) -> None:
        """The host tier computes experts too: its measured costs and one expert's measured copy time."""
        if expert_copy_s <= 0:
            raise ValueError(f"an expert's copy time must be positive, got {expert_copy_s}")
        self.host_profile = profile
        self.expert_copy_s = expert_copy_s

    def observe_forward(self, forward_s: float, copy_s: float = 0.0, tokens: int = 0, host_s: float = 0.0,
                        decode: bool = False) -> None:
        """A pass of `tokens` batched tokens (`decode`: one per sequence) took `forward_s` (piecewise overhead
        already taken out) while `copy_s` of expert copies (bytes / nominal bandwidth) were issued for it and the
        host tier spent `host_s` computing experts (taken out of the pass: what the host tier costs reaches the
        model through offload_cost_factor)."""
        if forward_s < 0 or copy_s < 0 or host_s < 0:
            raise ValueError(f"need forward_s >= 0, copy_s >= 0 and host_s >= 0, got {forward_s}, {copy_s}, {host_s}")
        forward_s = max(0.0, forward_s - host_s)
        if copy_s == 0:
            self.observe_compute(forward_s, tokens, decode)
            return
        b = self.bucket(tokens)
        self.steps += 1
        if not self._clean:  # forced offloading: no clean pass to compare with
            self._forced = self._ema(self._forced, max(0.0, forward_s - copy_s))
            self.compute_s = self._forced
            return
        self.compute_s = self._clean_estimate(b)
        ref = (self._clean_decode if decode else self._clean).get(b)
        # the copies' cost is learned only against a clean pass of the same batch size (a neighbour's compute
        # differs by more than what is measured), and only from copies large enough to tell from noise
        if ref is None or ref <= 0 or copy_s < self.min_copy_share * ref:
            return
        exposed = forward_s - ref
        if exposed <= self.noise_share * ref:  # the copies hid (passes of one bucket vary by a few per cent)
            overlap, slowdown = max(self.overlap, copy_s / ref), 1.0
        elif exposed >= copy_s:
            overlap, slowdown = 0.0, exposed / copy_s
        else:
            overlap, slowdown = (copy_s - exposed) / ref, 1.0
        self.overlap = self._ema(self.overlap, min(self.copy_overlap, overlap))
        self.slowdown = self._ema(self.slowdown, min(self.max_slowdown, max(1.0, slowdown)))

    def observe_loads(self, routed: int, copied: int, host: int = 0, host_s: float = 0.0) -> None:
        """Since the last observation: `routed` offloaded experts that passes routed to and took from the load
        buffers (loader hits + misses), `copied` experts copied for passes (prefetched + on demand; grows
        excluded), `host` routed offloaded experts the host tier computed instead, in `host_s` host seconds."""
        if routed < 0 or copied < 0 or host < 0 or host_s < 0:
            raise ValueError(f"need routed >= 0, copied >= 0, host >= 0 and host_s >= 0, got {routed}, {copied}, "
                             f"{host}, {host_s}")
        if routed == 0 and copied == 0 and host == 0:
            return
        self._routed = self._ema(self._routed, float(routed))
        self._copied = self._ema(self._copied, float(copied))
        if host > 0 or self._host is not None:
            self._host = self._ema(self._host, float(host))
            self._host_s = self._ema(self._host_s, host_s)

    def copy_excess(self) -> float:
        """Experts copied per routed offloaded expert, (copied + 1) / (routed + 1) over the EMAs (>= 1,
        <= max_excess; 1 before any copy): the one-expert prior keeps a pass that copied a few experts and routed
        none from setting the excess to the cap, where it would stay while nothing is offloaded."""
        if self._copied is None or self._routed is None:
            return 1.0
        return min(self.max_excess, max(1.0, (self._copied + 1.0) / (self._routed + 1.0)))

    def observe_reads(self, expected: float, measured: int) -> None:
        """A decode pass that read offloaded experts in host memory: `expected` reads of them by the model's formula
        and the popularity estimate the adjuster held, `measured` offloaded experts its routing counts name."""
        if expected < 0 or measured < 0:
            raise ValueError(f"need expected >= 0 and measured >= 0, got {expected}, {measured}")
        self._reads.append((expected, measured))

    def read_excess(self) -> float:
        """Offloaded experts read per read the estimate expected, (measured + 1) / (expected + 1) summed over the
        window (>= 1, <= max_excess; 1 before any pass): one read of prior keeps a few passes from setting it."""
        if not self._reads:
            return 1.0
        expected = sum(e for e, _ in self._reads)
        measured = sum(m for _, m in self._reads)
        return min(self.max_excess, max(1.0, (measured + 1.0) / (expected + 1.0)))

    def host_share(self) -> float:
        """Share of the routed offloaded experts the host tier computed (EMAs; 0 without it)."""
        if not self._host or self._routed is None:
            return 0.0
        return self._host / (self._host + self._routed)

    def offload_cost_factor(self) -> float:
        """Expert copies' worth of time per routed offloaded expert: the copied share at copy_excess, the host share
        at (host seconds per host-computed expert) / expert_copy_s. copy_excess x read_excess without host
        computations."""
        share = self.host_share()
        if share == 0.0 or self.expert_copy_s is None or self._host_s is None or not self._host:
            return self.copy_excess() * self.read_excess()
        host_per_expert = self._host_s / self._host
        return (1.0 - share) * self.copy_excess() + share * host_per_expert / self.expert_copy_s

    def mixed_step_surcharge(self) -> float:
        """Seconds the mean copy-free pass takes beyond the mean decode-only one (0 until both were seen): what the
        steps carrying prefill chunks add, on average, to a decoding request's time per token."""
        if self._mean_clean is None or self._mean_clean_decode is None:
            return 0.0
        return max(0.0, self._mean_clean - self._mean_clean_decode)

    def copy_slowdown(self) -> float:
        return self.slowdown

    def copy_overlap_share(self) -> float:
        return self.overlap

    def __call__(self, tokens: int | None = None) -> float | None:
        """The compute estimate for a decode pass of `tokens` sequences (the cost adjuster asks for a decode step
        of the running batch): from decode-only passes once one was seen, else from every clean pass; without
        `tokens`, the latest pass's batch."""
        if tokens is None or not self._clean:
            return self.compute_s
        b = self.bucket(tokens)
        if not self._clean_decode:
            return self._nearest(self._clean, b)
        larger = [v for k, v in self._clean_decode.items() if k > b]
        estimate = self._nearest(self._clean_decode, b)
        assert estimate is not None
        return min(estimate, *larger) if larger else estimate
