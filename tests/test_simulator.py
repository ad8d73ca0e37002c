"""The capacity simulator on a tiny model: every page accounted for, every request finished, elastic >= fixed."""

from __future__ import annotations

import numpy as np
import pytest

from rimuru.experts.popularity import ExpertPopularity
from rimuru.experts.runtime import StepDemand
from rimuru.model_spec import ModelSpec
from rimuru.sim.cost_model import CostModel, HardwareConfig
from rimuru.sim.simulator import SimConfig, SimRequest, Simulation, SimulationError, plan_memory

# expert page 64 x 64 x 2 B = 8 KiB; KV page 16 tokens x 2 x 2 heads x 16 x 2 B = 2 KiB -> 4 KV pages per mid
TINY_HF = {
    "model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "intermediate_size": 128, "max_position_embeddings": 4096,
}
TINY = ModelSpec.from_hf_config(TINY_HF)
PAGE = 8192
# a tiny model's roofline is nanoseconds; 10 ms per step lets the queue build up as on a real card
SLOW_STEPS = HardwareConfig(step_overhead_s=0.01)


def config(mode: str, pool_pages: int, **kw) -> SimConfig:
    kw.setdefault("adjuster_kind", "paper")  # the mechanism tests run the paper's rules, which move experts readily
    kw.setdefault("offload_access", "copy")  # and the copy path's load buffers, unless a test asks for direct
    probe = SimConfig(mode=mode, budget_bytes=1 << 40, max_num_seqs=64, max_num_batched_tokens=512)
    mem = plan_memory(TINY, probe)
    return SimConfig(mode=mode, budget_bytes=mem.non_expert_weights + mem.workspace + pool_pages * PAGE,
                     max_num_seqs=64, max_num_batched_tokens=512, hardware=SLOW_STEPS, **kw)


def trace(n: int = 120, seed: int = 0) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / 200.0, n))  # 2 arrivals per 10 ms step on average
    return [SimRequest(int(rng.integers(8, 80)), int(rng.integers(4, 60)), float(x)) for x in t]


POP = ExpertPopularity.zipf("tiny", 2, 8, exponent=1.0, seed=0)


@pytest.mark.parametrize("access", ["copy", "direct"])
@pytest.mark.parametrize("mode", ["static", "fixed", "elastic"])
def test_conservation(mode: str, access: str) -> None:
    reqs = trace()
    sim = Simulation(TINY, POP, config(mode, pool_pages=48 + 24, expert_offload_limit=4, offload_access=access,
                                       resident_experts=4 if mode == "fixed" else None))
    res = sim.run(reqs)
    assert res.output_tokens == sum(r.output_len for r in reqs)
    assert len(res.ttft_s) == len(reqs)  # every request got its first token ...
    assert not sim.scheduler.has_unfinished()  # ... and finished
    pages = res.final_pages
    assert pages["kv_pages"] == pages["kv_pages_tracked"] == 0
    # two load buffers of `limit` experts (held for good: 2 layers); none with direct access
    buffers = 0 if mode == "static" or access == "direct" else 2 * 3 * 4
    assert pages["expert_pages"] == pages["expert_pages_tracked"] == 3 * int(sim.residency.in_tables.sum()) + buffers
    assert pages["pending_deferred"] == 0
    assert pages["free_bytes"] + pages["used_bytes"] == pages["pool_bytes"] == 72 * PAGE
    assert pages["used_bytes"] == pages["expert_pages"] * PAGE
    if mode == "static":
        assert sim.residency.in_tables.all() and res.pcie_bytes == 0
    if mode == "fixed":
        assert sim.residency.in_tables.sum(axis=1).tolist() == [4, 4]  # E - limit
        for layer in range(2):  # the resident set is the top of the ranking
            assert set(np.flatnonzero(sim.residency.in_tables[layer])) == set(POP.rankings[layer, :4].tolist())


