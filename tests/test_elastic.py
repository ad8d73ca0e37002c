"""Elastic mode: experts leave under load and come back when it drains, and nothing changes the tokens.

The budget holds every expert but only a few KV blocks, so a batch of requests forces evictions (the
scheduler stalls a request instead of preempting it when evicting can free its pages), and a second,
small batch afterwards finds free pages and grows experts back. Greedy tokens must equal static mode
and transformers, and every page must be accounted for afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.experts.cache import ExpertCache
from rimuru.experts.residency import EXPERT, ExpertResidency
from rimuru.memory.allocator import PageAllocator
from rimuru.memory.geometry import PageGeometry
from rimuru.model_spec import load_model_spec
from rimuru.testing.reference import hf_greedy
from rimuru.testing.tiny_models import ARCHS

STEPS = 24


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request: pytest.FixtureRequest, parity_checkpoints: dict[str, Path]) -> Path:
    return parity_checkpoints[request.param]


def prompts(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 300, (int(k),), generator=g).tolist()}
            for k in torch.randint(8, 40, (n,), generator=g)]


def tight_pool(path: Path, kv_blocks: int, limit: int, load_buffers: bool = True, **engine_args: str | bool) -> int:
    """A page pool (bytes, for `page_pool_memory_bytes`) that holds every expert, the load buffers (unless not
    `load_buffers`), `kv_blocks` KV blocks and one huge page of slack. Page sizes come from a CPU engine of the same
    dtype (`engine_args`' dtype): the geometry does not depend on the device, and giving the pool's size instead of a
    budget keeps the test independent of the workspace the engine measures on a GPU."""
    dtype = engine_args.get("dtype", "auto")
    probe = LLM(str(path), gpu_memory_budget="1GiB", max_num_batched_tokens=64, enforce_eager=True, device="cpu",
                dtype=dtype)
    geo = probe.engine.geometry
    per_block = probe.engine.kv.num_layers * geo.size("kv")
    experts = 3 * probe.engine.runtime.cache.total_experts * geo.size("expert")
    buffers = 2 * 3 * limit * geo.size("expert") if load_buffers else 0
    probe.shutdown()
    return experts + buffers + kv_blocks * per_block + geo.huge_size


def test_elastic_evicts_and_grows_with_identical_tokens(ckpt: Path) -> None:
    limit = 5
    pool = tight_pool(ckpt, kv_blocks=10, limit=limit)
    llm = LLM(str(ckpt), page_pool_memory_bytes=pool, device="cpu", offload_mode="elastic", offload_access="copy",
              adjuster="paper",
              expert_offload_limit=limit, max_num_batched_tokens=64)
    engine = llm.engine
    experts = engine.runtime.cache
    start_resident = experts.num_resident
    assert start_resident >= experts.total_experts - experts.num_layers * limit
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    heavy, light = prompts(6, seed=1), prompts(2, seed=2)
    got_heavy = [o.outputs[0].token_ids for o in llm.generate(heavy, params)]
    st = llm.stats()
    assert st["expert_evictions"] > 0, st
    assert st["preemptions"] == 0  # stalls for evicted experts' pages instead of recomputing
    assert st["expert_bytes_loaded"] > 0  # evicted experts that were routed to came from host memory
    after_heavy = experts.num_resident
    assert after_heavy < start_resident
    # the O(1) check the graph replay uses agrees with the tables
    assert experts.all_resident() is False and not bool((experts.host_tables[:, :, 0] >= 0).all())
    got_light = [o.outputs[0].token_ids for o in llm.generate(light, params)]
    st = llm.stats()
    # the light batch leaves pages free: experts come back
    assert st["expert_grows"] > 0 and experts.num_resident > after_heavy
    # the resident set of each layer is a prefix of its ranking, at most `limit` experts offloaded
    for layer, ranking in enumerate(engine.runtime.core.popularity.rankings):
        resident = {e for e in range(experts.num_experts) if experts.residency.is_resident(layer, e)}
        assert resident == set(ranking[: len(resident)].tolist())
        assert experts.num_experts - len(resident) <= limit
    # no page lost: KV empty, expert pages = 3 per resident expert + the two load buffers
    assert st["kv_pages_used"] == 0 and st["running"] == 0
    alloc = engine.pool.allocator
    alloc.check_invariants()
    assert alloc.num_used(EXPERT) == 3 * experts.num_resident + 2 * 3 * limit
    assert alloc.pending_deferred == 0

    ref_heavy = hf_greedy(ckpt, [p["prompt_token_ids"] for p in heavy], STEPS)
    ref_light = hf_greedy(ckpt, [p["prompt_token_ids"] for p in light], STEPS)
    assert got_heavy == ref_heavy and got_light == ref_light
    static = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu")
    assert [o.outputs[0].token_ids for o in static.generate(heavy, params)] == got_heavy


def test_cost_adjuster_preempts_rather_than_offload_beyond_its_model(ckpt: Path) -> None:
    # The same heavy batch under the cost adjuster with a TPOT SLO no step meets: its model allows no
    # offloaded expert, so a running request short of pages is preempted (as in static mode) instead of
    # sitting out for evictions that would cost copies every step. Tokens still equal static mode.
    limit = 5
    pool = tight_pool(ckpt, kv_blocks=10, limit=limit)
    llm = LLM(str(ckpt), page_pool_memory_bytes=pool, device="cpu", offload_mode="elastic", offload_access="copy",
              expert_offload_limit=limit,
              max_num_batched_tokens=64, adjuster="cost", slo_tpot_p99_ms=1e-6)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    heavy = prompts(6, seed=1)
    got = [o.outputs[0].token_ids for o in llm.generate(heavy, params)]
    st = llm.stats()
    assert st["preemptions"] > 0 and st["expert_evictions"] == 0, st
    assert llm.engine.runtime.core.adjuster.max_offloaded() == 0
    assert st["kv_pages_used"] == 0
    llm.engine.pool.allocator.check_invariants()
    static = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu")
    assert [o.outputs[0].token_ids for o in static.generate(heavy, params)] == got


def _tiny_cache() -> tuple[ExpertCache, PageAllocator]:
    spec = load_model_spec("olmoe-1b-7b")
    geo = PageGeometry.custom(mid_sizes={EXPERT: 64}, small_sizes={"kv": 16})
    alloc = PageAllocator(geo, num_huge_pages=3 * 4 + 3)  # room for 4 experts + 1 more
    view = torch.zeros(15, 16)
    residency = ExpertResidency(alloc, spec.num_moe_layers, spec.num_experts)
    return ExpertCache(residency, view, torch.device("cpu")), alloc


def test_evicted_pages_are_not_reused_inside_the_same_forward_pass() -> None:
    cache, alloc = _tiny_cache()
    r = cache.residency
    cache.make_resident([(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)])
    assert alloc.mid_capacity(EXPERT) == 0
    pages = r.pages_of(0, 3)
    r.begin_eviction(0, 3)
    # during the forward pass: still in the table, and its pages cannot be handed out
    assert cache.tables[0, 3].tolist() == list(pages) and r.is_resident(0, 3) and r.in_tables[0, 3]
    assert 3 not in r.planned_resident()[0]
    assert alloc.allocate_mid(EXPERT, 1, owner=7) is None and alloc.allocate_small("kv", 1, owner=7) is None
    with pytest.raises(ValueError, match="already being evicted"):
        r.begin_eviction(0, 3)
    cache.clear_rows(r.finish_evictions())  # the forward pass ended
    assert cache.tables[0, 3].tolist() == [-1, -1, -1] and not r.is_resident(0, 3) and not r.in_tables[0, 3]
    assert alloc.allocate_mid(EXPERT, 1, owner=7) is None  # still deferred until complete_forward()
    alloc.complete_forward()
    assert sorted(alloc.allocate_mid(EXPERT, 3, owner=7)) == sorted(pages)
    r.check()


def test_grown_expert_enters_the_table_only_when_committed() -> None:
    cache, alloc = _tiny_cache()
    r = cache.residency
    cache.make_resident([(0, 0), (0, 1)])
    pages = r.reserve_grow(0, 5)
    assert pages is not None and alloc.num_used(EXPERT) == 9 and r.num_pages == 9
    # reserved, copy in flight: no kernel can address it
    assert cache.tables[0, 5].tolist() == [-1, -1, -1] and cache.host_tables[0, 5].tolist() == [-1, -1, -1]
    assert not r.is_resident(0, 5) and 5 in r.planned_resident()[0] and r.growing == [(0, 5)]
    with pytest.raises(ValueError, match="already resident or growing"):
        r.reserve_grow(0, 5)
    r.check()
    cache.write_rows(r.commit_grows())
    assert cache.tables[0, 5].tolist() == list(pages) and r.is_resident(0, 5) and r.growing == []
    r.check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_survive_evictions_and_grows(ckpt: Path) -> None:
    """Elastic mode on the GPU with (piecewise) CUDA graphs: every step replays a graph, through evictions, on-demand
    loads of offloaded experts and grows (tables change in place; the host decides between the pieces). Greedy
    tokens equal static mode run eagerly, in float32."""
    limit = 5
    pool = tight_pool(ckpt, kv_blocks=10, limit=limit, device="cuda", dtype="float32")
    llm = LLM(str(ckpt), page_pool_memory_bytes=pool, device="cuda", dtype="float32", offload_mode="elastic",
              offload_access="copy", adjuster="paper", expert_offload_limit=limit, max_num_batched_tokens=64)
    engine, runner = llm.engine, llm.engine.runner
    assert runner.graphs is not None and runner.graphs.boundaries is not None
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    batches = [prompts(6, seed=1), prompts(2, seed=2), prompts(1, seed=3)]
    got, graph_steps = [], []
    for batch in batches:
        before = runner.graph_steps
        got.append([o.outputs[0].token_ids for o in llm.generate(batch, params)])
        graph_steps.append(runner.graph_steps - before)
    st = llm.stats()
    assert st["expert_evictions"] > 0 and st["expert_grows"] > 0 and st["expert_bytes_loaded"] > 0, st
    assert all(n > 0 for n in graph_steps), graph_steps
    assert runner.graph_steps == engine.forward_steps  # no step fell back to eager
    bounds = runner.graphs.boundaries
    assert bounds.host_waits > 0  # passes with offloaded experts read the routing of those layers
    # (fully resident passes replay the whole graphs, so boundaries that skip the read are not certain to occur)
    # passes with every expert resident (the start, before the first eviction) replayed the whole graphs,
    # the others the piecewise ones
    assert 0 < runner.graphs.whole_replays < runner.graph_steps
    assert st["kv_pages_used"] == 0 and engine.pool.allocator.pending_deferred == 0
    static = LLM(str(ckpt), gpu_memory_budget="1GiB", device="cuda", dtype="float32", enforce_eager=True,
                 max_num_batched_tokens=64)
    assert [[o.outputs[0].token_ids for o in static.generate(b, params)] for b in batches] == got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fully_resident_elastic_replays_whole_graphs(ckpt: Path) -> None:
    """A budget with room to spare: nothing is ever offloaded, so every pass replays a whole graph over the
    resident tables (no piecewise replay, no host wait), routing is still counted, and tokens equal static mode.
    The start-up timing replays (piecewise against whole) leave no trace in these counts."""
    llm = LLM(str(ckpt), gpu_memory_budget="1GiB", device="cuda", dtype="float32", offload_mode="elastic",
              offload_access="copy", adjuster="cost", max_num_batched_tokens=64)
    engine, runner = llm.engine, llm.engine.runner
    assert runner.graphs is not None and runner.graphs.whole_graphs and runner.graphs.whole_mixed_graphs
    # the start-up measurement of what piecewise passes cost beyond whole ones reached the cost adjuster
    assert engine.piecewise_overhead_s is not None and engine.piecewise_overhead_s >= 0
    assert engine.runtime.core.adjuster.piecewise_overhead_s == engine.piecewise_overhead_s
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    batch = prompts(6, seed=1)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    st = llm.stats()
    assert st["expert_evictions"] == 0 and st["expert_bytes_loaded"] == 0, st
    assert runner.graphs.whole_replays == runner.graph_steps == engine.forward_steps > 0
    assert runner.graphs.boundaries.host_waits == 0 and runner.graphs.boundaries.skipped_waits == 0
    # the whole graphs counted routing: the decayed counts (the prior kept apart) hold routed assignments
    pop = engine.runtime.core.popularity
    assert pop.counts.sum() > 1
    static = LLM(str(ckpt), gpu_memory_budget="1GiB", device="cuda", dtype="float32", enforce_eager=True,
                 max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in static.generate(batch, params)] == got


def _tiny_runtime(adjuster, step_cost, async_steps: bool = False, limit: int = 2):
    """An ElasticRuntime over a real residency and core (2 MoE layers x 4 experts, every expert resident) with
    stand-ins for the parts that move bytes (loader, provider, host store)."""
    from types import SimpleNamespace

    from rimuru.experts.elastic_core import ElasticCore
    from rimuru.experts.elastic_runtime import ElasticRuntime
    from rimuru.experts.loader import LoadCounters
    from rimuru.experts.popularity import ExpertPopularity, OnlinePopularity
    from rimuru.experts.routing_counter import RoutingCounter

    geo = PageGeometry.custom(mid_sizes={EXPERT: 64}, small_sizes={"kv": 16})
    alloc = PageAllocator(geo, num_huge_pages=64)
    residency = ExpertResidency(alloc, 2, 4)
    cache = ExpertCache(residency, torch.zeros(64, 16), torch.device("cpu"))
    cache.make_all_resident()
    core = ElasticCore(residency, adjuster, OnlinePopularity(ExpertPopularity.uniform("m", 2, 4)), limit, 4,
                       step_cost)
    core.place_start(4)
    loader = SimpleNamespace(counters=LoadCounters(), attach=lambda pages: None, detach=lambda: [])
    provider = SimpleNamespace(begin_pass=lambda n: None, counter=None, host_tier=None)
    return ElasticRuntime(core, cache, SimpleNamespace(), loader, provider, RoutingCounter(2, 4), 52e9, async_steps)


def test_step_times_leave_the_piecewise_overhead_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime feeds the cost tracker each pass's time minus the piecewise-graph overhead when that pass had
    an expert offloaded (it replayed piecewise graphs), so the compute estimate does not depend on which graphs
    ran; with async scheduling the flag travels with its pass, one step late like the pass's time."""
    from types import SimpleNamespace

    from rimuru.experts.adjuster import AdjustPlan, PaperAdjuster
    from rimuru.experts.runtime import StepDemand
    from rimuru.experts.step_cost import StepCostTracker

    clock = [0.0]
    monkeypatch.setattr("rimuru.experts.elastic_runtime.time", SimpleNamespace(monotonic=lambda: clock[0]))

    class Idle(PaperAdjuster):
        def plan(self, state):  # the test moves experts itself
            return AdjustPlan()

    def runtime(async_steps: bool):
        tracker = StepCostTracker(alpha=1.0, copy_overlap=0.8)
        rt = _tiny_runtime(Idle(), tracker, async_steps)
        rt.set_piecewise_overhead(0.002)
        return rt, tracker

    def step(rt, offloaded: bool, tokens: int = 8, launched: int | None = None, seconds: float = 0.010) -> None:
        r = rt.core.residency
        if offloaded and r.all_resident():  # expert 3 of layer 0 leaves (between passes)
            r.begin_eviction(0, 3)
            rt.cache.clear_rows(r.finish_evictions())
            r.allocator.complete_forward()
        elif not offloaded and not r.all_resident():  # and comes back
            r.reserve_grow(0, 3)
            rt.cache.write_rows(r.commit_grows())
        rt.begin_step()
        rt.plan(StepDemand(num_batched_tokens=tokens))
        rt.before_pass(tokens if launched is None else launched)
        clock[0] += seconds  # the pass's wall time
        rt.after_pass()
        r.allocator.complete_forward()

    sync, tracker = runtime(async_steps=False)
    step(sync, offloaded=True)
    assert tracker() == pytest.approx(0.008)
    step(sync, offloaded=False)
    assert tracker() == pytest.approx(0.010)

    # async: call k times pass k-1 (the host waited for it in step k); the first two calls observe nothing
    asyn, tracker = runtime(async_steps=True)
    step(asyn, offloaded=True)
    step(asyn, offloaded=True)
    assert tracker() is None
    step(asyn, offloaded=False)  # times pass 2 (offloaded)
    assert tracker() == pytest.approx(0.008)
    step(asyn, offloaded=False)  # times pass 3 (all resident)
    assert tracker() == pytest.approx(0.010)
    # each interval is the time of the pass launched one step earlier, and goes to that pass's batch size
    step(asyn, offloaded=False, tokens=300, seconds=0.040)  # launches pass 5 (300 tokens); times pass 4 (8)
    step(asyn, offloaded=False, tokens=8)  # times pass 5
    assert (tracker(8), tracker(300)) == (pytest.approx(0.040), pytest.approx(0.010))  # alpha 1: last samples
    # a step whose planned requests all finished before the launch runs no pass: nothing is timed, and the next
    # interval (no pass in flight before it) is not taken for one either
    sync, tracker = runtime(async_steps=False)
    step(sync, offloaded=False, launched=0, seconds=0.0005)
    assert tracker() is None
    asyn, tracker = runtime(async_steps=True)
    for launched in (8, 8, 8, 0, 8, 8, 8):
        step(asyn, offloaded=False, launched=launched, seconds=0.0005 if launched == 0 else 0.010)
    # timed: pass 2 (by call 3) and pass 6 (by call 7); never the 0.5 ms of host time of call 4
    assert tracker.steps == 2 and tracker(8) == pytest.approx(0.010)


def test_cost_stats_reach_metrics() -> None:
    """The cost adjuster's view (compute estimate, measured copy overlap and slowdown, target, stall bound, grow
    reserve) goes from the elastic core's stats to /metrics; the paper's adjuster exports none of it."""
    import numpy as np

    from rimuru.experts.adjuster import AdjusterState, PaperAdjuster
    from rimuru.experts.cost_adjuster import CostAdjuster, CostAdjusterConfig
    from rimuru.experts.step_cost import StepCostTracker
    from rimuru.server.metrics import COUNTERS, ServerMetrics

    tracker = StepCostTracker(alpha=1.0, copy_overlap=0.8)
    tracker.observe_forward(0.010, 0.0, tokens=8)  # a clean pass: 10 ms of compute
    tracker.observe_forward(0.035, 0.020, tokens=8)  # 25 ms exposed of 20 ms of copies: overlap 0, slowdown 1.25
    # one expert out (52 MB: 1 ms of nominal copy, 1.25 ms measured, hiding nothing), no free page, a queue,
    # requests of 100 mid pages: bringing it home pays, so its 3 pages + 9 are kept from admissions
    adjuster = CostAdjuster(CostAdjusterConfig(), expert_bytes=52_000_000, top_k=2, compute_time=tracker,
                            copy_slowdown=tracker.copy_slowdown, copy_overlap=tracker.copy_overlap_share)
    core = _tiny_runtime(adjuster, tracker).core
    ranks = np.tile(np.arange(4), (2, 1))
    adjuster.plan(AdjusterState(shortfall_mid_pages=0, free_mid_pages=0, resident=[{0, 1, 2, 3}, {0, 1, 2}],
                                probabilities=np.full((2, 4), 0.25), rankings=ranks, offload_limit=2,
                                num_batched_tokens=8, num_running=8, num_waiting=5, kv_mid_pages=800))
    stats = core.stats()
    assert stats["cost_compute_ms"] == pytest.approx(10.0)
    assert (stats["cost_copy_overlap"], stats["cost_copy_slowdown"]) == (0.0, pytest.approx(1.25))
    assert stats["cost_copy_excess"] == 1.0 and stats["cost_read_excess"] == 1.0  # no loads, no reads seen
    assert (stats["cost_target_offloaded"], stats["cost_max_offloaded"]) == (0.0, 1.0)  # home; stalls: 1
    assert stats["cost_grow_reserve_mid_pages"] == 3 + 9
    assert core.admission_reserve_kv_pages() == 12 * 4  # mid pages -> KV pages
    text = ServerMetrics(lambda: stats, "m", 64).render().decode()
    for name, value in stats.items():  # gauges by their name, counters with _total
        suffix = "_total" if name in COUNTERS else ""
        assert f'rimuru:{name}{suffix}{{model_name="m"}} {float(value)}' in text
    assert _tiny_runtime(PaperAdjuster(), None).core.stats() == {}


def test_loads_after_each_pass_feed_the_copy_excess() -> None:
    """after_pass hands the loader's routed (hits + misses) and copied (prefetched + on demand) experts since the
    last pass to the cost tracker; grows are not copies for a pass."""
    from rimuru.experts.adjuster import PaperAdjuster
    from rimuru.experts.step_cost import StepCostTracker

    tracker = StepCostTracker(alpha=1.0)
    rt = _tiny_runtime(PaperAdjuster(), tracker)
    counters = rt.loader.counters
    counters.hits, counters.misses, counters.prefetched, counters.on_demand, counters.grown = 3, 1, 9, 1, 50
    rt.after_pass()
    assert tracker.copy_excess() == pytest.approx(11 / 5)  # (copied + 1) / (routed + 1)
    counters.hits += 5
    counters.prefetched += 5
    rt.after_pass()
    assert tracker.copy_excess() == 1.0  # this pass: every copy routed (alpha 1: the latest pass only)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_load_buffers_are_held_only_while_an_expert_is_offloaded(tiny_checkpoint, device: str) -> None:
    """With >= 8 MoE layers elastic mode starts without load buffers (their pages are KV cache); their slots follow
    the offload (as many as the most offloaded experts of a layer, paid for by the evictions that need them), and
    every slot goes once every expert is home. Tokens equal
    Hugging Face's (CPU) or static mode's (GPU: CUDA graphs, piecewise while offloading, async scheduling, float32)
    throughout; every page is accounted for."""
    from rimuru.experts.residency import lazy_load_buffers

    assert lazy_load_buffers(8) and not lazy_load_buffers(7)
    ckpt = tiny_checkpoint("qwen2_moe", num_hidden_layers=9)  # layer 1 is dense: 8 MoE layers
    limit = 2
    args = {"device": device, "dtype": "float32"} if device == "cuda" else {"device": device}
    # every expert and ~10 KV blocks, no load buffers
    pool = tight_pool(ckpt, kv_blocks=10, limit=limit, load_buffers=False, **args)
    llm = LLM(str(ckpt), page_pool_memory_bytes=pool, offload_mode="elastic", offload_access="copy",
              adjuster="paper", expert_offload_limit=limit,
              max_num_batched_tokens=64, **args)
    engine = llm.engine
    experts, loader, alloc = engine.runtime.cache, engine.runtime.loader, engine.pool.allocator

    def expert_pages_accounted() -> bool:  # between steps: 3 per resident or growing expert + the buffers' pages
        growing = len(experts.residency.growing)  # on a GPU a grow enters the tables once its copy is done
        return alloc.num_used(EXPERT) == 3 * (experts.num_resident + growing) + len(loader.buffer_pages)

    assert experts.all_resident() and loader.buffer_pages == [] and engine.budget_split["load_buffers"] == 0
    assert expert_pages_accounted()
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    heavy, light = prompts(6, seed=1), prompts(1, seed=2)
    got_heavy = [o.outputs[0].token_ids for o in llm.generate(heavy, params)]
    st = llm.stats()
    assert st["expert_evictions"] > 0 and st["expert_bytes_loaded"] > 0, st
    # the copy bandwidth it reckons with is reported (measured at start-up on a GPU, the nominal figure on the CPU)
    assert st["expert_copy_bandwidth"] == llm.engine.runtime.pcie_bandwidth > 0
    from rimuru.server.metrics import ServerMetrics

    text = ServerMetrics(lambda: {"expert_copy_bandwidth": st["expert_copy_bandwidth"]}, "m", 64).render().decode()
    exported = [float(line.split()[-1]) for line in text.splitlines()
                if line.startswith('rimuru:expert_copy_bytes_per_second{model_name="m"}')]
    assert exported == [st["expert_copy_bandwidth"]]
    assert expert_pages_accounted()
    # whole slots, never more than the limit (the next step attaches what the last evictions need)
    slots = loader.slots
    assert len(loader.buffer_pages) == 2 * 3 * slots and slots <= limit
    got_light = []
    for _ in range(8):  # light traffic leaves pages free: experts come home, then the buffers go
        got_light = [o.outputs[0].token_ids for o in llm.generate(light, params)]
        if experts.all_resident() and not loader.buffer_pages:
            break
    assert experts.all_resident() and loader.buffer_pages == [] and expert_pages_accounted()
    alloc.check_invariants()
    assert alloc.num_used(EXPERT) == 3 * experts.total_experts and alloc.pending_deferred == 0
    assert llm.stats()["kv_pages_used"] == 0
    if device == "cpu":
        assert got_heavy == hf_greedy(ckpt, [p["prompt_token_ids"] for p in heavy], STEPS)
        assert got_light == hf_greedy(ckpt, [p["prompt_token_ids"] for p in light], STEPS)
    else:
        assert engine.runner.graphs is not None  # the GPU run replayed graphs through it all
        static = LLM(str(ckpt), gpu_memory_budget="1GiB", enforce_eager=True, **args)
        assert [o.outputs[0].token_ids for o in static.generate(heavy, params)] == got_heavy
        assert [o.outputs[0].token_ids for o in static.generate(light, params)] == got_light


def test_the_longest_request_accepted_runs_although_offloading_attaches_the_buffers(tiny_checkpoint) -> None:
    """The KV room a request may count on (max_kv_pages, and max_model_len from it) is what evicting every allowed
    expert frees minus the load buffers that evicting attaches: a request of max_model_len tokens runs to the end
    (counting the buffers' pages as KV room would accept one block more, which then waits for ever, preempted and
    evicting in turn)."""
    ckpt = tiny_checkpoint("qwen2_moe", num_hidden_layers=9)
    limit = 2
    probe = LLM(str(ckpt), gpu_memory_budget="1GiB", max_num_batched_tokens=64, enforce_eager=True, device="cpu")
    split, geo = probe.engine.budget_split, probe.engine.geometry
    pool = split["experts_resident"] + 40 * geo.size("expert")
    llm = LLM(str(ckpt), page_pool_memory_bytes=pool, device="cpu", offload_mode="elastic", offload_access="copy",
              adjuster="paper",
              expert_offload_limit=limit, max_num_batched_tokens=64)
    engine = llm.engine
    assert engine.runtime.core.lazy_buffers and engine.runtime.loader.buffer_pages == []
    spm = geo.smalls_per_mid("kv", EXPERT)
    evictable = 3 * engine.runtime.cache.num_layers * limit - 2 * 3 * limit  # every allowed expert out, buffers in
    assert engine.max_kv_pages() == engine.kv.capacity_pages() + evictable * spm
    total = engine.max_model_len
    prompt = [3 + i % 290 for i in range(total - 8)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": prompt + [5] * 16}], SamplingParams(max_tokens=8))


def test_elastic_start_and_default_limit() -> None:
    """Every expert starts resident when they all fit; else as many as fit beside their load-buffer slots with a
    tenth of the pool left to KV. The default limit is the paper's E / 6, raised to the fewest that let such a pool
    start at all (8 MoE layers x 12 experts: lazy buffers, 6 pages a slot)."""
    from rimuru.experts.elastic_core import default_elastic_limit, elastic_start_resident, start_pages

    L, E = 8, 12
    assert start_pages(L, E, E, 2) == 3 * L * E  # all resident: no slots
    assert elastic_start_resident(L, E, free_mid_pages=3 * L * E, limit=2) == E
    # 250 pages: 225 after the KV tenth; 9 resident (216 pages) + 3 slots (18) = 234 > 225, 8 + 4 slots = 216
    assert elastic_start_resident(L, E, free_mid_pages=250, limit=4) == 8
    assert start_pages(L, E, 8, 4) == 3 * L * 8 + 2 * 3 * 4
    assert default_elastic_limit(L, E, 3 * L * E) == E // 6  # room for every expert: the paper's limit
    assert default_elastic_limit(L, E, 250) == 4  # E / 6 = 2 cannot start (10 resident + 2 slots = 252 > 225)
    assert default_elastic_limit(L, E, 10) == E  # nothing starts: the builder refuses the pool
