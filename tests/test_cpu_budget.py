"""On the CPU the pool is host memory: a GPU-sized budget is capped at what the model can use, and a budget the
machine cannot hold is refused with one line before anything is allocated."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rimuru import LLM
from rimuru.model_spec import load_model_spec
from rimuru.testing.tiny_models import make_tiny_checkpoint


def test_a_gpu_sized_budget_is_capped_on_the_cpu(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "m", seed=1)
    llm = LLM(str(path), device="cpu", gpu_memory_budget="32GiB", max_num_seqs=4)
    split, engine = llm.engine.budget_split, llm.engine
    spec = engine.spec
    import torch

    context = spec.max_position_embeddings
    need = (spec.non_expert_bytes(torch.float32) + spec.routed_expert_bytes(torch.float32) + split["workspace"]
            + 4 * context * spec.kv_bytes_per_token(torch.float32))
    assert split["budget"] == need < 2**30  # not 32 GiB of host memory for a tiny model
    assert engine.max_model_len == context  # and still the whole context for every sequence


def test_a_budget_beyond_host_memory_is_refused_before_allocating() -> None:
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    spec = load_model_spec("qwen1.5-moe-a2.7b")
    weights = spec.non_expert_bytes(torch.float32) + spec.routed_expert_bytes(torch.float32)
    if weights <= host:
        pytest.skip("this machine holds the model's float32 weights")
    with pytest.raises(ValueError, match="more than this machine's memory"):
        LLM("qwen1.5-moe-a2.7b", load_format="dummy", device="cpu", gpu_memory_budget="200GiB")


def test_the_default_cpu_budget_is_checked_against_host_memory_too() -> None:
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    spec = load_model_spec("qwen1.5-moe-a2.7b")
    if spec.non_expert_bytes(torch.float32) + spec.routed_expert_bytes(torch.float32) <= host:
        pytest.skip("this machine holds the model's float32 weights")
    with pytest.raises(ValueError, match="more than this machine's memory"):
        LLM("qwen1.5-moe-a2.7b", load_format="dummy", device="cpu")
