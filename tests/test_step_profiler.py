"""The step profiler and the lean step loop, on the CPU.

* The profiler's host phases are all present and sum to the step's wall time, which is the engine's own
  `step_time_s`; step kinds are classified; kernels are reported unavailable on the CPU; profiling stops
  after N steps and changes no token (greedy and seeded sampling).
* The vectorised batch arrays equal a plain per-request reference (chunked prefill, decodes, padding);
  the packed input copy and the packed sampler parameters change nothing.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.engine.model_runner import InputStager, ModelRunner
from rimuru.engine.request import Request
from rimuru.engine.sampler import Sampler
from rimuru.engine.scheduler import ScheduledRequest, SchedulerOutput
from rimuru.engine.step_profiler import (
    KERNELS_UNAVAILABLE,
    PHASES,
    StepProfiler,
    StepRecord,
    count_kernels,
    format_table,
    gpu_gaps,
)

BUDGET = "64MiB"


def _prompts(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 290, (int(k),), generator=g).tolist()}
            for k in torch.randint(4, 40, (n,), generator=g)]


def _params() -> list[SamplingParams]:
    # greedy, seeded sampling with top-k/top-p, plain seeded sampling: every sampler path
    return [SamplingParams(max_tokens=10 + i % 5, temperature=0.0, ignore_eos=True) if i % 3 == 0 else
            SamplingParams(max_tokens=10 + i % 5, temperature=0.8, top_k=20, top_p=0.9, seed=i, ignore_eos=True)
            if i % 3 == 1 else SamplingParams(max_tokens=10 + i % 5, temperature=1.0, seed=i, ignore_eos=True)
            for i in range(9)]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(9), _params())]


def test_profile_phases_sum_to_step_time_and_tokens_do_not_change(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("qwen2_moe", seed=3))
    plain = _tokens(LLM(path, device="cpu", gpu_memory_budget=BUDGET, max_num_batched_tokens=64))
    llm = LLM(path, device="cpu", gpu_memory_budget=BUDGET, max_num_batched_tokens=64)
    engine = llm.engine
    prof = engine.enable_step_profiler(12)
    assert engine.trace is prof
    engine.step_metrics.clear()
    assert _tokens(llm) == plain
    assert len(prof.records) == 12 and not prof.active
    steps = list(engine.step_metrics.steps)[:12]
    for rec, m in zip(prof.records, steps, strict=True):
        assert set(rec.host_s) == set(PHASES)
        assert all(v >= 0.0 for v in rec.host_s.values())
        assert rec.wall_s == pytest.approx(sum(rec.host_s.values()), rel=1e-9, abs=1e-12)
        assert rec.wall_s == pytest.approx(m.step_time_s, rel=1e-6, abs=1e-9)  # the engine's own clock readings
        assert rec.num_tokens == m.num_tokens
        assert rec.gpu_forward_s is None and rec.expert_wait_s is None and not rec.traced
        assert rec.gpu_gap_s is None and rec.starved is None  # events only on a GPU
    rep = prof.report()
    assert rep["steps_profiled"] == 12 and len(rep["steps"]) == 12
    # 64-token budget: the 9 prompts (4..39 tokens) take several prefill-only steps, then prefill + decode,
    # then decodes only
    kinds = [r.kind for r in prof.records]
    assert kinds[0] == "prefill" and "mixed" in kinds and kinds[-1] == "decode-eager"
    assert set(rep["kinds"]) == set(kinds)
    for s in rep["kinds"].values():
        assert s["kernels"] == KERNELS_UNAVAILABLE and s["gpu_forward_ms"] is None
        assert s["wall_ms"] == pytest.approx(sum(s["host_ms"].values()), rel=1e-3, abs=1e-3)
    assert rep["all"]["steps"] == 12
    assert rep["host_ms_total"] == pytest.approx(sum(r.wall_s for r in prof.records) * 1e3, abs=1e-2)
    # static mode: every step all-resident, so every decode group is a resident one and they cover the decodes
    assert all(r.offloaded == 0 and r.stalled == 0 for r in prof.records)
    groups = rep["decode_by_batch"]
    assert groups and not any(g["offloaded"] for g in groups)
    assert sum(g["steps"] for g in groups) == kinds.count("decode-eager")
    # the context: every scheduled sequence's tokens so far, this step's included: the first chunks start at 0,
    # and a decode step of the same requests as the one before reads one token more of each
    assert prof.records[0].context_tokens == prof.records[0].num_tokens
    pairs = [(a, b) for a, b in zip(prof.records, prof.records[1:], strict=False)
             if a.kind == b.kind == "decode-eager"
             and a.num_seqs == b.num_seqs]
    assert pairs and all(b.context_tokens - a.context_tokens == b.num_seqs for a, b in pairs)
    decode = rep["kinds"]["decode-eager"]
    assert decode["tokens_mean"] == decode["seqs_mean"]  # one token per request
    assert decode["host_ms"]["forward"] > 0 and decode["host_ms"]["readback"] > 0
    table = format_table(rep)
    assert table.splitlines()[0].split()[:3] == ["kind", "steps", "tok"] and "decode-eager" in table
    # after the profiled steps the engine runs unprofiled: same tokens again
    assert _tokens(llm) == plain and len(prof.records) == 12


def test_expert_wait_is_measured_for_offloading_providers(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("qwen2_moe", seed=3))
    ps = _prompts(4, seed=1)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(path, device="cpu", gpu_memory_budget=BUDGET).generate(ps, params)]
    llm = LLM(path, device="cpu", gpu_memory_budget=BUDGET, offload_mode="fixed", offload_access="copy",
              resident_experts=4)
    provider = llm.engine.runtime.provider
    prof = llm.engine.enable_step_profiler(5)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
    assert got == plain
    assert "table" not in vars(provider)  # measured by the provider itself: nothing was wrapped
    waits = [r.expert_wait_s for r in prof.records]
    assert len(waits) == 5 and all(w is not None and w > 0 for w in waits)
    assert all(r.expert_wait_s <= r.host_s["forward"] for r in prof.records)  # inside the forward pass
    rep = prof.report()
    assert rep["all"]["expert_wait_ms"] > 0
    # 4 of each layer's experts resident: the rest are out in every step, and the decode groups say so
    out = llm.engine.runtime.cache.num_offloaded
    assert out > 0 and all(r.offloaded == out for r in prof.records)
    decodes = [r for r in prof.records if r.kind == "decode-eager"]
    groups = rep["decode_by_batch"]
    assert [g["offloaded"] for g in groups] == [True] * len(groups) and groups
    assert sum(g["steps"] for g in groups) == len(decodes)
    assert all(g["offloaded_mean"] == out and g["seqs_from"] <= g["seqs_mean"] <= g["seqs_to"] for g in groups)


def test_profiler_rejects_zero_steps_and_counts_trace_events() -> None:
    with pytest.raises(ValueError, match="at least one step"):
        StepProfiler(0, torch.device("cpu"), step_kind=lambda sched: "idle")
    ev = [SimpleNamespace(name=n, device_type=d) for n, d in [
        ("void fused_moe_kernel", "DeviceType.CUDA"), ("Memcpy HtoD (Pinned -> Device)", "DeviceType.CUDA"),
        ("cudaLaunchKernel", "DeviceType.CPU"), ("cuLaunchKernelEx", "DeviceType.CPU"),
        ("cudaGraphLaunch", "DeviceType.CPU"), ("cudaMemcpyAsync", "DeviceType.CPU"), ("aten::mm", "DeviceType.CPU"),
        ("triton_rms_norm", "DeviceType.CUDA")]]
    assert count_kernels(ev) == {"gpu_kernels": 2, "gpu_memcpy": 1, "host_kernel_launches": 2, "graph_launches": 1,
                                 "host_memcpy_calls": 1}


def _gap_record(kind: str, seqs: int, gap_ms: float | None, starved: bool | None, offloaded: int = 0,
                after_trace: bool = False, **host_ms: float) -> StepRecord:
    r = StepRecord(kind=kind, num_tokens=seqs, num_seqs=seqs, offloaded=offloaded, starved=starved,
                   gpu_gap_s=None if gap_ms is None else gap_ms / 1e3, gpu_forward_s=0.008, after_trace=after_trace)
    for phase, ms in host_ms.items():
        r.host_s[phase] = ms / 1e3
    return r


def test_gpu_gaps_group_decode_steps_and_charge_the_chain_before_each_launch() -> None:
    recs = [
        _gap_record("decode-graph", 8, None, None, process=0.1, finish=0.2),  # first: no gap measured
        _gap_record("decode-graph", 8, 2.0, True, offloaded=3, schedule=0.5, adjust=3.0, process=0.4, finish=1.0),
        _gap_record("decode-graph", 8, 4.0, True, offloaded=5, adjust=1.0, prepare=2.0),
        _gap_record("decode-graph", 10, 0.5, False, schedule=0.1),
        _gap_record("mixed-graph", 10, 9.0, True),  # not a decode step
        _gap_record("decode-graph", 10, 7.0, True, after_trace=True),  # right after a traced (synchronised) step
    ]
    out = gpu_gaps(recs)
    assert set(out) == {"starved-offloaded", "fed-resident"}
    so = out["starved-offloaded"]
    assert so["steps"] == 2 and so["gpu_gap_ms"] == pytest.approx(3.0)
    # each step's chain: the previous step's phases after its launch, then its own schedule and prepare
    assert so["chain_ms"] == pytest.approx({"prev_adjust": 1.5, "prev_compact": 0.0, "prev_readback": 0.0,
                                            "prev_process": 0.25, "prev_finish": 0.6, "schedule": 0.25,
                                            "prepare": 1.0})
    assert so["chain_total_ms"] == pytest.approx(3.6)
    fed = out["fed-resident"]
    assert fed["steps"] == 1 and fed["gpu_gap_ms"] == pytest.approx(0.5) and fed["chain_ms"]["schedule"] == 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_gaps_are_measured_between_consecutive_passes(tiny_checkpoint) -> None:
    llm = LLM(str(tiny_checkpoint("qwen2_moe", seed=3)), device="cuda", gpu_memory_budget="1GiB",
              max_num_batched_tokens=64)
    prof = llm.engine.enable_step_profiler(40, trace_steps=0)
    _tokens(llm)
    rep = prof.report()
    passes = [r for r in prof.records if r.gpu_forward_s is not None]
    assert len(passes) >= 10
    for prev, r in zip(prof.records, prof.records[1:], strict=False):
        if r.gpu_forward_s is not None and prev.gpu_forward_s is not None:
            # the previous pass's end comes before this pass's begin on the one compute stream
            assert r.gpu_gap_s is not None and r.gpu_gap_s >= 0.0 and r.starved is not None
    gaps = rep["gpu_gaps"]
    decodes = [r for r in prof.records[1:] if r.kind.startswith("decode") and r.gpu_gap_s is not None]
    assert decodes and sum(g["steps"] for g in gaps.values()) == len(decodes)
    assert all(g["gpu_gap_ms"] >= 0.0 for g in gaps.values())


# ---------------------------------------------------------------- batch arrays


def _reference_arrays(sched: SchedulerOutput, L: int, bs: int) -> dict[str, np.ndarray]:
    """The per-request loop the runner used before it was vectorised."""
    B, T = len(sched.scheduled), sum(s.num_new_tokens for s in sched.scheduled)
    out = {"input_ids": np.empty(T, np.int64), "positions": np.empty(T, np.int64),
           "query_start_loc": np.zeros(B + 1, np.int32), "seq_lens": np.empty(B, np.int32),
           "block_tables": np.zeros((L, B, max(len(s.request.kv_pages) for s in sched.scheduled)), np.int32),
           "slot_mapping": np.empty((L, T), np.int64),
           "logits_indices": np.empty(sum(s.samples for s in sched.scheduled), np.int64)}
    t = j = 0
    for b, s in enumerate(sched.scheduled):
        req, n = s.request, s.num_new_tokens
        out["input_ids"][t : t + n] = req.all_token_ids[s.start : s.start + n]
        pos = np.arange(s.start, s.start + n)
        out["positions"][t : t + n] = pos
        pages = np.asarray(req.kv_pages, dtype=np.int64)
        out["block_tables"][:, b, : len(pages)] = pages.T
        out["slot_mapping"][:, t : t + n] = (pages[pos // bs] * bs + (pos % bs)[:, None]).T
        out["seq_lens"][b] = s.start + n
        t += n
        out["query_start_loc"][b + 1] = t
        if s.samples:
            out["logits_indices"][j] = t - 1
            j += 1
    return out


def _request(i: int, prompt: int, outputs: int, blocks: int, L: int, rng: np.random.Generator) -> Request:
    r = Request(request_id=f"r{i}", seq_id=i, prompt=None, prompt_token_ids=rng.integers(0, 300, prompt).tolist(),
                params=SamplingParams(), max_tokens=100, eos_token_id=None)
    r.output_token_ids = rng.integers(0, 300, outputs).tolist()
    r.kv_pages = rng.integers(0, 5000, (blocks, L)).tolist()
    return r


def test_host_arrays_equal_the_per_request_reference_and_follow_page_growth() -> None:
    L, bs = 3, 4
    rng = np.random.default_rng(0)
    runner = ModelRunner(torch.nn.Identity(), torch.device("cpu"), L, bs, Sampler(torch.device("cpu"), 0))
    reqs = [_request(i, p, o, -(-(p + o + 1) // bs), L, rng) for i, (p, o) in
            enumerate([(5, 0), (9, 3), (17, 0), (3, 8), (12, 0)])]
    sched = SchedulerOutput(scheduled=[
        ScheduledRequest(reqs[0], 0, 5),  # whole prompt
        ScheduledRequest(reqs[1], 11, 1),  # decode
        ScheduledRequest(reqs[2], 4, 7),  # middle prefill chunk: no sample
        ScheduledRequest(reqs[3], 0, 11),  # recompute after preemption: prompt + outputs
        ScheduledRequest(reqs[4], 8, 4),  # last prefill chunk
    ])
    assert [s.samples for s in sched.scheduled] == [True, True, False, True, True]
    for _ in range(2):  # the second pass reads the cached page arrays
        h = runner.host_arrays(sched)
        ref = _reference_arrays(sched, L, bs)
        for name, want in ref.items():
            got = getattr(h, name)
            assert got.dtype == want.dtype and np.array_equal(got, want), name
        assert h.max_query_len == 11
    # a request's pages grow in place (a new block) and are replaced when freed and reallocated
    reqs[1].output_token_ids.append(7)
    reqs[1].kv_pages.append([4242, 4243, 4244])
    reqs[3].kv_pages = rng.integers(0, 5000, (len(reqs[3].kv_pages), L)).tolist()
    sched2 = SchedulerOutput(scheduled=[ScheduledRequest(reqs[1], 12, 1), ScheduledRequest(reqs[3], 0, 11)])
    h = runner.host_arrays(sched2)
    for name, want in _reference_arrays(sched2, L, bs).items():
        assert np.array_equal(getattr(h, name), want), name
    assert set(runner._pages) == {reqs[1], reqs[3]}  # requests not scheduled are dropped from the cache


def test_host_arrays_pad_decode_rows_for_graphs() -> None:
    L, bs = 2, 4
    rng = np.random.default_rng(1)
    runner = ModelRunner(torch.nn.Identity(), torch.device("cpu"), L, bs, Sampler(torch.device("cpu"), 0))
    reqs = [_request(i, 6, 2 + i, 3, L, rng) for i in range(3)]
    sched = SchedulerOutput(scheduled=[ScheduledRequest(r, r.num_tokens - 1, 1) for r in reqs])
    h = runner.host_arrays(sched, pad_to=4)
    ref = _reference_arrays(sched, L, bs)
    assert np.array_equal(h.input_ids, np.append(ref["input_ids"], 0))
    assert np.array_equal(h.positions, np.append(ref["positions"], 0))
    assert np.array_equal(h.seq_lens, np.append(ref["seq_lens"], 1))
    assert np.array_equal(h.block_tables[:, :3], ref["block_tables"]) and not h.block_tables[:, 3].any()
    assert np.array_equal(h.slot_mapping[:, :3], ref["slot_mapping"]) and (h.slot_mapping[:, 3] == -1).all()
    assert np.array_equal(h.logits_indices, [0, 1, 2]) and np.array_equal(h.query_start_loc, [0, 1, 2, 3, 4])


def test_input_stager_packs_one_copy() -> None:
    stager = InputStager(torch.device("cpu"))
    arrays = [np.arange(5, dtype=np.int64), np.arange(3, dtype=np.int32) - 7,
              np.arange(24, dtype=np.int32).reshape(2, 3, 4), np.empty(0, dtype=np.int64),
              np.full((2, 5), -1, dtype=np.int64)]
    for _ in range(3):  # both host buffers, then the first again
        out = stager.stage(arrays)
        for a, t in zip(arrays, out, strict=True):
            assert t.dtype == torch.from_numpy(a).dtype and t.shape == a.shape
            assert np.array_equal(t.numpy(), a)
        assert out[0].untyped_storage().data_ptr() == out[4].untyped_storage().data_ptr()  # one buffer


def test_sampler_greedy_rows_and_packed_parameters() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    sampler = Sampler(torch.device("cpu"), seed=1)
    greedy = SamplingParams(temperature=0.0)
    assert torch.equal(sampler(logits, [greedy] * 5, [None] * 5), logits.argmax(-1))
    params = [greedy, SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.7, top_p=1e-6),
              SamplingParams(temperature=1.3), greedy]
    tokens = sampler(logits, params, [None] * 5)
    want = logits.argmax(-1)
    assert tokens.dtype == torch.int64 and tokens.shape == (5,)
    # greedy rows, top-k=1 and a tiny top-p all give the argmax; row 3 is a draw within the vocabulary
    assert torch.equal(tokens[[0, 1, 2, 4]], want[[0, 1, 2, 4]]) and 0 <= int(tokens[3]) < 50
