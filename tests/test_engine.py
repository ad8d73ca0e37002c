"""The whole engine on tiny random checkpoints of every architecture, against transformers.

Greedy tokens must equal transformers' own greedy decoding, whatever the batching: one request at a
time, all together, prefill cut into small chunks, or a pool so small that requests are preempted
and recomputed. After every run no KV page is left in use.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.testing.reference import hf_greedy, random_prompts, run_greedy
from rimuru.testing.tiny_models import ARCHS

STEPS = 32
PROMPT_LENS = (5, 17, 33)


@pytest.fixture(scope="module")
def checkpoints(parity_checkpoints: dict[str, Path]) -> dict[str, Path]:
    return parity_checkpoints


def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENS)




def run(llm: LLM, ps: list[list[int]], steps: int = STEPS, one_by_one: bool = False) -> list[list[int]]:
    return run_greedy(llm, ps, steps, one_by_one)


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    # generate() stops at EOS when eos_token_id is set in generation_config; ignore_eos on our side needs all
    # STEPS tokens, so compare only as far as transformers went
    return {arch: hf_greedy(path, prompts(), STEPS) for arch, path in checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_batched_and_alone(arch: str, checkpoints, references) -> None:
    llm = LLM(str(checkpoints[arch]), gpu_memory_budget="64MiB", device="cpu")
    ref = references[arch]
    got = run(llm, prompts())
    for g, r in zip(got, ref, strict=True):
        assert len(r) == STEPS and g == r
    assert run(llm, prompts(), one_by_one=True) == got
    # the routing is not degenerate: several distinct tokens
    assert len({t for seq in got for t in seq}) > 3


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe"])
def test_chunked_prefill_and_preemption_keep_greedy_tokens(arch: str, checkpoints, references) -> None:
    ref = references[arch]
    chunked = LLM(str(checkpoints[arch]), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=7)
    assert run(chunked, prompts()) == ref
    # a pool that holds the experts and only 8 KV blocks (3 requests need up to 5 each): requests must be
    # preempted and recomputed. One huge page of slack: the pool is rounded down to whole huge pages.
    probe = LLM(str(checkpoints[arch]), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=16)
    split, geo = probe.engine.budget_split, probe.engine.geometry
    per_block = probe.engine.kv.num_layers * geo.size("kv")
    budget = (split["non_expert_weights"] + split["workspace"] + split["experts_resident"] + 8 * per_block
              + geo.huge_size)
    small = LLM(str(checkpoints[arch]), gpu_memory_budget=budget, device="cpu", max_num_batched_tokens=16)
    assert small.engine.kv.capacity_pages() // small.engine.kv.num_layers in (8, 9)
    assert run(small, prompts()) == ref
    assert small.stats()["preemptions"] > 0


def test_sampling_seeds_stops_and_lengths(checkpoints) -> None:
    llm = LLM(str(checkpoints["qwen3_moe"]), gpu_memory_budget="64MiB", device="cpu")
    p = {"prompt_token_ids": prompts()[1]}
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = llm.generate(p, seeded)[0].outputs[0].token_ids
    # the same seeded request next to other (unseeded, sampled) requests draws the same tokens
    crowd = llm.generate([p, {"prompt_token_ids": prompts()[0]}, p],
                         [seeded, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True),
                          SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True)])
    assert crowd[0].outputs[0].token_ids == alone
    assert crowd[2].outputs[0].token_ids != alone
    # n=2 gives two samples with seeds 7 and 8
    two = llm.generate(p, SamplingParams(n=2, max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7,
                                         ignore_eos=True))[0]
    assert [o.index for o in two.outputs] == [0, 1] and two.outputs[0].token_ids == alone
    greedy = llm.generate(p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 20
    # a stop token id ends the request at its first occurrence, the token included
    stop_tok = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_tok)
    out = llm.generate(p, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_tok],
                                         ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    # a stop string cuts the text before it
    text = greedy.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if stop.strip() and "\ufffd" not in stop:
        out = llm.generate(p, SamplingParams(max_tokens=20, temperature=0.0, stop=[stop], ignore_eos=True))[0]
        comp = out.outputs[0]
        assert comp.finish_reason == "stop" and comp.stop_reason == stop
        assert comp.text == text[: text.index(stop)]
    assert llm.stats()["kv_pages_used"] == 0


def test_text_prompts_and_bad_input(checkpoints) -> None:
    llm = LLM(str(checkpoints["mixtral"]), gpu_memory_budget="64MiB", device="cpu", max_model_len=64)
    out = llm.generate("Hello world! <|im_end|>", SamplingParams(max_tokens=4, temperature=0.0))[0]
    # the special-token string typed by a user is text, not the control token (id 2)
    assert 2 not in out.prompt_token_ids and len(out.prompt_token_ids) > 3
    for bad, msg in [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [5] * 64}, "max_model_len"),
        ({"prompt_token_ids": [5, 100000]}, "token ids"),
        ("", "empty"),
    ]:
        with pytest.raises(ValueError, match=msg):
            llm.generate(bad, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=60))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert llm.stats()["kv_pages_used"] == 0 and llm.stats()["running"] == 0


def test_static_mode_refuses_a_budget_without_room_for_experts(checkpoints) -> None:
    llm = LLM(str(checkpoints["qwen2_moe"]), gpu_memory_budget="64MiB", device="cpu")
    split = llm.engine.budget_split
    budget = split["non_expert_weights"] + split["workspace"] + split["experts_resident"] // 2
    with pytest.raises(ValueError, match="offload_mode='fixed' or 'elastic'"):
        LLM(str(checkpoints["qwen2_moe"]), gpu_memory_budget=budget, device="cpu", offload_mode="static")
    # asking for nothing: elastic when the experts don't all fit with room for KV cache, static when they do
    page = llm.engine.geometry.size("expert")
    tight = split["non_expert_weights"] + split["workspace"] + split["experts_resident"] + 2 * page
    assert LLM(str(checkpoints["qwen2_moe"]), gpu_memory_budget=tight, device="cpu",
               expert_offload_limit=2).stats()["offload_mode"] == "elastic"
    assert llm.stats()["offload_mode"] == "static"


def test_dummy_routing_realises_the_promised_shares(tiny_checkpoint) -> None:
    """`dummy_routing="zipf:S"`: the experts of every layer are picked with the power law's shares (ranks permuted
    per layer), measured on the engine's own routing of random prompts. A router that adds the log shares to the
    random logits gives the popular experts far more than promised: it would fail the tolerance below."""
    import numpy as np

    from rimuru.bench.profile_experts import count_routing
    from rimuru.experts.popularity import ExpertPopularity

    path = str(tiny_checkpoint("olmoe", num_experts=32))
    llm = LLM(path, load_format="dummy", device="cpu", gpu_memory_budget="64MiB", dummy_routing="zipf:1.0",
              enforce_eager=True, seed=5)
    zipf = ExpertPopularity.zipf(path, 2, 32, 1.0, seed=5).probabilities  # [L, E], what the flag promises
    moes = [m for m in llm.engine.model.modules() if hasattr(m, "router_bias")]
    for m in moes:  # the Gumbel transform's scale: each gate row's norm (RMS-1 inputs)
        torch.testing.assert_close(m.router_noise_scale, m.gate.weight.float().norm(dim=1))
    g = torch.Generator().manual_seed(0)
    reqs = [type("R", (), {"prompt_token_ids": torch.randint(3, 300, (64,), generator=g).tolist(),
                           "output_len": 2})() for _ in range(16)]
    counts = count_routing(llm, reqs).astype(float)  # [L, E]
    realised = counts / counts.sum(axis=1, keepdims=True)
    order = np.argsort(-zipf, axis=1)
    for quarter in range(4):  # 8 experts each, most popular first: 67 %, 15 %, 10 %, 8 % promised
        ids = order[:, 8 * quarter: 8 * (quarter + 1)]
        want = np.take_along_axis(zipf, ids, axis=1).sum(axis=1)
        got = np.take_along_axis(realised, ids, axis=1).sum(axis=1)
        np.testing.assert_allclose(got, want, atol=0.06, err_msg=f"quarter {quarter}")  # log-share router: 0.33 off
    with pytest.raises(ValueError, match="zipf:S"):
        LLM(path, load_format="dummy", device="cpu", dummy_routing="pareto")
    with pytest.raises(ValueError, match="random weights only"):
        LLM(path, dummy_routing="zipf:1.0", load_format="safetensors", device="cpu")


def test_simulated_workspace_bound_covers_every_measured_h200_peak() -> None:
    # benchmarks/probe_workspace.py measured, on the H200, what a served engine really uses beyond its weights and
    # pool (torch's peak reserved + memory outside its allocator). The bound the simulator reserves for the H200,
    # computed for each probe's settings, must cover it, or the simulated pool is larger than the engine's (each
    # probe also records the bound its own code reserved: benchmarks/results/2026-11-30-probe-workspace-elastic-
    # 2048tok-f3ae023-h200.json measured 1,492 MB against 1,344 MB reserved at --max-num-batched-tokens 2048).
    import json

    from rimuru.config import EngineConfig
    from rimuru.engine.setup import workspace_bytes
    from rimuru.model_spec import load_model_spec
    from rimuru.sim.cost_model import H200_WORKSPACE_SCRATCH

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    probes = sorted(results.glob("*probe-workspace*-h200.json"))
    assert len(probes) >= 2
    for path in probes:
        probe = json.loads(path.read_text())
        cfg = EngineConfig(model=probe["model"], max_num_seqs=probe["max_num_seqs"],
                           max_num_batched_tokens=probe["max_num_batched_tokens"],
                           max_cudagraph_capture_size=probe.get("max_cudagraph_capture_size"))
        bound = workspace_bytes(load_model_spec(probe["model"]), cfg, torch.bfloat16, H200_WORKSPACE_SCRATCH)
        assert probe["measured_workspace"] <= bound, (path.name, probe["measured_workspace"], bound)
        # the start-up peak too, for probes of the engine that warms every graph size up before the first capture
        # (engine/cuda_graphs.py; without those warm-ups elastic mode's start-up peak is the full graph pool plus an
        # eager pass, ~160 MB above this bound). Only such probes record `max_cudagraph_capture_size` (the probe
        # took the flag with the warm-ups, commit acc2a51): its presence marks them.
        if "max_cudagraph_capture_size" in probe:
            start = probe["start_peak_reserved_beyond_held"] + max(0, probe["outside_torch_allocator"])
            assert start <= bound, (path.name, "start-up", start, bound)


def test_a_start_the_settings_make_impossible_is_refused_with_its_reason(checkpoints, capsys) -> None:
    """Longer than the model's trained positions (512 here) is refused, as vLLM does; from the command line such a
    refusal, like a budget below the weights, ends the command with its message and no traceback."""
    from rimuru.cli import main

    path = str(checkpoints["mixtral"])
    with pytest.raises(ValueError, match="max_model_len=1000 is longer than the model's max_position_embeddings=512"):
        LLM(path, gpu_memory_budget="64MiB", device="cpu", max_model_len=1000)
    for flags, reason in ((["--max-model-len", "1000"], "max_position_embeddings=512"),
                          (["--gpu-memory-budget", "1MiB"], "is too small")):
        with pytest.raises(SystemExit) as stop:
            main(["generate", path, "--device", "cpu", "--prompt", "hi", *flags])
        assert stop.value.code == 2  # a user's mistake: argparse's exit status
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert reason in last and last.startswith("error: ") and "Traceback" not in err


def test_gpu_memory_utilization_is_vllms_budget_flag(checkpoints) -> None:
    """vLLM's --gpu-memory-utilization gives the budget as a share of the GPU's memory: in (0, 1], not beside
    gpu_memory_budget, and refused on the CPU (a share of no GPU), each with its reason."""
    from rimuru.config import EngineConfig

    assert EngineConfig(model="m", gpu_memory_utilization=0.229).gpu_memory_utilization == 0.229
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
            EngineConfig(model="m", gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(model="m", gpu_memory_utilization=0.5, gpu_memory_budget="1GiB")
    with pytest.raises(ValueError, match="give gpu_memory_budget"):
        LLM(str(checkpoints["mixtral"]), device="cpu", gpu_memory_utilization=0.5)


def test_page_pool_memory_bytes_sizes_the_pool_instead_of_the_budget(checkpoints) -> None:
    """vLLM's --kv-cache-memory-bytes, for the unified pool: the pool is exactly the bytes given (whole huge pages),
    the budget is what the weights, the workspace and that pool add up to; not beside a budget, and a pool below
    one huge page is refused with its size."""
    from rimuru.config import EngineConfig

    path = str(checkpoints["mixtral"])
    llm = LLM(path, device="cpu", page_pool_memory_bytes="24MiB")
    split, huge = llm.engine.budget_split, llm.engine.geometry.huge_size
    assert split["pool"] == 24 * 2**20 // huge * huge
    assert split["budget"] == split["non_expert_weights"] + split["workspace"] + 24 * 2**20
    assert llm.generate(["hello"], SamplingParams(max_tokens=3))[0].outputs[0].token_ids
    llm.shutdown()
    for other in ({"gpu_memory_budget": "1GiB"}, {"gpu_memory_utilization": 0.5}):
        with pytest.raises(ValueError, match="not both"):
            EngineConfig(model="m", page_pool_memory_bytes="1GiB", **other)
    with pytest.raises(ValueError, match="smaller than one huge page"):
        LLM(path, device="cpu", page_pool_memory_bytes=huge - 1)
