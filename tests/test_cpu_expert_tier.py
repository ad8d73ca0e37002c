"""The CPU expert tier: routed offloaded experts computed on the host from the host store instead of copied.

Units: the host compute against the paged MoE's torch reference (float32; a wrong weight, index, matrix or combine
fails it), the start-up measurement's interpolation, the tier choice from given costs. Engine: greedy tokens with
`cpu_expert_compute="on"` equal `off` and transformers in fixed and elastic mode, the host really computed experts
(independent count of the routed offloaded experts), and no page leaked. GPU tests are marked `gpu`.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.config import EngineConfig, add_engine_args
from rimuru.experts.expert_tiers import TierCosts, choose_host_experts, layer_time, resolve_cpu_expert_compute
from rimuru.experts.host_compute import HostAssignments, HostExpertCompute
from rimuru.experts.host_profile import (
    NO_SPREAD,
    HostExpertTimes,
    HostSpread,
    measure_expert_times,
    measure_spread,
    profile_host,
    scratch_compute,
)
from rimuru.experts.host_store import HostExpertStore
from rimuru.experts.offload_provider import OffloadExpertProvider
from rimuru.experts.residency import EXPERT
from rimuru.experts.step_cost import StepCostTracker
from rimuru.kernels.fused_moe import fused_moe, fused_moe_reference, host_row_code
from rimuru.testing.reference import hf_greedy, random_prompts, run_greedy
from rimuru.testing.tiny_models import ARCHS

STEPS = 16
PROMPT_LENS = (5, 17, 33)
BUDGET = "64MiB"
BF16_TIE = 0.25  # a top-2 logprob gap within bf16 rounding of the tiny models' logits (they are flat: ~0.2 is common)


def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENS)


# ---------------------------------------------------------------- host compute against the reference


def _paged(store: HostExpertStore, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert of `layer` in pages of an expert view, scattered (pages in reverse), and its table [E, 3]."""
    E, f, d = store.num_experts, store.f, store.d
    view = torch.zeros(3 * E + 2, f * d, dtype=store.dtype)  # [pages, f*d]
    table = torch.empty(E, 3, dtype=torch.int32)
    for e in range(E):
        pages = [3 * E + 1 - (3 * e + j) for j in range(3)]
        for j, p in enumerate(pages):
            view[p] = store.expert(layer, e)[j]
        table[e] = torch.tensor(pages)
    return view, table


def _store(layers: int = 2, E: int = 6, f: int = 8, d: int = 12, seed: int = 0) -> HostExpertStore:
    store = HostExpertStore(layers, E, f, d, torch.float32, pin=False)
    store.fill_random(seed=seed, std=0.3)
    return store


def _routing(T: int, k: int, E: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k] distinct per token
    weights = torch.rand(T, k, generator=g) + 0.1
    return ids, weights


def test_host_compute_equals_the_paged_reference_and_completes_its_kernel() -> None:
    store = _store()
    compute = HostExpertCompute(store)
    layer = 1
    view, table = _paged(store, layer)
    T, k, E = 7, 3, store.num_experts
    hidden = torch.randn(T, store.d, generator=torch.Generator().manual_seed(2))
    ids, weights = _routing(T, k, E)
    want = fused_moe_reference(hidden, weights, ids, view, table, store.f)  # [T, d]

    every = HostAssignments.select(ids, weights, torch.arange(E))
    assert every.num_assignments == T * k
    torch.testing.assert_close(compute.compute(layer, hidden, every), want, rtol=1e-5, atol=1e-6)

    # split: the host computes experts 1 and 4, the kernel the rest (their table rows -1 contribute zeros)
    host = torch.tensor([1, 4])
    part = HostAssignments.select(ids, weights, host)
    assert set(part.experts.tolist()) <= {1, 4} and part.num_assignments == int(torch.isin(ids, host).sum())
    absent = table.clone()
    absent[host] = -1
    with pytest.raises(ValueError, match="routed to but not resident"):
        fused_moe_reference(hidden, weights, ids, view, absent, store.f)
    device_part = fused_moe_reference(hidden, weights, ids, view, absent, store.f, skip_absent=True)
    torch.testing.assert_close(device_part + compute.compute(layer, hidden, part), want, rtol=1e-5, atol=1e-6)

    # one table with all three kinds of rows: pages, host rows read in place (direct access, entries <= -2) and the
    # host tier's -1 rows (skipped); the -1 rows are still an error without skip_absent
    mixed = absent.clone()
    mixed[2] = torch.tensor([host_row_code(2, j) for j in range(3)], dtype=torch.int32)
    host_rows = store.layers[layer].view(3 * E, -1)  # [3E, f*d]
    with pytest.raises(ValueError, match="routed to but not resident"):
        fused_moe_reference(hidden, weights, ids, view, mixed, store.f, host_rows)
    device_part = fused_moe_reference(hidden, weights, ids, view, mixed, store.f, host_rows, skip_absent=True)
    torch.testing.assert_close(device_part + compute.compute(layer, hidden, part), want, rtol=1e-5, atol=1e-6)
    via_dispatch = fused_moe(hidden, weights, ids, view, mixed, store.f, host_rows=host_rows, skip_absent=True)
    torch.testing.assert_close(via_dispatch, device_part)

    # the test has teeth: another layer's weights, swapped gate/up, shifted rows or dropped weights all differ
    assert not torch.allclose(compute.compute(0, hidden, every), want, atol=1e-4)
    shifted = HostAssignments(rows=(every.rows + 1) % T, experts=every.experts, weights=every.weights)
    assert not torch.allclose(compute.compute(layer, hidden, shifted), want, atol=1e-4)
    unweighted = HostAssignments(rows=every.rows, experts=every.experts, weights=torch.ones_like(every.weights))
    assert not torch.allclose(compute.compute(layer, hidden, unweighted), want, atol=1e-4)
    swapped = HostExpertStore(2, E, store.f, store.d, torch.float32, pin=False)
    for e in range(E):
        w = store.expert(layer, e)
        swapped.write(layer, e, w[1].view(store.f, store.d), w[0].view(store.f, store.d), w[2].view(store.d, store.f))
    assert not torch.allclose(HostExpertCompute(swapped).compute(layer, hidden, every), want, atol=1e-4)


