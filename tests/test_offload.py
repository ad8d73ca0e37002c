"""`fixed` offload mode: host store, load buffers, predictor, provider, and the engine end to end.

Greedy tokens in `fixed` mode must equal `static` mode's and transformers' for every K, including
K=1 where nearly every routed expert crosses from the host store through a load buffer. The counters
are checked against an independent count of the routed non-resident experts, and no page leaks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rimuru import LLM
from rimuru.experts.cache import resolve_offload_limit, resolve_resident_count
from rimuru.experts.host_store import HostExpertStore
from rimuru.experts.loader import ExpertLoader
from rimuru.experts.offload_provider import OffloadExpertProvider
from rimuru.experts.residency import BUFFER_OWNER, EXPERT
from rimuru.experts.runtime import StaticRuntime
from rimuru.experts.static_provider import StaticExpertProvider
from rimuru.testing.reference import hf_greedy, random_prompts, run_greedy
from rimuru.testing.tiny_models import ARCHS

STEPS = 24
PROMPT_LENS = (5, 17, 33)
BUDGET = "64MiB"


@pytest.fixture(scope="module")
def checkpoints(parity_checkpoints: dict[str, Path]) -> dict[str, Path]:
    return parity_checkpoints


def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENS)




@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {arch: hf_greedy(path, prompts(), STEPS) for arch, path in checkpoints.items()}


class RoutingSpy:
    """Wraps a provider's table(): counts, independently of the provider's own bookkeeping, the routed
    experts of each MoE layer call that are not resident."""

    def __init__(self, provider: OffloadExpertProvider) -> None:
        self.inner = provider.table
        self.cache = provider.cache
        self.non_resident_routed = 0
        self.calls = 0
        provider.table = self  # type: ignore[method-assign]

    def __call__(self, moe_layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        routed = set(torch.unique(topk_ids).tolist())
        self.non_resident_routed += sum(1 for e in routed if not self.cache.residency.is_resident(moe_layer, e))
        table = self.inner(moe_layer, topk_ids)
        rows = table[sorted(routed)]
        assert bool((rows >= 0).all()), f"layer {moe_layer}: a routed expert has no pages"
        return table


def run(llm: LLM, ps: list[list[int]], steps: int = STEPS, one_by_one: bool = False) -> list[list[int]]:
    return run_greedy(llm, ps, steps, one_by_one)


def fixed(path: Path, resident: float, **kwargs: object) -> LLM:
    kwargs.setdefault("gpu_memory_budget", BUDGET)
    return LLM(str(path), device="cpu", offload_mode="fixed", offload_access="copy",
               resident_experts=resident, **kwargs)


# ---------------------------------------------------------------- units


def test_resident_count_and_offload_limit() -> None:
    assert [resolve_resident_count(r, 8) for r in (8, 4, 1, 4.0, 0.5, 0.3, 0.01)] == [8, 4, 1, 4, 4, 2, 1]
    assert resolve_resident_count(0.5, 60) == 30
    for bad, msg in [(None, "needs resident_experts"), (4.5, "neither a whole count"), (9, "more than the 8"),
                     (0, "positive"), (-1, "positive")]:
        with pytest.raises(ValueError, match=msg):
            resolve_resident_count(bad, 8)
    assert resolve_offload_limit(None, 8, 3) == 5
    assert resolve_offload_limit(7, 8, 3) == 7
    assert resolve_offload_limit(None, 8, 8) == 0
    with pytest.raises(ValueError, match="expert_offload_limit=4 is below the 5 experts"):
        resolve_offload_limit(4, 8, 3)
    with pytest.raises(ValueError, match="more than the 8 experts"):
        resolve_offload_limit(9, 8, 3)


def test_host_store_layout_and_errors() -> None:
    store = HostExpertStore(2, 3, 4, 6, torch.float32, pin=False)
    assert store.pinned is False and [t.shape for t in store.layers] == [torch.Size([3, 3, 24])] * 2
    assert store.expert_bytes == 3 * 4 * 6 * 4 and store.nbytes == 2 * 3 * store.expert_bytes
    w1, w3, w2 = torch.randn(4, 6), torch.randn(4, 6), torch.randn(6, 4)
    store.write(1, 2, w1, w3, w2)
    got = store.expert(1, 2)  # [3, f*d]
    assert torch.equal(got[0].view(4, 6), w1) and torch.equal(got[1].view(4, 6), w3)
    assert torch.equal(got[2].view(6, 4), w2)
    with pytest.raises(ValueError, match=r"w2 has shape \(4, 6\), expected \(6, 4\)"):
        store.write(0, 0, w1, w3, w1)
    with pytest.raises(IndexError, match="expert 3 of MoE layer 0 is outside"):
        store.expert(0, 3)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            HostExpertStore(1, 1, 1, 1, torch.float32, pin=True)
    # seeded: the same draws twice
    a, b = HostExpertStore(2, 3, 4, 6, torch.float32), HostExpertStore(2, 3, 4, 6, torch.float32)
    a.fill_random(seed=5)
    b.fill_random(seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.layers, b.layers, strict=True))
    assert float(a.layers[0].std()) == pytest.approx(0.02, rel=0.3)


def test_a_ranks_store_holds_its_block_of_experts_by_their_model_ids() -> None:
    """Expert parallelism: rank 1 of 2 over 6 experts holds experts 3..5 in slots 0..2."""
    store = HostExpertStore(2, 3, 4, 6, torch.float32, pin=False, first_expert=3)
    w1, w3, w2 = torch.randn(4, 6), torch.randn(4, 6), torch.randn(6, 4)
    store.write(1, 4, w1, w3, w2)
    assert store.slot(1, 4) == 1 and torch.equal(store.layers[1][1, 0].view(4, 6), w1)
    assert torch.equal(store.expert(1, 4)[2].view(6, 4), w2)
    assert [store.holds(e) for e in range(7)] == [False, False, False, True, True, True, False]
    with pytest.raises(IndexError, match=r"expert 2 of MoE layer 0 is outside the store \(2 layers x experts 3\.\.5\)"):
        store.expert(0, 2)


def test_provider_loads_misses_prefetches_hits_and_keeps_tables(checkpoints) -> None:
    llm = fixed(checkpoints["qwen3_moe"], 2)  # 2 MoE layers, 8 experts, top-2; resident 0, 1
    eng = llm.engine
    provider, cache, store, loader = eng.runtime.provider, eng.runtime.cache, eng.runtime.store, eng.runtime.loader
    assert isinstance(provider, OffloadExpertProvider) and loader.slots == 6 and loader.copy_stream is None
    view = cache.expert_view
    f, d = eng.spec.moe_intermediate_size, eng.spec.hidden_size

    def assert_points_at_store(table: torch.Tensor, layer: int, experts: list[int]) -> None:
        for e in experts:
            for j in range(3):
                assert torch.equal(view[int(table[e, j])], store.expert(layer, e)[j])

    # layer 0 without a prediction: routed 0 (resident), 2, 3, 5 are misses, loaded into buffer 0
    ids = torch.tensor([[2, 3], [0, 5]])
    table = provider.table(0, ids)
    assert table is loader.buffers[0].table  # the preallocated per-buffer table, updated in place
    assert table[[0, 1]].tolist() == cache.tables[0, [0, 1]].tolist()
    assert table[[4, 6, 7]].tolist() == [[-1, -1, -1]] * 3
    assert_points_at_store(table, 0, [2, 3, 5])
    c = loader.counters
    assert (c.hits, c.misses, c.on_demand, c.prefetched) == (0, 3, 3, 0)
    assert c.bytes_loaded == 3 * 3 * f * d * 4
    # the next call of layer 0 (a new forward pass) starts from an empty buffer, in the same table tensor
    assert provider.table(0, torch.tensor([[4, 0]])) is table
    assert table[[2, 3, 5]].tolist() == [[-1, -1, -1]] * 3
    assert_points_at_store(table, 0, [4])
    assert (c.hits, c.misses) == (0, 4)

    # only resident experts routed: the cache's own table, nothing loaded
    assert provider.table(1, torch.tensor([[0, 1]])).data_ptr() == cache.tables[1].data_ptr()
    assert c.experts_loaded == 4

    # before_layer(0) predicts layer 1 from layer 0's input; table(0) prefetches it into buffer 1
    hidden = torch.randn(5, d, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        scores = provider.predictor.scores(1, hidden)  # [E]
        predicted = [e for e in torch.nonzero(scores > 0).flatten().tolist() if e >= 2]
        assert predicted and 5 * 2 / 8 <= scores.sum().item() <= 5.0  # T tokens x top-2 of 8 probabilities
        provider.before_layer(0, hidden)
        provider.table(0, torch.tensor([[0, 1]]))
    assert c.prefetched == len(predicted) and set(loader.buffers[1].slot_of) == set(predicted)
    other = next(e for e in range(2, 8) if e not in predicted) if len(predicted) < 6 else None
    routed = [predicted[0]] + ([other] if other is not None else [])
    table1 = provider.table(1, torch.tensor([routed]))
    assert table1 is loader.buffers[1].table
    assert c.hits == 1 and c.misses == 4 + (other is not None)
    assert_points_at_store(table1, 1, routed)
    with pytest.raises(ValueError, match=r"must be in \[0, 8\)"):
        provider.table(1, torch.tensor([[0, 8]]))


def test_predictor_applies_the_layers_own_routing(checkpoints) -> None:
    """The predictor guesses with everything the layer's router adds to its gate: on the hidden states the layer
    itself routes, its guesses are exactly the routed experts (a bias-blind guess prefetched a skewed router's cold
    experts every step on the H200). A dummy skewed router adds a bias and a Gumbel transform of the logits."""
    llm = fixed(checkpoints["qwen3_moe"], 0.5, load_format="dummy", dummy_routing="zipf:1.5")
    predictor = llm.engine.runtime.provider.predictor
    hidden = torch.randn(7, predictor.routers[1][1].gate.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        norm, moe = predictor.routers[1]
        _, ids = moe.route(norm(hidden))  # [T, k]
        for t in range(hidden.shape[0]):
            guessed = torch.nonzero(predictor.scores(1, hidden[t:t + 1])).flatten()
            assert sorted(guessed.tolist()) == sorted(ids[t].tolist())
        assert (moe.router_bias != 0).any() and moe.gumbel_routing


def test_loader_reuses_slots_of_unneeded_prefetches(checkpoints) -> None:
    llm = fixed(checkpoints["qwen3_moe"], 2)
    eng = llm.engine
    alloc = eng.pool.allocator
    pages = alloc.allocate_mid(EXPERT, 12, owner=BUFFER_OWNER)
    loader = ExpertLoader(eng.runtime.cache, eng.runtime.store, pages, eng.fence)  # smaller than E - K on purpose
    buf = loader.claim(1)
    loader.load(buf, [2, 3], keep=set(), prefetch=True)
    s2, s3 = buf.slot_of[2], buf.slot_of[3]
    slot_of_3 = buf.slot_pages[s3]
    loader.load(buf, [4], keep={2, 4}, prefetch=False)  # 3 was not routed: its slot takes 4
    assert buf.slot_of == {2: s2, 4: s3}
    assert buf.table[3].tolist() == [-1, -1, -1] and tuple(buf.table[4].tolist()) == slot_of_3
    for j in range(3):
        assert torch.equal(eng.runtime.cache.expert_view[slot_of_3[j]], eng.runtime.store.expert(1, 4)[j])
    with pytest.raises(RuntimeError, match="needs 1 more experts in a load buffer of 2 slots"):
        loader.load(buf, [5], keep={2, 4}, prefetch=False)
    alloc.free_mid(EXPERT, pages)
    with pytest.raises(ValueError, match="come in 6 pages .* got 3"):
        ExpertLoader(eng.runtime.cache, eng.runtime.store, pages[:3], eng.fence)


# ---------------------------------------------------------------- engine


@pytest.mark.parametrize("arch", ARCHS)
def test_fixed_mode_greedy_equals_static_and_transformers(arch: str, checkpoints, references) -> None:
    ref = references[arch]
    static = run(LLM(str(checkpoints[arch]), gpu_memory_budget=BUDGET, device="cpu"), prompts())
    for g, r in zip(static, ref, strict=True):
        assert len(r) == STEPS and g == r
    for resident in (8, 4, 1):
        llm = fixed(checkpoints[arch], resident)
        eng = llm.engine
        L = eng.spec.num_moe_layers
        spy = RoutingSpy(eng.runtime.provider) if resident < 8 else None
        assert run(llm, prompts()) == ref, f"K={resident}"
        st = llm.stats()
        assert st["resident_experts"] == L * resident and st["total_experts"] == L * 8
        alloc = eng.pool.allocator
        limit = 8 - resident
        assert alloc.num_used(EXPERT) == L * resident * 3 + 2 * limit * 3
        if resident == 8:
            assert isinstance(eng.runtime, StaticRuntime) and eng.runtime.mode == "fixed"  # no loader, no host copies
            assert isinstance(eng.runtime.provider, StaticExpertProvider)
            assert (st["expert_bytes_loaded"], st["prefetch_hits"], st["prefetch_misses"]) == (0, 0, 0)
            continue
        c = eng.runtime.loader.counters
        f, d = eng.spec.moe_intermediate_size, eng.spec.hidden_size
        assert spy.calls > 0 and spy.non_resident_routed > 0
        assert st["prefetch_hits"] + st["prefetch_misses"] == spy.non_resident_routed
        assert (st["prefetch_hits"], st["prefetch_misses"]) == (c.hits, c.misses)
        assert c.on_demand == c.misses and c.experts_loaded == c.on_demand + c.prefetched
        assert st["expert_bytes_loaded"] == c.experts_loaded * 3 * f * d * 4
        if L > 1:  # the predictor has a next layer to guess: some guesses are right
            assert c.prefetched > 0 and c.hits > 0
    # one request at a time gives the same tokens at K=1
    assert run(fixed(checkpoints[arch], 1), prompts(), one_by_one=True) == ref


def test_fraction_larger_limit_and_chunked_prefill(checkpoints, references) -> None:
    llm = fixed(checkpoints["qwen2_moe"], 0.25, expert_offload_limit=7, max_num_batched_tokens=7)
    eng = llm.engine
    assert eng.runtime.loader.slots == 7 and llm.stats()["resident_experts"] == 2 * 2
    assert eng.pool.allocator.num_used(EXPERT) == 2 * 2 * 3 + 2 * 7 * 3
    assert run(llm, prompts()) == references["qwen2_moe"]
    split = eng.budget_split
    assert split["load_buffers"] == 2 * 7 * 3 * eng.geometry.size(EXPERT)
    assert split["host_experts"] == eng.runtime.store.nbytes == 2 * 8 * 3 * 32 * 64 * 4


def test_dummy_weights_are_the_same_model_in_static_and_fixed(checkpoints) -> None:
    path = str(checkpoints["mixtral"])
    static = LLM(path, gpu_memory_budget=BUDGET, device="cpu", load_format="dummy", seed=4)
    fixed_llm = fixed(checkpoints["mixtral"], 3, load_format="dummy", seed=4)
    store, cache = fixed_llm.engine.runtime.store, static.engine.runtime.cache
    for layer in range(cache.num_layers):
        for e in range(cache.num_experts):
            for j, page in enumerate(cache.residency.pages_of(layer, e)):
                assert torch.equal(store.expert(layer, e)[j], cache.expert_view[page])
    assert run(fixed_llm, prompts()[:2], steps=8) == run(static, prompts()[:2], steps=8)


def test_fixed_mode_bad_settings(checkpoints) -> None:
    path = checkpoints["qwen2_moe"]
    with pytest.raises(ValueError, match="needs resident_experts"):
        LLM(str(path), gpu_memory_budget=BUDGET, device="cpu", offload_mode="fixed")
    with pytest.raises(ValueError, match="more than the 8 experts"):
        fixed(path, 9)
    with pytest.raises(ValueError, match="expert_offload_limit=2 is below the 6 experts"):
        fixed(path, 2, expert_offload_limit=2)
    with pytest.raises(ValueError, match=r"expert_offload_limit must be in \[1, 8\] in elastic mode"):
        LLM(str(path), gpu_memory_budget=BUDGET, device="cpu", offload_mode="elastic", offload_access="copy",
            adjuster="paper",
            expert_offload_limit=9)
    # a pool with room for fewer expert pages than 2 layers x 4 resident + 2 buffers x 4 experts (48 pages)
    probe = fixed(path, 1)
    split, geo = probe.engine.budget_split, probe.engine.geometry
    budget = split["non_expert_weights"] + split["workspace"] + geo.huge_size
    have = geo.huge_size // geo.size(EXPERT)
    assert have < 48
    with pytest.raises(ValueError, match=rf"needs 24 expert pages for 2 x 4 resident experts \+ 24 for 2 load "
                                         rf"buffers of 4 experts = 48 pages .* the page pool holds {have} "):
        fixed(path, 4, gpu_memory_budget=budget)


# ---------------------------------------------------------------- GPU (marked gpu; skipped without CUDA)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_bf16_fixed_equals_static(arch: str, checkpoints) -> None:
    path = str(checkpoints[arch])
    common = dict(device="cuda", dtype="bfloat16", gpu_memory_budget="1GiB", enforce_eager=True)  # offload only
    static = run(LLM(path, **common), prompts())
    for resident in (4, 1):
        llm = LLM(path, offload_mode="fixed", offload_access="copy", resident_experts=resident, **common)
        eng = llm.engine
        assert eng.runtime.store.pinned and eng.runtime.loader.copy_stream is not None
        spy = RoutingSpy(eng.runtime.provider)
        assert run(llm, prompts()) == static, f"K={resident}"
        st, c = llm.stats(), eng.runtime.loader.counters
        assert st["prefetch_hits"] + st["prefetch_misses"] == spy.non_resident_routed > 0
        f, d = eng.spec.moe_intermediate_size, eng.spec.hidden_size
        assert st["expert_bytes_loaded"] == c.experts_loaded * 3 * f * d * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_piecewise_graphs_fixed_equals_static(arch: str, checkpoints) -> None:
    """Fixed mode with CUDA graphs: every step replays piecewise graphs (engine/piecewise_graphs.py), the provider
    deciding loads between the pieces; greedy tokens equal static mode run eagerly (float32)."""
    path = str(checkpoints[arch])
    common = dict(device="cuda", dtype="float32", gpu_memory_budget="1GiB")
    static = run(LLM(path, enforce_eager=True, **common), prompts())
    for resident in (4, 1):
        llm = LLM(path, offload_mode="fixed", offload_access="copy", resident_experts=resident, **common)
        runner, eng = llm.engine.runner, llm.engine
        assert runner.graphs is not None and runner.graphs.boundaries is not None
        assert run(llm, prompts()) == static, f"K={resident}"
        assert runner.graph_steps == llm.engine.forward_steps > 0  # no eager step
        assert runner.graphs.boundaries.host_waits > 0
        c = eng.runtime.loader.counters
        assert c.experts_loaded == c.on_demand + c.prefetched and c.hits + c.misses > 0
        assert llm.stats()["kv_pages_used"] == 0