def test_elastic_beats_fixed_under_a_binding_budget() -> None:
    """8 MoE layers, so that elastic mode holds its load buffers only while an expert is out (with 2 layers the
    buffers of a limit of l experts take exactly the pages that offloading l experts per layer frees)."""
    spec = ModelSpec.from_hf_config({**TINY_HF, "num_hidden_layers": 8})
    pop = ExpertPopularity.zipf("tiny8", 8, 8, exponent=1.0, seed=0)

    def cfg(mode: str, **kw) -> SimConfig:
        probe = SimConfig(mode=mode, budget_bytes=1 << 40, max_num_seqs=64, max_num_batched_tokens=512)
        mem = plan_memory(spec, probe)
        return SimConfig(mode=mode, budget_bytes=mem.non_expert_weights + mem.workspace + 222 * PAGE,
                         max_num_seqs=64, max_num_batched_tokens=512, hardware=SLOW_STEPS, **kw)

    reqs = trace(200)
    fixed = Simulation(spec, pop, cfg("fixed", resident_experts=6)).run(reqs)
    elastic = Simulation(spec, pop, cfg("elastic", expert_offload_limit=4, adjuster_kind="paper")).run(reqs)
    static = Simulation(spec, pop, cfg("static")).run(reqs)
    assert elastic.evictions > 0 and elastic.grows > 0
    assert elastic.peak_running >= fixed.peak_running > static.peak_running
    assert elastic.forward_steps <= fixed.forward_steps
    for res in (fixed, elastic, static):  # the memory split never over-commits the pool
        assert all(f >= 0 for f in res.timeline["free_bytes"])


def test_elastic_respects_limit_and_prefix() -> None:
    sim = Simulation(TINY, POP, config("elastic", 60, expert_offload_limit=3))
    seen = []

    def check(sim: Simulation) -> None:
        counts = sim.residency.in_tables.sum(axis=1)
        seen.append(counts.tolist())
        for layer, k in enumerate(counts):
            assert 8 - k <= 3
            assert set(np.flatnonzero(sim.residency.in_tables[layer])) == set(POP.rankings[layer, :k].tolist())

    sim.run(trace(60), after_step=check)
    assert min(min(c) for c in seen) == 5  # the limit was reached


def test_static_refuses_when_experts_do_not_fit() -> None:
    with pytest.raises(SimulationError, match="static mode needs 8 resident experts per layer"):
        Simulation(TINY, POP, config("static", 40))


def test_cost_model_exact() -> None:
    hw = HardwareConfig(peak_flops=1e12, hbm_bandwidth=1e9, flops_efficiency=1.0, bandwidth_efficiency=1.0,
                        pcie_bandwidth=1e8, copy_overlap=0.5, step_overhead_s=0.0, piecewise_overhead_per_layer_s=1e-4)
    uniform = ExpertPopularity.uniform("tiny", 2, 8)
    cm = CostModel(TINY, uniform.probabilities, hw)
    # one token, top-2 of 8 uniform: each expert activated with probability 1/4, 2 per layer expected
    assert np.allclose(cm.activation(1), 0.25)
    assert np.allclose(cm.activation(2), 1 - 0.75**2)
    resident = np.ones((2, 8), dtype=bool)
    resident[:, 4:] = False
    c = cm.step([(0, 1)], num_sampled=1, resident=resident)
    assert c.activated_experts == pytest.approx(4.0)
    assert c.offloaded_activated == pytest.approx(2.0)
    assert c.pcie_bytes == pytest.approx(2.0 * 3 * 64 * 64 * 2)
    copy = c.pcie_bytes / 1e8
    assert c.copy_s == pytest.approx(copy)
    # experts offloaded: the piecewise-graph overhead, 0.1 ms per MoE layer (2 layers), is in the step
    assert c.piecewise_s == pytest.approx(2e-4)
    assert c.time_s == pytest.approx(c.compute_s + max(0.0, copy - 0.5 * c.compute_s) + 2e-4)
    every = cm.step([(0, 1)], num_sampled=1, resident=np.ones((2, 8), dtype=bool))
    assert every.piecewise_s == 0.0 and every.time_s == pytest.approx(every.compute_s)


def test_bad_hardware_flag_is_a_clear_error() -> None:
    import argparse

    from rimuru.sim.cli import hardware_from

    flags = dict.fromkeys(("peak_tflops", "hbm_bandwidth", "pcie_bandwidth", "flops_efficiency",
                           "bandwidth_efficiency", "copy_overlap", "step_overhead_ms", "piecewise_overhead_us"))
    ok = hardware_from(argparse.Namespace(hardware="h200", **dict(flags, piecewise_overhead_us=100.0)))
    assert ok.piecewise_overhead_per_layer_s == pytest.approx(1e-4)
    with pytest.raises(SystemExit, match="piecewise_overhead_per_layer_s must be >= 0"):
        hardware_from(argparse.Namespace(hardware="h200", **dict(flags, piecewise_overhead_us=-5.0)))
    with pytest.raises(SystemExit, match="copy_overlap must be in"):
        hardware_from(argparse.Namespace(hardware="h200", **dict(flags, copy_overlap=2.0)))


