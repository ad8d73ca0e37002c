"""The workspace measured before the pool: its arithmetic, the CPU bound, and on the GPU that serving the worst step
stays inside what the profile measured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.engine.piecewise_graphs import ExpertTableBoundaries
from rimuru.engine.setup import CPU_WORKSPACE_SCRATCH, workspace_bytes
from rimuru.engine.workspace_profile import WorkspaceProfile
from rimuru.testing.tiny_models import make_tiny_checkpoint

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_workspace_adds_what_is_held_at_once() -> None:
    eager = WorkspaceProfile(mode="static", forward=100, outside=7, graphs=0, sampling=0,
                             eager_steps_beside_graphs=False)
    assert eager.workspace == 107  # every step eager: the largest pass and what it loaded outside torch
    graphs = WorkspaceProfile(mode="elastic", forward=100, outside=7, graphs=50, sampling=9,
                              eager_steps_beside_graphs=False)
    assert graphs.workspace == 66  # the activations live in the graphs' pool; the sampler runs beside it
    capped = WorkspaceProfile(mode="elastic", forward=100, outside=7, graphs=50, sampling=9,
                              eager_steps_beside_graphs=True)
    assert capped.workspace == 166  # steps above the capture cap run eagerly beside the graphs' pool
    # nothing else: the penalties' counts live in the sampler chunk's working set (tests/test_penalties.py); the
    # kernel warm-up's report is no memory term (its kernel images are in `outside`)
    assert set(WorkspaceProfile.__dataclass_fields__) == {"mode", "forward", "outside", "graphs", "sampling",
                                                          "eager_steps_beside_graphs", "warmup"}


def test_cpu_engine_reserves_the_bound_and_measures_nothing(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "m", seed=1)
    llm = LLM(str(path), device="cpu", gpu_memory_budget="256MiB", max_num_batched_tokens=48)
    engine = llm.engine
    assert engine.workspace_profile is None
    assert engine.budget_split["workspace"] == workspace_bytes(engine.spec, engine.config, torch.float32,
                                                              CPU_WORKSPACE_SCRATCH)


def test_capture_only_boundaries_refuse_to_replay(tmp_path: Path) -> None:
    bounds = ExpertTableBoundaries(None, torch.nn.Module(), torch.zeros(2, 4), torch.zeros(3, 8, 3, dtype=torch.int32))
    assert bounds.num_layers == 3 and bounds.predictor is None
    with pytest.raises(RuntimeError, match="memory profile"):
        bounds.all_resident()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode,eager", [("static", False), ("elastic", False), ("static", True)])
def test_serving_the_worst_step_stays_inside_the_measured_workspace(tmp_path: Path, mode: str, eager: bool) -> None:
    import gc

    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "m", seed=1)
    gc.collect()  # engines of earlier tests
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    T, S = 512, 32
    llm = LLM(str(path), gpu_memory_budget="1GiB", offload_mode=mode, max_num_seqs=S, max_num_batched_tokens=T,
              enforce_eager=eager, dtype="bfloat16")
    engine = llm.engine
    profile = engine.workspace_profile
    assert profile is not None and profile.mode == mode and profile.forward > 0
    assert (profile.graphs > 0) == (not eager)
    split = engine.budget_split
    assert split["workspace"] == profile.workspace
    held = base + split["non_expert_weights"] + split["pool"]
    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    vocab = engine.spec.vocab_size
    long_prompt = torch.randint(3, vocab - 3, (min(T, engine.max_model_len) - 2,), generator=g).tolist()
    llm.generate([{"prompt_token_ids": long_prompt}], SamplingParams(max_tokens=2, ignore_eos=True, temperature=1.0))
    short = [{"prompt_token_ids": torch.randint(3, vocab - 3, (8,), generator=g).tolist()} for _ in range(S)]
    llm.generate(short, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, top_k=5, top_p=0.9))
    # penalised rows, greedy and sampled, with whole-vocabulary histories: their counts are built inside the room
    # the sampler's chunk was measured with
    width = min(vocab - 6, engine.max_model_len - 8)
    wide = [{"prompt_token_ids": (3 + torch.randperm(vocab - 6, generator=g)[:width]).tolist()} for _ in range(S)]
    penalised = dict(max_tokens=4, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.5,
                     presence_penalty=0.5)
    llm.generate(wide, [SamplingParams(temperature=0.0, **penalised) if i % 2 else
                        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, **penalised) for i in range(S)])
    peak = torch.cuda.max_memory_reserved() - held
    assert peak <= split["workspace"], (mode, eager, peak, profile)