def test_host_compute_of_one_token_experts_equals_the_paged_reference() -> None:
    """A decode step's host experts mostly see one token each: they take matrix-vector products, not one-row GEMMs."""
    store = _store()
    compute = HostExpertCompute(store)
    view, table = _paged(store, 0)
    for seed in range(3):
        hidden = torch.randn(1, store.d, generator=torch.Generator().manual_seed(10 + seed))
        ids, weights = _routing(1, 3, store.num_experts, seed=seed)
        want = fused_moe_reference(hidden, weights, ids, view, table, store.f)  # [1, d]
        got = compute.compute(0, hidden, HostAssignments.select(ids, weights, torch.arange(store.num_experts)))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(compute.compute(1, hidden, HostAssignments.select(
            ids, weights, torch.arange(store.num_experts))), want, atol=1e-4)  # another layer's weights differ


def test_host_compute_spread_over_threads_equals_the_paged_reference() -> None:
    """A call's experts dealt to min(m, T) workers of T // m threads each: any thread count gives the reference's
    result, every expert is computed once (a dropped or doubled one differs), and the caller's threads stay."""
    store = _store(E=6)
    layer = 0
    view, table = _paged(store, layer)
    T, k = 9, 4
    hidden = torch.randn(T, store.d, generator=torch.Generator().manual_seed(3))
    ids, weights = _routing(T, k, store.num_experts, seed=4)
    want = fused_moe_reference(hidden, weights, ids, view, table, store.f)
    every = HostAssignments.select(ids, weights, torch.arange(store.num_experts))
    caller = torch.get_num_threads()
    for threads in (1, 2, 3, 5, 8):
        compute = HostExpertCompute(store, threads=threads)
        got = compute.compute(layer, hidden, every)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compute.compute(layer, hidden, every), got, rtol=0, atol=0)  # no timing in it
        assert torch.get_num_threads() == caller
    # a thread started after the workers set their counts starts with the caller's (2 here), not a worker's (1)
    seen: list[int] = []
    torch.set_num_threads(2)
    try:
        HostExpertCompute(store, threads=4).compute(layer, hidden, every)  # 4 workers of 1 thread
        fresh = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        fresh.start()
        fresh.join()
    finally:
        torch.set_num_threads(caller)
    assert seen == [2]
    assert HostExpertCompute(store, threads=5).worker_threads(3) == [2, 2, 1]
    assert HostExpertCompute(store, threads=5).worker_threads(1) == [5]
    assert HostExpertCompute(store, threads=4).worker_threads(10) == [1, 1, 1, 1]
    # a compute that does not spread runs a call's experts one after another over every thread, to the same sums
    serial = HostExpertCompute(store, threads=4, spread=False)
    assert serial.worker_threads(10) == [4] and serial.worker_threads(1) == [4]
    torch.testing.assert_close(serial.compute(layer, hidden, every), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="at least one thread"):
        HostExpertCompute(store, threads=0)
    # teeth: one expert's assignments twice differs from the reference
    doubled = HostAssignments(rows=torch.cat([every.rows, every.rows[:1]]),
                              experts=torch.cat([every.experts, every.experts[:1]]),
                              weights=torch.cat([every.weights, every.weights[:1]]))
    assert not torch.allclose(HostExpertCompute(store, threads=3).compute(layer, hidden, doubled), want, atol=1e-4)