def test_elastic_with_lazy_load_buffers_pays_for_them_and_gives_them_back() -> None:
    """With >= 8 MoE layers (as the engine) the simulated load buffers (2 x 3 x limit pages) are held only while an
    expert is out: the first evictions also free their pages, and after the last request every expert is home, the
    buffers are gone, and every page is accounted for."""
    spec = ModelSpec.from_hf_config({**TINY_HF, "num_hidden_layers": 8})
    pop = ExpertPopularity.zipf("tiny8", 8, 8, exponent=1.0, seed=0)
    probe = SimConfig(mode="elastic", adjuster_kind="paper", budget_bytes=1 << 40, max_num_seqs=64,
                      max_num_batched_tokens=512)
    mem = plan_memory(spec, probe)
    pool = 8 * 8 * 3 + 60  # every expert and 60 pages of KV room
    budget = mem.non_expert_weights + mem.workspace + pool * PAGE
    cfg = SimConfig(mode="elastic", adjuster_kind="paper", budget_bytes=budget, max_num_seqs=64,
                    max_num_batched_tokens=512, hardware=SLOW_STEPS, expert_offload_limit=3, offload_access="copy")
    sim = Simulation(spec, pop, cfg)
    assert sim.core.lazy_buffers and sim.core.buffer_pages == [] and sim.residency.in_tables.all()
    held = []

    def watch(sim: Simulation) -> None:  # after a step: (slots held, the most offloaded experts of one layer)
        out = 8 - sim.residency.in_tables.sum(axis=1)
        held.append((sim.core.buffer_slots, int(out.max())))
        assert len(sim.core.buffer_pages) == 2 * 3 * sim.core.buffer_slots <= 2 * 3 * 3  # whole slots, <= limit

    res = sim.run(trace(), after_step=watch)
    assert res.evictions >= 2 and res.output_tokens == sum(r.output_len for r in trace())
    assert any(slots > 0 for slots, _ in held)  # held while experts were out
    # the slots follow the offload: never more than the most offloaded layer has needed since they were taken, and
    # fewer than the limit while fewer are out
    assert any(0 < slots == most < 3 for slots, most in held), held
    assert sim.residency.in_tables.all() and sim.core.buffer_pages == []
    pages = res.final_pages
    assert pages["expert_pages"] == pages["expert_pages_tracked"] == 3 * 64 and pages["pending_deferred"] == 0


def test_step_time_fit_recovers_the_profile_that_made_the_passes() -> None:
    """Passes timed by a known sum-form profile: the fit gives back its three coefficients and its times exactly,
    whatever the roofline profile it starts from; too few passes are refused."""
    from rimuru.sim.calibration import StepSample, decode_chunks, fit_step_time, mixed_chunks

    truth = HardwareConfig(flops_efficiency=0.3, bandwidth_efficiency=1.2, layer_overhead_s=1e-4,
                           compute_plus_memory=True)
    shapes = [decode_chunks(4, 100), decode_chunks(32, 400), mixed_chunks(300, 8, 200), mixed_chunks(1000, 2, 50)]
    resident = np.ones(POP.probabilities.shape, dtype=bool)
    samples = [StepSample(TINY, POP.probabilities, c, 1, CostModel(TINY, POP.probabilities, truth).step(
        list(c), 1, resident).time_s) for c in shapes]
    c = CostModel(TINY, POP.probabilities, truth).step(list(shapes[2]), 1, resident)
    assert c.compute_s == pytest.approx(c.flops / (truth.peak_flops * 0.3) + c.hbm_bytes / (truth.hbm_bandwidth * 1.2)
                                        + TINY.num_hidden_layers * 1e-4, rel=1e-12)
    fitted, times = fit_step_time(samples, HardwareConfig())
    assert (fitted.flops_efficiency, fitted.bandwidth_efficiency, fitted.layer_overhead_s) == pytest.approx(
        (0.3, 1.2, 1e-4), rel=1e-6)
    assert fitted.compute_plus_memory and times == pytest.approx([s.measured_s for s in samples], rel=1e-9)
    with pytest.raises(ValueError, match="at least 3 measured passes"):
        fit_step_time(samples[:2], HardwareConfig())


