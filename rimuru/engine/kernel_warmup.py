"""Start-up passes that build the Triton kernel variants serving steps will launch, so that no step waits for one.

Every kernel of a pass is Triton (or cuBLAS), and Triton builds a kernel's variant at its first launch: a compile of
0.2-3 s on our machines, or a read of Triton's on-disk cache when an earlier process compiled it. A captured CUDA
graph builds its variants while it is captured; an eager step (`--enforce-eager`, a step above the largest graph,
a hybrid model's eager stretches) would build each new one in the middle of serving, and the requests of that step
wait (measured on the H200: a 15-token first prefill took 4.05 s with a cold cache, 64 ms with a warm one).

What decides a variant beside the model's constants, and so what the passes must cover:
- the kernels do not specialise on per-step integers or on index rows' alignment (kernels/*.py opt out; tested in
  tests/test_kernel_variants.py), so a variant is fixed by the constexprs its launcher derives from the step:
- paged attention: the q tile from the longest query (a power of two up to 128 rows of grouped heads), and for
  queries of at most 16 tokens the split count from the batch (`plan_launch`); the fused MoE's tile tier and the
  alignment kernel's width from the tokens x top-k assignments; the DeltaNet decode tile from the batch.
The attention and DeltaNet choices are step functions of a count whose steps are at least a factor of two apart,
so passes at the powers of two of that count (and at its limit) meet every value: decode passes of B one-token
sequences, B = 1, 2, 4, ..., max_num_seqs; single prompts of q = 2, 4, ..., max_num_batched_tokens tokens; and a
q-token chunk after B - 1 decodes for q = 2, 4, 8, 16 (short queries keep the split path; the decodes first, as
the scheduler orders a step, so a hybrid model's prefill rows start after decode rows as in serving). The MoE's
two choices change at points of their own (`fused_moe.variant_change_points`): a single prompt at each. What a
step still builds is counted (`kernels/kernel_builds.py`, `kernel_variants_built` in the engine's stats).

The passes run over the workspace profile's scratch pool (engine/workspace_profile.py) in the offload mode's kernel
variant, before the memory outside torch's allocator is read, so the loaded kernel images are in the workspace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from rimuru.kernels import kernel_builds
from rimuru.kernels.fused_moe import variant_change_points

logger = logging.getLogger("rimuru")

# queries of at most this many tokens take paged attention's split path (kernels/paged_attention.py plan_launch)
SPLIT_PATH_MAX_QUERY = 16


def _powers_of_two_to(limit: int, start: int = 1) -> list[int]:
    """start, 2 start, 4 start, ... below limit, then limit itself (empty when limit < start)."""
    out, value = [], start
    while value < limit:
        out.append(value)
        value *= 2
    return [*out, limit] if limit >= start else out


def warmup_passes(max_num_seqs: int, max_num_batched_tokens: int, num_experts: int, top_k: int) -> list[list[int]]:
    """The query lengths of each warm-up pass (one list per pass, one entry per sequence), in the order run."""
    S, T = max_num_seqs, max_num_batched_tokens
    batches = _powers_of_two_to(min(S, T))
    passes = [[1] * b for b in batches]  # decodes
    passes += [[q] for q in _powers_of_two_to(T, start=2)]  # single prompts
    passes += [[t] for t in variant_change_points(num_experts, top_k, T)]  # every MoE tier and alignment width
    for q in _powers_of_two_to(min(SPLIT_PATH_MAX_QUERY, T), start=2):  # short chunks beside decodes, decodes first
        passes += [[1] * (b - 1) + [q] for b in batches if b >= 2 and q + b - 1 <= T]  # as the scheduler orders them
    seen: set[tuple[int, ...]] = set()
    return [p for p in passes if not (tuple(p) in seen or seen.add(tuple(p)))]


@dataclass(frozen=True)
class WarmupReport:
    passes: int
    seconds: float
    variants_built: int  # Triton kernel variants the passes built (0 where Triton's hook is missing)

    def describe(self) -> str:
        return (f"{self.passes} passes in {self.seconds:.1f} s built {self.variants_built} Triton kernel variants "
                "(compiled, or read from Triton's cache)")


def warm_up_kernels(run_pass: Callable[[list[int]], None], max_num_seqs: int, max_num_batched_tokens: int,
                    num_experts: int, top_k: int) -> WarmupReport:
    """Runs `run_pass(query_lens)` for every warm-up pass (the caller's scratch batch of fresh prompts of those
    lengths, synchronised by the caller's last pass or not) and reports what they built."""
    kernel_builds.install()
    before = kernel_builds.count()
    start = time.perf_counter()
    passes = warmup_passes(max_num_seqs, max_num_batched_tokens, num_experts, top_k)
    for lens in passes:
        run_pass(lens)
    report = WarmupReport(len(passes), time.perf_counter() - start, kernel_builds.count() - before)
    logger.info("kernel warm-up: %s", report.describe())
    return report