def test_host_compute_gathered_rows_and_bad_input() -> None:
    """The tier hands the host only the routed tokens' rows (rows index them); bad input names the problem."""
    store = _store(E=4)
    compute = HostExpertCompute(store)
    hidden = torch.randn(5, store.d)
    ids, weights = _routing(5, 2, 4, seed=3)
    full = compute.compute(0, hidden, HostAssignments.select(ids, weights, torch.tensor([2])))  # [5, d]
    picked = HostAssignments.select(ids, weights, torch.tensor([2]))
    rows, local = torch.unique(picked.rows, return_inverse=True)
    gathered = compute.compute(0, hidden[rows], HostAssignments(local, picked.experts, picked.weights))
    torch.testing.assert_close(gathered, full[rows])
    assert torch.equal(full[[r for r in range(5) if r not in rows.tolist()]], torch.zeros(5 - len(rows), store.d))
    nothing = HostAssignments.select(ids, weights, torch.tensor([], dtype=torch.long))
    assert torch.equal(compute.compute(0, hidden, nothing), torch.zeros(5, store.d))
    with pytest.raises(ValueError, match=r"rows must be in \[0, 5\)"):
        compute.compute(0, hidden, HostAssignments(torch.tensor([5]), torch.tensor([0]), torch.tensor([1.0])))
    with pytest.raises(ValueError, match=r"experts must be in \[0, 4\)"):
        compute.compute(0, hidden, HostAssignments(torch.tensor([0]), torch.tensor([4]), torch.tensor([1.0])))
    with pytest.raises(ValueError, match=r"must be \[T, d = 12\]"):
        compute.compute(0, hidden[:, :5], HostAssignments.select(ids, weights, torch.tensor([2])))
    with pytest.raises(ValueError, match="one shape"):
        HostAssignments(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([1.0]))


def test_host_compute_in_bf16_is_close_to_float32() -> None:
    """The matmuls run in the store's dtype (bf16 here), the combine in float32."""
    store = _store(E=4, f=16, d=32)
    bf16 = HostExpertStore(2, 4, 16, 32, torch.bfloat16, pin=False)
    for e in range(4):
        w = store.expert(0, e)
        bf16.write(0, e, w[0].view(16, 32), w[1].view(16, 32), w[2].view(32, 16))
    hidden = torch.randn(6, 32, generator=torch.Generator().manual_seed(4))
    ids, weights = _routing(6, 2, 4, seed=5)
    work = HostAssignments.select(ids, weights, torch.arange(4))
    want = HostExpertCompute(store).compute(0, hidden, work)
    got = HostExpertCompute(bf16).compute(0, hidden.bfloat16(), work)
    assert got.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: a few rounding steps of the inputs and the intermediate, relative to the norm
    assert float((got - want).norm() / want.norm()) < 0.03


# ---------------------------------------------------------------- start-up measurement


def test_expert_times_interpolate_and_extrapolate() -> None:
    t = HostExpertTimes(tokens=(1, 2, 4), seconds=(1.0, 1.5, 2.5))
    assert [t(n) for n in (0.5, 1, 2, 3, 4, 8)] == [1.0, 1.0, 1.5, 2.0, 2.5, 4.5]
    assert HostExpertTimes((2,), (1.0,))(4) == 2.0
    with pytest.raises(ValueError, match="ascending"):
        HostExpertTimes((2, 1), (1.0, 1.0))
    with pytest.raises(ValueError, match="as many times"):
        HostExpertTimes((1, 2), (1.0,))


def test_spread_interpolates_and_refuses_bad_counts() -> None:
    s = HostSpread(experts=(1, 2, 4), speedup=(1.0, 1.8, 3.0))
    assert [s(m) for m in (0, 1, 2, 3, 4, 16)] == [1.0, 1.0, 1.8, 2.4, 3.0, 3.0]
    assert NO_SPREAD(8) == 1.0
    assert s.helps and not NO_SPREAD.helps
    assert not HostSpread(experts=(1, 2, 4), speedup=(1.0, 0.61, 0.8)).helps  # the H100 host's measured spread
    with pytest.raises(ValueError, match="the first count 1"):
        HostSpread((2, 4), (1.0, 2.0))
    with pytest.raises(ValueError, match="ascending"):
        HostSpread((1, 4, 2), (1.0, 2.0, 1.5))


def test_host_profile_measures_this_machine() -> None:
    compute = scratch_compute(16, 32, torch.float32, experts=3)
    assert compute.store.num_experts == 3
    times = measure_expert_times(compute, tokens=(1, 4), experts=3, reps=1)
    assert times.tokens == (1, 4) and all(s > 0 for s in times.seconds)
    spread = measure_spread(compute, reps=1)
    assert spread.experts == (1, 2) and spread.speedup[0] == 1.0
    assert spread.speedup[1] == pytest.approx(2 * spread.call_seconds[0] / spread.call_seconds[1])
    with pytest.raises(ValueError, match="from one expert up"):
        measure_spread(compute, counts=(2, 4))
    profile = profile_host(16, 32, torch.float32)
    assert profile.bandwidth > 1e8 and profile.threads == torch.get_num_threads()
    assert profile.expert_times.tokens == (1, 2, 4, 8, 16) and profile.expert_bytes == 3 * 16 * 32 * 4
    assert profile.spread.experts == (1, 2, 4, 8, 16)
    text = profile.describe()
    assert "GB/s read" in text and "1 tok" in text and "16 tok" in text and "NUMA" in text and "16: " in text


