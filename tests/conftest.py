"""Shared fixtures: tiny random checkpoints of every architecture, built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rimuru.testing import make_tiny_checkpoint
from rimuru.testing.tiny_models import ARCHS

# CPU tests run tiny tensors: intra-op threads only add spin-waiting, which on a shared 2-core machine
# made the model tests 5x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_checkpoint(arch="qwen2_moe", fused_experts=False, **kwargs) -> Path`: a tiny checkpoint
    directory (weights, config, tokenizer); each distinct request is built once per session."""
    built: dict[str, Path] = {}

    def get(arch: str = "qwen2_moe", fused_experts: bool = False, **kwargs: Any) -> Path:
        key = repr((arch, fused_experts, sorted(kwargs.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"{arch}_{'fused' if fused_experts else 'per_expert'}")
            built[key] = make_tiny_checkpoint(arch, out, fused_experts=fused_experts, **kwargs)
        return built[key]

    return get


@pytest.fixture(scope="session")
def parity_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per architecture (seed 3); mixtral and olmoe with fused expert tensors, the others
    per-expert, so both namings load. Shared by the engine and offload parity tests."""
    root = tmp_path_factory.mktemp("parity_ckpt")
    return {arch: make_tiny_checkpoint(arch, root / arch, fused_experts=arch in ("mixtral", "olmoe"), seed=3)
            for arch in ARCHS}


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Callable[..., Path]) -> Path:
    """The tiny qwen2_moe checkpoint most API tests read."""
    return tiny_checkpoint("qwen2_moe")


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> Any:
    """An `LLM` over `ckpt` on the CPU with a 64 MiB budget, shared by one test module."""
    from rimuru import LLM

    return LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu")
