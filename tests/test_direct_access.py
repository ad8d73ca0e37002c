"""Direct access (offload_access="direct"): the MoE kernel reads offloaded experts from the host store.

Greedy tokens equal transformers' (fixed mode, every K) and static mode's (elastic mode through evictions and
grows); no load buffer is ever taken, the tables name offloaded experts by their host rows, the bytes read from
host memory are counted from the routing, and no page leaks. On the GPU the same with CUDA graphs: every pass
replays a whole graph (no piecewise graphs, no host wait) through the moves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_elastic import prompts, tight_pool

from rimuru import LLM, SamplingParams
from rimuru.experts.direct_runtime import DirectElasticRuntime, DirectRuntime
from rimuru.experts.residency import EXPERT
from rimuru.kernels.fused_moe import host_row_code
from rimuru.testing.reference import hf_greedy, random_prompts, run_greedy
from rimuru.testing.tiny_models import ARCHS

STEPS = 24


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request: pytest.FixtureRequest, parity_checkpoints: dict[str, Path]) -> Path:
    return parity_checkpoints[request.param]


def absent_rows_name_host_rows(llm: LLM) -> bool:
    """Every expert out of the residency is named in both tables by its host-row codes."""
    cache = llm.engine.runtime.cache
    codes = torch.tensor([[host_row_code(e, j) for j in range(3)] for e in range(cache.num_experts)],
                         dtype=torch.int32)
    for layer in range(cache.num_layers):
        for e in range(cache.num_experts):
            if not cache.residency.is_resident(layer, e):
                if not (torch.equal(cache.host_tables[layer, e], codes[e])
                        and torch.equal(cache.tables[layer, e].cpu(), codes[e])):
                    return False
    return True


def test_fixed_mode_reads_offloaded_experts_in_host_memory(ckpt: Path) -> None:
    lens = (5, 17, 33)
    ref = hf_greedy(ckpt, random_prompts(lens), STEPS)
    for resident in (4, 1):
        llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", offload_mode="fixed", resident_experts=resident)
        engine = llm.engine
        assert isinstance(engine.runtime, DirectRuntime) and engine.budget_split["load_buffers"] == 0
        L = engine.spec.num_moe_layers
        assert engine.pool.allocator.num_used(EXPERT) == 3 * L * resident  # no load buffer
        assert absent_rows_name_host_rows(llm)
        assert run_greedy(llm, random_prompts(lens), STEPS) == ref, f"K={resident}"
        assert llm.stats()["kv_pages_used"] == 0
        assert "expert_bytes_loaded" not in llm.stats()  # the kernel's host reads are not counted: no false 0


def test_elastic_mode_moves_experts_and_reads_the_offloaded_ones_in_host_memory(ckpt: Path) -> None:
    limit = 5
    pool = tight_pool(ckpt, kv_blocks=10, limit=limit, load_buffers=False)
    llm = LLM(str(ckpt), page_pool_memory_bytes=pool, device="cpu", offload_mode="elastic", adjuster="paper",
              expert_offload_limit=limit, max_num_batched_tokens=64)
    engine = llm.engine
    runtime = engine.runtime
    assert isinstance(runtime, DirectElasticRuntime) and runtime.loader.buffer_pages == []
    # each pass's bytes read from host memory, against routed & absent as the tables stood when the pass ran
    reads: list[tuple[int, int]] = []
    kinds: dict[bool, list[int]] = {True: [], False: []}  # decode pass? -> experts read per pass with experts out
    absent_of_pass = runtime._absent_during_pass
    read_of_pass = runtime._read_from_host
    dense: list[torch.Tensor] = []

    def absent_now() -> object:
        dense.append(runtime.cache.host_tables[:, :, 0] < 0)
        return absent_of_pass()

    def read(counts, absent, decode):  # type: ignore[no-untyped-def]
        mask = dense.pop(0)
        got = read_of_pass(counts, absent, decode)
        reads.append((got, int(((torch.from_numpy(counts) > 0) & mask).sum()) * runtime.store.expert_bytes))
        if absent is not None and counts.any():
            kinds[decode].append(got // runtime.store.expert_bytes)
        return got

    runtime._absent_during_pass = absent_now  # type: ignore[method-assign]
    runtime._read_from_host = read  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    batches = [prompts(6, seed=1), prompts(2, seed=2)]
    profiler = engine.enable_step_profiler(100_000)  # every step
    got = [[o.outputs[0].token_ids for o in llm.generate(b, params)] for b in batches]
    st = llm.stats()
    assert st["expert_evictions"] > 0 and st["expert_grows"] > 0, st
    assert st["expert_bytes_direct"] > 0 and st["prefetch_hits"] + st["prefetch_misses"] == 0, st
    assert reads and all(a == b for a, b in reads) and sum(a for a, _ in reads) == st["expert_bytes_direct"]
    expert_bytes = runtime.store.expert_bytes
    assert st["expert_bytes_direct"] % expert_bytes == 0
    assert st["expert_bytes_loaded"] == st["expert_bytes_direct"] + st["expert_grows"] * expert_bytes
    # the reads and the passes with experts out, by kind of pass: decode (one token a sequence) or with prefill
    assert kinds[True] and kinds[False], kinds
    for decode, kind in ((True, "decode"), (False, "mixed")):
        assert st[f"expert_host_reads_{kind}"] == sum(kinds[decode])
        assert st[f"offloaded_passes_{kind}"] == len(kinds[decode])
    assert (st["expert_host_reads_decode"] + st["expert_host_reads_mixed"]) * expert_bytes == st["expert_bytes_direct"]
    # the step profiler sees the same reads, step by step, and the steps that had experts out
    assert sum(r.host_reads for r in profiler.records) == st["expert_host_reads_decode"] + st["expert_host_reads_mixed"]
    assert any(r.offloaded > 0 for r in profiler.records) and all(r.host_reads == 0 for r in profiler.records
                                                                   if r.kind == "idle")
    assert absent_rows_name_host_rows(llm)
    alloc = engine.pool.allocator
    assert st["kv_pages_used"] == 0 and alloc.num_used(EXPERT) == 3 * runtime.cache.num_resident  # no page leaked
    static = LLM(str(ckpt), gpu_memory_budget="1GiB", device="cpu", max_num_batched_tokens=64)
    assert [[o.outputs[0].token_ids for o in static.generate(b, params)] for b in batches] == got


def test_decode_passes_feed_the_read_excess_with_the_models_expected_reads(ckpt: Path) -> None:
    # the cost adjuster's runtime: each decode pass with experts out reports the offloaded experts its routing read
    # beside the reads the model's formula expected of them (recomputed here expert by expert, from the estimate
    # as it stood before the pass's counts joined it)
    limit = 5
    pool = tight_pool(ckpt, kv_blocks=10, limit=limit, load_buffers=False)
    llm = LLM(str(ckpt), page_pool_memory_bytes=pool, device="cpu", offload_mode="elastic", adjuster="cost",
              expert_offload_limit=limit, max_num_batched_tokens=64)
    runtime = llm.engine.runtime
    assert isinstance(runtime, DirectElasticRuntime)
    costs = runtime.core.step_cost
    assert costs is not None
    observed: list[tuple[float, int]] = []
    wanted: list[tuple[float, int]] = []
    observe_reads, read_of_pass = costs.observe_reads, runtime._read_from_host
    costs.observe_reads = lambda e, m: observed.append((e, m)) or observe_reads(e, m)  # type: ignore[method-assign]

    def read(counts, absent, decode):  # type: ignore[no-untyped-def]
        if decode and absent is not None:
            E = counts.shape[1]
            probs = runtime.core.popularity.probabilities()
            ids = [(int(i) // E, int(i) % E) for i in absent]
            wanted.append((sum(1.0 - (1.0 - float(probs[layer, e])) ** float(counts[layer].sum()) for layer, e in ids),
                           sum(int(counts[layer, e] > 0) for layer, e in ids)))
        return read_of_pass(counts, absent, decode)

    runtime._read_from_host = read  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    llm.generate(prompts(8, seed=1), params)
    st = llm.stats()
    assert st["expert_evictions"] > 0 and observed, st
    assert len(observed) == len(wanted)
    assert all(m == wm and e == pytest.approx(we, rel=1e-9) for (e, m), (we, wm) in zip(observed, wanted, strict=True))
    assert st["cost_read_excess"] >= 1.0 and st["kv_pages_used"] == 0


def test_absent_mask_follows_every_table_write(ckpt: Path) -> None:
    # the mask the runtimes read each pass is (host_tables < 0) as the tables are now, rebuilt only after a write
    limit = 5
    pool = tight_pool(ckpt, kv_blocks=10, limit=limit, load_buffers=False)
    llm = LLM(str(ckpt), page_pool_memory_bytes=pool, device="cpu", offload_mode="elastic", adjuster="paper",
              expert_offload_limit=limit)
    cache = llm.engine.runtime.cache
    residency = cache.residency

    def check() -> object:
        mask = cache.absent_mask()
        assert torch.equal(torch.from_numpy(mask.copy()), cache.host_tables[:, :, 0] < 0)
        assert cache.absent_mask() is mask and not mask.flags.writeable
        return mask

    before = check()
    layer, expert = next(iter(e for e, _ in residency.resident_items()))
    residency.begin_eviction(layer, expert)
    cache.clear_rows(residency.finish_evictions())
    after = check()
    assert after is not before and after[layer, expert] and not before[layer, expert]
    pages = residency.reserve_grow(layer, expert)
    assert pages is not None
    cache.write_rows(residency.commit_grows())
    back = check()
    assert back is not after and not back[layer, expert]
    cache.clear_rows([])
    assert cache.absent_mask() is back  # nothing written, nothing rebuilt
    llm.engine.pool.allocator.complete_forward()


def test_bad_offload_access_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="offload_access must be one of direct, copy"):
        LLM("unused", device="cpu", offload_access="zero-copy")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_elastic_direct_replays_whole_graphs_through_moves(ckpt: Path) -> None:
    """Evictions and grows change the tables in place between passes; every pass replays a whole CUDA graph that
    reads the offloaded experts from pinned host memory. Greedy tokens equal static mode run eagerly, float32."""
    limit = 5
    pool = tight_pool(ckpt, kv_blocks=10, limit=limit, load_buffers=False, device="cuda", dtype="float32",
                          offload_access="direct")
    llm = LLM(str(ckpt), page_pool_memory_bytes=pool, device="cuda", dtype="float32", offload_mode="elastic",
              adjuster="paper", expert_offload_limit=limit, max_num_batched_tokens=64)
    engine, runner = llm.engine, llm.engine.runner
    assert runner.graphs is not None and runner.graphs.boundaries is None  # whole graphs only
    assert engine.runtime.store.pinned
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    batches = [prompts(6, seed=1), prompts(2, seed=2), prompts(1, seed=3)]
    got = [[o.outputs[0].token_ids for o in llm.generate(b, params)] for b in batches]
    st = llm.stats()
    assert st["expert_evictions"] > 0 and st["expert_grows"] > 0 and st["expert_bytes_direct"] > 0, st
    assert runner.graph_steps == engine.forward_steps  # every step replayed a graph
    assert st["kv_pages_used"] == 0 and engine.pool.allocator.pending_deferred == 0
    static = LLM(str(ckpt), gpu_memory_budget="1GiB", device="cuda", dtype="float32", enforce_eager=True,
                 max_num_batched_tokens=64)
    assert [[o.outputs[0].token_ids for o in static.generate(b, params)] for b in batches] == got


def test_async_steps_read_every_pass_counts_once_and_time_the_passes(ckpt: Path) -> None:
    # async steps read a pass's routing counts once their copy is done, a step or two later: every pass's counts
    # reach the popularity estimate exactly once (all assignments of the run, none twice), the decode passes are
    # timed for the cost tracker, and the outputs are the synchronous loop's
    limit = 5
    pool = tight_pool(ckpt, kv_blocks=10, limit=limit, load_buffers=False)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    runs = {}
    for async_steps in (False, True):
        llm = LLM(str(ckpt), page_pool_memory_bytes=pool, device="cpu", offload_mode="elastic", adjuster="cost",
                  expert_offload_limit=limit, max_num_batched_tokens=64, async_scheduling=async_steps)
        runtime = llm.engine.runtime
        assert isinstance(runtime, DirectElasticRuntime) and runtime.async_steps is async_steps
        seen: list[float] = []
        observe = runtime.core.observe_routing

        def counted(routed, observe=observe, seen=seen):  # type: ignore[no-untyped-def]
            seen.append(float(routed.sum()))
            observe(routed)

        runtime.core.observe_routing = counted  # type: ignore[method-assign]
        launched: list[int] = []  # tokens of every pass queued (async: a finished request's last one runs too)
        before = runtime.before_pass

        def queued(num_tokens, before=before, launched=launched):  # type: ignore[no-untyped-def]
            launched.append(num_tokens)
            before(num_tokens)

        runtime.before_pass = queued  # type: ignore[method-assign]
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts(6, seed=1), params)]
        llm.engine.step()  # empty steps: the last passes' counts are read at the calls after them
        llm.engine.step()
        passes = llm.stats()["forward_steps"]
        assert passes == sum(n > 0 for n in launched)
        assert sum(seen) == sum(launched) * llm.engine.spec.num_experts_per_tok * runtime.cache.num_layers
        costs = runtime.core.step_cost
        assert costs is not None and passes - 3 <= costs.steps <= passes
        assert llm.stats()["expert_evictions"] > 0
        runs[async_steps] = tokens
    assert runs[True] == runs[False]