# ---------------------------------------------------------------- the tier choice, from given costs


def test_choice_sends_few_token_experts_to_the_host_and_copies_busy_ones() -> None:
    # a 9.4 MB expert at ~50 GB/s: 0.19 ms to copy; on the host 0.05 ms + 0.02 ms per token
    costs = TierCosts(copy_s=0.19e-3, host_s=lambda n: 0.05e-3 + 0.02e-3 * n, layer_fixed_s=0.03e-3)
    decode = [(3, 1), (7, 2), (9, 1), (11, 40), (12, 300)]
    # host time of 1, 1, 2 token experts: 0.07 + 0.07 + 0.09 (+ 0.03) = 0.26 ms against 0.57 ms of copies;
    # the 40-token expert (0.85 ms on the host) and the 300-token one are copied
    assert choose_host_experts(decode, costs) == [3, 7, 9]
    assert layer_time([1, 1, 2, 40, 300], 3, costs) == pytest.approx(2 * 0.19e-3 + 0.26e-3)
    assert choose_host_experts(decode, costs, mode="on") == [3, 7, 9, 11, 12]
    assert choose_host_experts(decode, costs, mode="off") == []
    assert choose_host_experts([], costs) == []
    # a prefill chunk: every expert routed by many tokens is copied
    assert choose_host_experts([(e, 64) for e in range(8)], costs) == []
    # GPU work to hide behind lets the host take more: 0.85 ms of resident compute covers the 40-token expert
    assert choose_host_experts(decode, costs, overlap_s=1.2e-3) == [3, 7, 9, 11]


def test_choice_amortises_the_layers_fixed_cost() -> None:
    """The activations' round trip is paid once per layer: one expert does not pay for it, three do."""
    costs = TierCosts(copy_s=1.0, host_s=lambda n: 0.5, layer_fixed_s=0.8)
    assert choose_host_experts([(0, 1)], costs) == []  # 1.3 on the host against 1.0 copied
    assert choose_host_experts([(0, 1), (1, 1), (2, 1)], costs) == [0, 1, 2]  # 2.3 against 3.0
    # ties go to copying (the fewest host experts among equals)
    assert choose_host_experts([(0, 1)], TierCosts(copy_s=1.3, host_s=lambda n: 0.5, layer_fixed_s=0.8)) == []


def test_choice_counts_the_hosts_spread_over_experts() -> None:
    """Three experts that take 1.5 each alone cost 4.5 one after another (more than three copies of 1.0), 2.25
    at a speedup of 2 for three together: the host takes them only with the spread."""
    alone = TierCosts(copy_s=1.0, host_s=lambda n: 1.5)
    assert choose_host_experts([(0, 1), (1, 1), (2, 1)], alone) == []
    spread = TierCosts(copy_s=1.0, host_s=lambda n: 1.5, spread=lambda m: min(m, 2.0))
    assert choose_host_experts([(0, 1), (1, 1), (2, 1)], spread) == [0, 1, 2]
    assert layer_time([1, 1, 1], 3, spread) == pytest.approx(2.25)
    assert choose_host_experts([(0, 1)], spread) == []  # one expert is alone: 1.5 against 1.0


def test_choice_bad_input_and_the_setting() -> None:
    costs = TierCosts(copy_s=1.0, host_s=lambda n: 0.1)
    with pytest.raises(ValueError, match="expert 4 is a candidate with 0 routed tokens"):
        choose_host_experts([(4, 0)], costs)
    with pytest.raises(ValueError, match="must be one of auto, off, on"):
        choose_host_experts([(4, 1)], costs, mode="always")
    with pytest.raises(ValueError, match="copy_s >= 0"):
        TierCosts(copy_s=-1.0, host_s=lambda n: 0.1)
    assert resolve_cpu_expert_compute("auto", "cuda", "copy") and not resolve_cpu_expert_compute("auto", "cpu", "copy")
    assert resolve_cpu_expert_compute("on", "cpu", "copy") and not resolve_cpu_expert_compute("off", "cuda", "copy")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_cpu_expert_compute("yes", "cpu", "copy")
    # direct access: the kernel reads offloaded experts itself, nothing is copied; auto is off, on is refused
    assert not resolve_cpu_expert_compute("auto", "cuda", "direct")
    assert not resolve_cpu_expert_compute("off", "cuda", "direct")
    with pytest.raises(ValueError, match="--offload-access copy"):
        resolve_cpu_expert_compute("on", "cuda", "direct")