@pytest.mark.parametrize("hardware, fit_file", [("h200", "2026-12-01-sim-calibration-static-steps-h200.json"),
                                                ("h100", "2026-12-07-sim-calibration-static-steps-by-batch-h100.json")])
def test_the_gpu_profiles_are_the_committed_fits(hardware: str, fit_file: str) -> None:
    """The simulator's step time on each GPU is the fit benchmarks/calibrate_simulator.py wrote from passes measured
    on that GPU."""
    import json
    from pathlib import Path

    from rimuru.sim.cost_model import HARDWARE

    results = Path(__file__).resolve().parents[1] / "benchmarks/results"
    fit = json.loads((results / fit_file).read_text())["fit"]
    hw = HARDWARE[hardware]
    assert hw.name == hardware and hw.compute_plus_memory and fit["compute_plus_memory"]
    assert (hw.flops_efficiency, hw.bandwidth_efficiency, hw.layer_overhead_s) == pytest.approx(
        (fit["flops_efficiency"], fit["bandwidth_efficiency"], fit["layer_overhead_s"]), rel=1e-3)
    # the linear-attention terms (hybrid models): --linear-layers fits over that profile
    linear = json.loads((results / f"2026-12-07-sim-calibration-linear-layers-qwen3.5-35b-{hardware}.json")
                        .read_text())["fit"]
    assert (hw.linear_layer_s, hw.linear_prefill_s) == pytest.approx(
        (linear["linear_layer_s"], linear["linear_prefill_s"]), rel=1e-3)


def test_linear_layer_fit_recovers_the_terms_that_made_the_passes() -> None:
    """A hybrid's passes timed by a profile with known linear-attention terms: the fit over the same profile without
    them gives both back, and every pass's time; passes of one kind alone are refused."""
    from dataclasses import replace

    from rimuru.sim.calibration import StepSample, decode_chunks, fit_linear_layer_terms, mixed_chunks

    base = HardwareConfig(flops_efficiency=0.3, bandwidth_efficiency=1.2, layer_overhead_s=1e-4,
                          compute_plus_memory=True)
    truth = replace(base, linear_layer_s=2e-5, linear_prefill_s=7e-4)
    pop = ExpertPopularity.zipf("tiny", TINY_HYBRID.num_moe_layers, 8, exponent=1.0, seed=0)
    resident = np.ones(pop.probabilities.shape, dtype=bool)
    shapes = [decode_chunks(4, 100), decode_chunks(32, 400), mixed_chunks(300, 8, 200), mixed_chunks(90, 20, 50)]
    samples = [StepSample(TINY_HYBRID, pop.probabilities, c, 1, CostModel(TINY_HYBRID, pop.probabilities, truth).step(
        list(c), 1, resident).time_s) for c in shapes]
    fitted, times = fit_linear_layer_terms(samples, base)
    assert (fitted.linear_layer_s, fitted.linear_prefill_s) == pytest.approx((2e-5, 7e-4), rel=1e-9)
    assert times == pytest.approx([s.measured_s for s in samples], rel=1e-9)
    with pytest.raises(ValueError, match="decode passes and passes with prefill rows"):
        fit_linear_layer_terms(samples[:2], base)


