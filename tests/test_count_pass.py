"""benchmarks/count_pass.py on a tiny Qwen2-MoE model, on the CPU: it finds a decode step of B sequences, counts it by
region (the MoE block's router, routed experts and shared expert apart), and times the host with the kernels stubbed;
its CUDA timings run on the GPU only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from benchmarks.count_pass import capture_decode, count_pass, forward, host_ms, profile_top, shrunk_config
from rimuru import LLM

pytest.importorskip("transformers")


def test_the_preset_shrinks_its_widths_only() -> None:
    cfg = shrunk_config("qwen1.5-moe-a2.7b", 16, 4096)
    assert (cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]) == (128, 88, 352)
    assert (cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]) == (24, 60, 4)


def test_counts_and_times_a_tiny_decode_pass(tiny_checkpoint: Callable[..., Path]) -> None:
    ckpt = tiny_checkpoint("qwen2_moe", seed=3)
    llm = LLM(str(ckpt), device="cpu", gpu_memory_budget="64MiB", max_num_seqs=4, max_num_batched_tokens=64,
              async_scheduling=False, enable_prefix_caching=False)
    engine = llm.engine
    model, runner = engine.model, engine.runner
    sched, h = capture_decode(llm, 3, prompt_len=5)
    assert len(sched.scheduled) == 3
    batch = runner.device_batch(h)
    with torch.inference_mode():
        want = forward(model, batch)
    regions = count_pass(model, lambda: forward(model, batch), emulate_fla=False)
    layers, moe_layers = engine.spec.num_hidden_layers, engine.spec.num_moe_layers
    assert regions["attention"].entries == layers and regions["moe_router"].entries == moe_layers
    assert regions["moe_experts"].kernel_calls == moe_layers  # one fused MoE per layer
    assert regions["moe_shared"].launches > 0 and regions["norm"].entries == 2 * layers + 1
    assert sum(c.syncs for c in regions.values()) == 0
    assert host_ms(lambda: forward(model, batch), reps=2)["median"] > 0
    top, table = profile_top(lambda: forward(model, batch), reps=1, top=5)
    assert len(top) == 5 and "own ms" in table
    with torch.inference_mode():  # the stubs are gone again: the same logits as before
        assert torch.equal(forward(model, batch), want)
    llm.shutdown()