def test_step_cost_counts_host_experts_in_copy_equivalents() -> None:
    t = StepCostTracker(alpha=1.0)
    t.observe_loads(routed=10, copied=10)
    assert t.offload_cost_factor() == t.copy_excess() == 1.0 and t.host_share() == 0.0
    profile = profile_host(8, 16, torch.float32)
    t.use_host_tier(profile, expert_copy_s=0.2e-3)
    # 10 experts from the buffers (10 copies, excess 1), 30 on the host at 0.05 ms each = 1/4 of a copy
    t.observe_loads(routed=10, copied=10, host=30, host_s=30 * 0.05e-3)
    assert t.host_share() == pytest.approx(0.75)
    assert t.offload_cost_factor() == pytest.approx(0.25 * 1.0 + 0.75 * 0.25)
    # a pass is timed without its host seconds
    t.observe_forward(10e-3, copy_s=0.0, tokens=4, host_s=3e-3)
    assert t(4) == pytest.approx(7e-3)
    with pytest.raises(ValueError, match="positive"):
        t.use_host_tier(profile, expert_copy_s=0.0)
    with pytest.raises(ValueError, match="host_s >= 0"):
        t.observe_loads(1, 1, host=1, host_s=-1.0)


# ---------------------------------------------------------------- config and flags


def test_flag_parses_and_bad_settings_are_refused() -> None:
    parser = add_engine_args(argparse.ArgumentParser())
    args = parser.parse_args(["m", "--cpu-expert-compute", "on", "--cpu-expert-threads", "4", "--offload-access",
                              "copy"])
    cfg = EngineConfig.from_cli_args(args)
    assert (cfg.cpu_expert_compute, cfg.cpu_expert_threads, cfg.offload_access) == ("on", 4, "copy")
    assert EngineConfig.from_cli_args(parser.parse_args(["m"])).cpu_expert_compute == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--cpu-expert-compute", "sometimes"])
    with pytest.raises(ValueError, match="cpu_expert_compute must be one of auto, off, on"):
        EngineConfig(model="m", cpu_expert_compute="yes")
    with pytest.raises(ValueError, match="offload_mode='static' offloads none"):
        EngineConfig(model="m", cpu_expert_compute="on", offload_mode="static", offload_access="copy")
    # on with direct access (the default): refused, naming the copy path
    with pytest.raises(ValueError, match="offload_access='direct' copies none.*--offload-access copy"):
        EngineConfig(model="m", cpu_expert_compute="on", offload_mode="fixed")
    with pytest.raises(SystemExit, match="--offload-access copy"):
        EngineConfig.from_cli_args(parser.parse_args(["m", "--cpu-expert-compute", "on"]))
    with pytest.raises(ValueError, match="cpu_expert_threads must be at least 1"):
        EngineConfig(model="m", cpu_expert_threads=0)


def test_host_memory_short_is_a_clear_error(parity_checkpoints: dict[str, Path], monkeypatch) -> None:
    import rimuru.experts.runtime_builders as builders

    monkeypatch.setattr(builders, "available_host_bytes", lambda: 2**30)
    with pytest.raises(ValueError, match=r"host expert store needs .* plus 2.00 GiB of headroom, but only 1.00 GiB"):
        LLM(str(parity_checkpoints["qwen3_moe"]), device="cpu", gpu_memory_budget=BUDGET, offload_mode="fixed",
            resident_experts=2)


# ---------------------------------------------------------------- engine, CPU float32