# a hybrid: three gated DeltaNet layers (state 4 x 16 x 16 fp32 = 4 KiB + conv 128 x 3 x 2 B padded to 1 KiB each)
# and one attention layer; expert page 8 KiB as TINY's
TINY_HYBRID = ModelSpec.from_hf_config({
    "model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "max_position_embeddings": 4096,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4})


@pytest.mark.parametrize("mode", ["static", "elastic"])
def test_hybrid_state_pages_are_counted_and_returned(mode: str) -> None:
    pop = ExpertPopularity.zipf("tiny", 4, 8, exponent=1.0, seed=0)
    probe = SimConfig(mode=mode, budget_bytes=1 << 40, max_num_seqs=64, max_num_batched_tokens=512)
    mem = plan_memory(TINY_HYBRID, probe)
    pool_pages = 3 * 4 * 8 + (2 * 3 * 4 if mode == "elastic" else 0) + 24  # experts, buffers, 24 pages of room
    cfg = SimConfig(mode=mode, budget_bytes=mem.non_expert_weights + mem.workspace + pool_pages * PAGE,
                    max_num_seqs=64, max_num_batched_tokens=512, hardware=SLOW_STEPS, adjuster_kind="paper",
                    expert_offload_limit=4)
    sim = Simulation(TINY_HYBRID, pop, cfg)
    assert sim.state is not None and sim.memory["state_bytes_per_request"] == 3 * (4096 + 1024)
    seen: list[float] = []
    sim_core = sim.core

    def watch(s: Simulation) -> None:
        if sim_core is not None:
            seen.append(sim_core.state(StepDemand()).kv_mid_pages)

    reqs = trace(60)
    res = sim.run(reqs, after_step=watch)
    assert res.output_tokens == sum(r.output_len for r in reqs) and not sim.scheduler.has_unfinished()
    peak_state = max(res.timeline["state_bytes"])
    assert peak_state >= 2 * sim.state.request_bytes  # several requests held state at once
    # per step: every byte of the pool in exactly one column
    for kv, ex, st, free in zip(res.timeline["kv_bytes"], res.timeline["expert_bytes"], res.timeline["state_bytes"],
                                res.timeline["free_bytes"], strict=True):
        assert kv + ex + st + free == sim.mem.pool and free >= 0
    pages = res.final_pages
    assert pages["state_pages"] == pages["state_pages_tracked"] == 0 and pages["kv_pages"] == 0
    assert pages["free_bytes"] + pages["used_bytes"] == pages["pool_bytes"]
    if mode == "elastic":
        assert res.evictions > 0  # the requests' state made room short: experts left for it
        # the adjuster's view of what requests hold counts their state pages (mid-page units, by bytes)
        assert max(seen) >= 2 * sim.state.request_bytes / PAGE


def test_direct_access_steps_read_offloaded_experts_without_piecewise_overhead() -> None:
    """The cost model of direct access: the activated offloaded experts' bytes are read in the pass (not hidden behind
    compute), no piecewise overhead; with copies the same bytes may hide behind compute but piecewise graphs cost."""
    from rimuru.sim.cost_model import CostModel

    hw = HardwareConfig(copy_overlap=1.0, piecewise_overhead_per_layer_s=1e-4)
    model = CostModel(TINY, POP.probabilities, hw)
    resident = np.ones((TINY.num_moe_layers, TINY.num_experts), dtype=bool)
    resident[:, -2:] = False
    chunks = [(0, 4)] * 8
    direct = model.step(chunks, 8, resident, direct=True)
    copy = model.step(chunks, 8, resident)
    assert direct.pcie_bytes == copy.pcie_bytes > 0
    assert direct.piecewise_s == 0 and copy.piecewise_s == pytest.approx(1e-4 * TINY.num_moe_layers)
    assert direct.read_s == pytest.approx(direct.pcie_bytes / hw.pcie_bandwidth) and direct.copy_s == 0
    assert direct.time_s == pytest.approx(hw.step_overhead_s + direct.compute_s + direct.read_s)
    all_in = model.step(chunks, 8, np.ones_like(resident), direct=True)
    assert all_in.read_s == 0 and all_in.time_s == pytest.approx(hw.step_overhead_s + all_in.compute_s)


def test_measured_workspace_replaces_the_bound() -> None:
    """A workspace the engine measured sizes the pool as the engine's own split does: budget - weights - workspace,
    in whole huge pages; without one the bound (workspace_bytes) stands."""
    from dataclasses import replace

    cfg = config("static", 64)
    bound = plan_memory(TINY, cfg)
    measured = plan_memory(TINY, replace(cfg, workspace_bytes=bound.workspace // 2))
    assert measured.workspace == bound.workspace // 2
    huge = bound.geometry.huge_size
    assert measured.pool == (cfg.budget_bytes - measured.non_expert_weights - measured.workspace) // huge * huge
    assert measured.pool >= bound.pool


def test_async_scheduling_sees_arrivals_a_pass_later_and_decodes_without_gaps() -> None:
    """Async (the engine's default on a GPU): the pass scheduled while another runs sees only the arrivals up to that
    pass's start, so a request arriving during a pass gets its first token one pass later than with sync scheduling;
    decoding never waits for a token to be read, so a request's TPOT is its passes' time in both."""
    from dataclasses import replace

    steps = HardwareConfig(step_overhead_s=0.01)  # every pass 10 ms (+ nanoseconds of roofline)
    base = replace(config("static", 256), hardware=steps)
    reqs = [SimRequest(16, 40, 0.0), SimRequest(16, 10, 0.015)]  # the second arrives during the second pass
    sync = Simulation(TINY, POP, replace(base, async_scheduling=False)).run(reqs)
    asyn = Simulation(TINY, POP, base).run(reqs)
    assert sync.output_tokens == asyn.output_tokens == 50
    assert sync.ttft_s[0] == pytest.approx(asyn.ttft_s[0], abs=1e-4) == pytest.approx(0.01, abs=1e-4)
    # sync: scheduled when pass 2 ends (20 ms), first token at 30 ms; async: pass 3 was scheduled at 10 ms, so the
    # request runs in pass 4 and its token is read at 40 ms
    assert sync.ttft_s[1] == pytest.approx(0.030 - 0.015, abs=1e-4)
    assert asyn.ttft_s[1] == pytest.approx(0.040 - 0.015, abs=1e-4)
    assert sorted(sync.tpot_s) == pytest.approx([0.01, 0.01], abs=1e-4)
    assert sorted(asyn.tpot_s) == pytest.approx([0.01, 0.01], abs=1e-4)
    assert asyn.forward_steps == sync.forward_steps


def test_multiturn_dataset_gives_the_clients_turns_as_requests() -> None:
    """`--dataset sharegpt-multiturn`: the turn lengths the bench client's multi-turn workload sends (each turn's
    prompt holds the history, so later turns of a conversation are longer), within its 2,048 / 3,072 limits."""
    from rimuru.bench.workload import load_tokenizer, sample_sharegpt_multiturn
    from rimuru.sim.cli import conversations, load_requests, with_arrivals

    pairs = load_requests("sharegpt-multiturn", 60, seed=3)
    turns = sample_sharegpt_multiturn(load_tokenizer(None), 60, 3, max_prompt_len=2048, max_total_len=3072)
    assert pairs == [(t.prompt_len, t.output_len) for t in turns] and len(pairs) == 60
    assert all(p <= 2048 and p + o <= 3072 for p, o in pairs)
    first = {t.conversation: t.prompt_len for t in turns if t.turn == 0}
    second = [(t.conversation, t.prompt_len) for t in turns if t.turn == 1]
    assert second and all(n > first[c] for c, n in second)  # the second turn's prompt holds the first turn
    assert pairs != load_requests("sharegpt", 60, seed=3)
    # the turns of the GPU run at seed 0 (its client JSON: 400 turns, 281,450 prompt tokens, read from the anchor's
    # copy of the same ShareGPT file): the same requests
    assert sum(p for p, _ in load_requests("sharegpt-multiturn", 400, seed=0)) == 281_450
    with pytest.raises(SystemExit, match="sharegpt-multiturn"):
        load_requests("multiturn", 60, seed=3)
    # sent as the client sends them: conversations at the rate, each later turn after the one before it
    convs = conversations("sharegpt-multiturn", 60, seed=3)
    assert sorted(i for c in convs for i in c) == list(range(60)) and all(len(c) >= 1 for c in convs)
    reqs = with_arrivals(pairs, 2.0, 3, convs, think_s=0.5)
    for c in convs:
        assert reqs[c[0]].after is None and reqs[c[0]].think_s == 0.0
        assert [(r.after, r.think_s) for r in (reqs[i] for i in c[1:])] == [(i, 0.5) for i in c[:-1]]
    assert len({reqs[c[0]].arrival_s for c in convs}) == len(convs)


def test_a_conversations_turns_go_one_after_another() -> None:
    """A later turn is sent when the turn it follows has finished, plus its think time; its TTFT counts from then."""
    turns = [SimRequest(20, 10, 0.0)] + [SimRequest(20 + 30 * n, 10, 0.0, after=n - 1, think_s=0.5)
                                         for n in range(1, 4)]
    together = [SimRequest(r.prompt_len, r.output_len, 0.0) for r in turns]
    cfg = config("static", pool_pages=48 + 24)
    chained = Simulation(TINY, POP, cfg).run(turns)
    at_once = Simulation(TINY, POP, cfg).run(together)
    assert chained.output_tokens == at_once.output_tokens == 40 and len(chained.ttft_s) == 4
    assert chained.peak_running == 1 and at_once.peak_running == 4
    # three think times, and each turn's 10 tokens at 10 ms or more a step
    assert chained.sim_time_s >= 3 * 0.5 + 4 * 10 * 0.01 > at_once.sim_time_s
    assert max(chained.ttft_s) < 0.5  # from the turn's own send, not the conversation's start
    assert chained.final_pages["kv_pages"] == 0
    with pytest.raises(ValueError, match="follows request 7"):
        Simulation(TINY, POP, cfg).run([SimRequest(20, 10, 0.0, after=7)])
