"""benchmarks/count_hybrid_pass.py on the tiny hybrid model, on the CPU: it finds the mixed and the decode step, counts
them by layer kind, and replays a step as the engine's graphs would (stand-ins that run the graphs' static batch
eagerly); its CUDA timings run on the GPU only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_hybrid_graphs import replay_through_static_buffers

from benchmarks.count_hybrid_pass import capture_passes, count_pass, forward, graph_runs, shrunk_config
from rimuru import LLM

pytest.importorskip("transformers")


def test_the_preset_shrinks_its_widths_only() -> None:
    cfg = shrunk_config("qwen3.5-35b-a3b", 16, 4096)["text_config"]
    assert (cfg["hidden_size"], cfg["linear_key_head_dim"], cfg["moe_intermediate_size"]) == (128, 16, 32)
    assert (cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]) == (40, 256, 8)
    assert cfg["vocab_size"] == 4096 and len(cfg["layer_types"]) == 40


def test_counts_a_tiny_hybrids_mixed_and_decode_passes(tiny_checkpoint: Callable[..., Path]) -> None:
    ckpt = tiny_checkpoint("qwen3_5_moe_text", seed=3)
    llm = LLM(str(ckpt), device="cpu", gpu_memory_budget="64MiB", max_num_seqs=8, max_num_batched_tokens=3 + 12,
              async_scheduling=False, enable_prefix_caching=False)
    engine = llm.engine
    model, runner = engine.model, engine.runner
    assert model.state_cache is not None
    model.state_cache.in_place_decode = True
    passes = capture_passes(llm, decodes=3, chunk=12, prompt_len=4)
    assert sorted(passes) == ["decode", "mixed"]
    n_lin = len(engine.spec.linear_layer_ids)
    sched, h = passes["mixed"]
    batch = runner.device_batch(h)
    regions = count_pass(model, lambda: forward(model, batch), emulate_fla=True)
    assert regions["gated_deltanet"].entries == regions["deltanet_prefill"].entries == n_lin
    assert regions["moe"].entries == engine.spec.num_moe_layers and regions["gated_attention"].entries == 1
    syncs = sum(c.syncs for c in regions.values())
    assert syncs == 2 and regions["deltanet_prefill"].sync_sites["fla_chunk_gated_delta_rule"] == 2
    decode = count_pass(model, lambda: forward(model, runner.device_batch(passes["decode"][1])), emulate_fla=True)
    assert "deltanet_prefill" not in decode and sum(c.syncs for c in decode.values()) == 0
    # the engine's graphs, as stand-ins: a replay of the mixed step through the static buffers
    replay_through_static_buffers(engine)
    for mixed, step in ((True, sched), (False, passes["decode"][0])):
        run, _ = graph_runs(runner, step, mixed=mixed)
        with torch.inference_mode():
            logits = run()
        assert logits.shape[0] == sum(s.samples for s in step.scheduled) and bool(torch.isfinite(logits).all())
    llm.shutdown()