class HostCountSpy:
    """Counts, independently of the provider and the tier, the routed experts of each MoE layer call that are not
    resident and not in the layer's load buffer after the call: the ones the host must have computed."""

    def __init__(self, provider: OffloadExpertProvider) -> None:
        self.inner = provider.table
        self.provider = provider
        self.on_host = 0
        provider.table = self  # type: ignore[method-assign]

    def __call__(self, moe_layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        table = self.inner(moe_layer, topk_ids)
        routed = torch.unique(topk_ids).tolist()
        self.on_host += sum(1 for e in routed if int(table[e, 0]) < 0)
        return table


@pytest.fixture(scope="module")
def references(parity_checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {arch: hf_greedy(path, prompts(), STEPS) for arch, path in parity_checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_fixed_mode_host_tier_on_equals_off_and_transformers(arch: str, parity_checkpoints, references) -> None:
    path = str(parity_checkpoints[arch])
    common = dict(device="cpu", gpu_memory_budget=BUDGET, offload_mode="fixed", offload_access="copy")
    ref = references[arch]
    for resident in (4, 1):
        off = LLM(path, resident_experts=resident, cpu_expert_compute="off", **common)
        assert off.engine.runtime.provider.host_tier is None
        assert run_greedy(off, prompts(), STEPS) == ref
        on = LLM(path, resident_experts=resident, cpu_expert_compute="on", **common)
        spy = HostCountSpy(on.engine.runtime.provider)
        assert run_greedy(on, prompts(), STEPS) == ref, f"K={resident}"
        st = on.stats()
        tier = on.engine.runtime.provider.host_tier
        c = tier.counters
        assert c.experts == spy.on_host > 0  # every routed expert left out of a table was computed on the host
        assert st["cpu_experts_computed"] == c.experts and st["cpu_expert_tokens"] >= c.experts
        assert st["cpu_expert_bytes_not_copied"] == c.experts * on.engine.runtime.store.expert_bytes
        assert st["cpu_expert_compute_s"] > 0
        # the host took copies away: fewer bytes over the link than with the tier off
        assert st["expert_bytes_loaded"] < off.stats()["expert_bytes_loaded"]
        L = on.engine.spec.num_moe_layers
        assert on.engine.pool.allocator.num_used(EXPERT) == L * resident * 3 + 2 * (8 - resident) * 3
        assert off.stats()["cpu_experts_computed"] == 0
    # one request at a time: single-token decode steps, each routed offloaded expert on the host
    one = LLM(path, resident_experts=1, cpu_expert_compute="on", **common)
    assert run_greedy(one, prompts(), STEPS, one_by_one=True) == ref


def test_auto_is_off_on_the_cpu_device_and_counters_reach_metrics(parity_checkpoints) -> None:
    from rimuru.server.metrics import ServerMetrics

    path = str(parity_checkpoints["qwen2_moe"])
    llm = LLM(path, device="cpu", gpu_memory_budget=BUDGET, offload_mode="fixed", offload_access="copy",
              resident_experts=2)
    assert llm.engine.runtime.provider.host_tier is None and llm.stats()["cpu_experts_computed"] == 0
    assert LLM(path, device="cpu", gpu_memory_budget=BUDGET).stats()["cpu_expert_tokens"] == 0  # static: zeros
    on = LLM(path, device="cpu", gpu_memory_budget=BUDGET, offload_mode="fixed", offload_access="copy",
             resident_experts=1, cpu_expert_compute="on")
    run_greedy(on, prompts()[:1], 4)
    stats = on.stats()
    assert stats["cpu_expert_tokens"] > 0
    text = ServerMetrics(lambda: stats, "m", 64).render().decode()
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    for name in ("cpu_expert_tokens", "cpu_experts_computed", "cpu_expert_bytes_not_copied",
                 "cpu_expert_compute_seconds"):
        assert "counter" in (types.get("rimuru:" + name), types.get(f"rimuru:{name}_total")), (name, types)
    assert f'rimuru:cpu_expert_tokens_total{{model_name="m"}} {float(stats["cpu_expert_tokens"])}' in text


def test_direct_access_has_no_host_tier(parity_checkpoints, references) -> None:
    """Direct access (the default): the kernel reads offloaded experts from the host store, nothing is copied, so
    the tier does not act (auto is off, the runtimes have no tier, its counters are 0) and `on` is refused."""
    from rimuru.experts.direct_runtime import DirectElasticRuntime, DirectRuntime
    from tests.test_elastic import tight_pool

    path = parity_checkpoints["qwen3_moe"]
    fixed = LLM(str(path), device="cpu", gpu_memory_budget=BUDGET, offload_mode="fixed", resident_experts=1,
                cpu_expert_compute="auto")
    assert isinstance(fixed.engine.runtime, DirectRuntime)
    assert run_greedy(fixed, prompts(), STEPS) == references["qwen3_moe"]
    assert fixed.stats()["cpu_experts_computed"] == 0 and fixed.stats()["cpu_expert_tokens"] == 0
    pool = tight_pool(path, kv_blocks=10, limit=5, load_buffers=False, offload_access="direct")
    elastic = LLM(str(path), page_pool_memory_bytes=pool, device="cpu", offload_mode="elastic", expert_offload_limit=5,
                  max_num_batched_tokens=64, cpu_expert_compute="auto")
    runtime = elastic.engine.runtime
    assert isinstance(runtime, DirectElasticRuntime) and runtime.host_tier is None
    assert run_greedy(elastic, prompts(), STEPS) == references["qwen3_moe"]
    st = elastic.stats()
    assert st["cpu_experts_computed"] == 0 and st["cpu_expert_compute_s"] == 0.0 and st["kv_pages_used"] == 0
    with pytest.raises(ValueError, match="--offload-access copy"):
        LLM(str(path), device="cpu", gpu_memory_budget=BUDGET, offload_mode="fixed", resident_experts=1,
            cpu_expert_compute="on")


def test_auto_copies_busy_experts_and_computes_few_token_ones_on_the_host(parity_checkpoints, references) -> None:
    """`auto` with given costs in the engine (on the CPU device `auto` resolves off, so the tier is set by hand): an
    expert costs 1 to copy and 0.45 per token on the host, so experts of 1-2 tokens go to the host and busier ones
    (in the prompts' prefill chunks) are copied. Every choice is recorded; tokens stay transformers'."""
    from rimuru.experts.host_tier import HostExpertTier

    # prefill chunks of 8 read routing (16 would stream)
    llm = LLM(str(parity_checkpoints["qwen3_moe"]), device="cpu", gpu_memory_budget=BUDGET, offload_mode="fixed",
              offload_access="copy", resident_experts=1, max_num_batched_tokens=8)
    runtime = llm.engine.runtime
    tier = HostExpertTier(HostExpertCompute(runtime.store), TierCosts(copy_s=1.0, host_s=lambda n: 0.45 * n),
                          mode="auto")
    runtime.provider.host_tier = tier
    seen: list[tuple[list[tuple[int, int]], list[int]]] = []
    choose = tier.choose

    def recording(candidates, routed_tokens):
        chosen = choose(candidates, routed_tokens)
        if not isinstance(routed_tokens, dict):  # the real routing (not the prefetch's guess)
            seen.append(([(e, int(routed_tokens[e])) for e in candidates], chosen))
        return chosen

    tier.choose = recording  # type: ignore[method-assign]
    assert run_greedy(llm, prompts(), STEPS) == references["qwen3_moe"]
    on_host = [n for cands, chosen in seen for e, n in cands if e in chosen]
    copied = [n for cands, chosen in seen for e, n in cands if e not in chosen]
    assert on_host and max(on_host) <= 2  # few-token experts computed on the host
    assert copied and min(copied) >= 3  # busy experts copied: the tier loses there and is not chosen
    assert llm.stats()["cpu_experts_computed"] == len(on_host)


@pytest.mark.parametrize("arch", ARCHS)
def test_elastic_mode_host_tier_on_equals_off_and_transformers(arch: str, parity_checkpoints) -> None:
    """A budget that holds every expert but few KV blocks: evictions come under load, the host computes the
    evicted experts' few decode tokens, and tokens, pages and invariants are as with the tier off."""
    from tests.test_elastic import prompts as elastic_prompts
    from tests.test_elastic import tight_pool

    path = parity_checkpoints[arch]
    limit = 5
    pool = tight_pool(path, kv_blocks=10, limit=limit)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    heavy = elastic_prompts(6, seed=1)
    got = {}
    for setting in ("off", "on"):
        llm = LLM(str(path), page_pool_memory_bytes=pool, device="cpu", offload_mode="elastic", offload_access="copy",
                  adjuster="paper", expert_offload_limit=limit, max_num_batched_tokens=64, cpu_expert_compute=setting)
        got[setting] = [o.outputs[0].token_ids for o in llm.generate(heavy, params)]
        st = llm.stats()
        assert st["expert_evictions"] > 0 and st["kv_pages_used"] == 0 and st["running"] == 0
        alloc = llm.engine.pool.allocator
        alloc.check_invariants()
        assert alloc.pending_deferred == 0
        runtime = llm.engine.runtime
        residency = runtime.cache.residency
        assert alloc.num_used(EXPERT) == 3 * (runtime.cache.num_resident + len(residency.growing)) \
            + len(runtime.core.buffer_pages)
        if setting == "on":
            assert st["cpu_experts_computed"] > 0 and st["cpu_expert_tokens"] > 0
            core = llm.engine.runtime.core
            assert core.step_cost is None or core.step_cost.host_share() >= 0.0
    assert got["on"] == got["off"] == hf_greedy(path, [p["prompt_token_ids"] for p in heavy], STEPS)


def test_elastic_cost_adjuster_sees_the_host_tier(parity_checkpoints) -> None:
    """With the cost adjuster, the tracker gets the start-up measurement and the host-computed experts."""
    from tests.test_elastic import prompts as elastic_prompts
    from tests.test_elastic import tight_pool

    path = parity_checkpoints["qwen3_moe"]
    pool = tight_pool(path, kv_blocks=10, limit=5)
    llm = LLM(str(path), page_pool_memory_bytes=pool, device="cpu", offload_mode="elastic", offload_access="copy",
              expert_offload_limit=5, max_num_batched_tokens=64, cpu_expert_compute="on")
    costs = llm.engine.runtime.core.step_cost
    assert costs is not None and costs.host_profile is not None and costs.expert_copy_s > 0
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    llm.generate(elastic_prompts(6, seed=1), params)
    if llm.stats()["cpu_experts_computed"] > 0:
        assert costs.host_share() > 0.0
    assert llm.stats()["kv_pages_used"] == 0


# ---------------------------------------------------------------- GPU (marked gpu; skipped without CUDA)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_eager_host_tier_float32_equals_copy_path(arch: str, parity_checkpoints) -> None:
    """On the GPU, eager, float32: the host tier forced on gives the copy path's greedy tokens, and the host
    computed experts (the side-stream-free overlap: D2H of the routed rows, kernel, host matmuls, H2D, add)."""
    path = str(parity_checkpoints[arch])
    common = dict(device="cuda", dtype="float32", gpu_memory_budget="1GiB", enforce_eager=True, offload_mode="fixed",
                  offload_access="copy")
    for resident in (4, 1):
        off = run_greedy(LLM(path, resident_experts=resident, cpu_expert_compute="off", **common), prompts(), STEPS)
        llm = LLM(path, resident_experts=resident, cpu_expert_compute="on", **common)
        assert llm.engine.runtime.store.pinned
        assert run_greedy(llm, prompts(), STEPS) == off, f"K={resident}"
        st = llm.stats()
        assert st["cpu_experts_computed"] > 0 and st["cpu_expert_bytes_not_copied"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_cuda_graph_replays_run_the_host_tier_float32_equal_to_the_copy_path(arch: str, parity_checkpoints) -> None:
    """With CUDA graphs (piecewise, a HostJoin after every MoE kernel), float32: the host tier forced on gives the
    copy path's greedy tokens, its replays computed experts on the host, and the steps replayed graphs."""
    path = str(parity_checkpoints[arch])
    common = dict(device="cuda", dtype="float32", gpu_memory_budget="1GiB", offload_mode="fixed",
                  offload_access="copy", resident_experts=2, max_num_seqs=8)
    off = run_greedy(LLM(path, cpu_expert_compute="off", **common), prompts(), STEPS)
    llm = LLM(path, cpu_expert_compute="on", **common)
    assert run_greedy(llm, prompts(), STEPS) == off
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graph_steps > 0
    assert llm.stats()["cpu_experts_computed"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_bf16_host_tier_logits_close_to_copy_path(arch: str, parity_checkpoints) -> None:
    """bf16: the host tier's MoE output is within bf16 tolerance of the copy path's, layer by layer; greedy tokens
    agree up to a near-tie: where a sequence first differs, the copy path's top-2 logprobs there are within
    BF16_TIE (bf16 sums in another order may pick either), and the rest of that sequence is not compared."""
    path = str(parity_checkpoints[arch])
    common = dict(device="cuda", dtype="bfloat16", gpu_memory_budget="1GiB", enforce_eager=True,
                  offload_mode="fixed", offload_access="copy", resident_experts=2)
    copy_path = LLM(path, cpu_expert_compute="off", **common)
    off = run_greedy(copy_path, prompts(), STEPS)
    llm = LLM(path, cpu_expert_compute="on", **common)
    on = run_greedy(llm, prompts(), STEPS)
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2)
    for prompt, a, b in zip(prompts(), on, off, strict=True):
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if i is None:
            continue
        top = copy_path.generate([{"prompt_token_ids": prompt + b[:i]}], one_token)[0].outputs[0].logprobs[0]
        first, second = sorted((lp.logprob for lp in top.values()), reverse=True)[:2]
        assert first - second < BF16_TIE, (f"token {i}: host tier {a[i]}, copy path {b[i]}, top-2 logprob gap "
                                           f"{first - second:.3g}; host tier {a}, copy path {b}")
    copy_path.shutdown()
    assert llm.stats()["cpu_experts_computed"] > 0
    # one MoE layer's output: host part + kernel part against the kernel with every expert copied
    eng = llm.engine
    store, provider = eng.runtime.store, eng.runtime.provider
    moe = eng.model.moe_blocks()[0]
    x = (0.5 * torch.randn(4, eng.spec.hidden_size, device="cuda")).bfloat16()
    with torch.no_grad():
        weights, ids = moe.route(x)
        provider.host_tier.mode = "off"
        want = moe(x)
        provider.host_tier.mode = "on"
        got = moe(x)
    assert store.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_elastic_host_tier_auto_measures_and_serves(parity_checkpoints) -> None:
    """auto on a GPU: the costs are measured at start (PCIe, host, round trip), tokens equal the tier off."""
    from tests.test_elastic import prompts as elastic_prompts
    from tests.test_elastic import tight_pool

    path = parity_checkpoints["qwen3_moe"]
    pool = tight_pool(path, kv_blocks=10, limit=5, device="cuda", dtype="float32")
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    got = {}
    for setting in ("off", "auto"):
        llm = LLM(str(path), page_pool_memory_bytes=pool, device="cuda", dtype="float32", offload_mode="elastic",
                  offload_access="copy", expert_offload_limit=5, max_num_batched_tokens=64, enforce_eager=True,
                  cpu_expert_compute=setting)
        got[setting] = [o.outputs[0].token_ids for o in llm.generate(elastic_prompts(6, seed=1), params)]
        tier = llm.engine.runtime.provider.host_tier
        if setting == "auto":
            assert tier is not None and tier.costs.copy_s > 0 and tier.costs.layer_fixed_s > 0
        assert llm.stats()["kv_pages_used"] == 0
    assert got["auto"] == got["off"]
