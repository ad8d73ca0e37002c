"""Decode CUDA graphs (GPU only): replayed steps give the same greedy tokens as eager steps.

float32 on the GPU, so that the comparison is about the graph machinery (static buffers, padding,
replay) and not about bf16 rounding between differently sized GEMMs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.engine.cuda_graphs import capture_sizes
from rimuru.testing.tiny_models import ARCHS, make_tiny_checkpoint

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_capture_ladder() -> None:
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and capture_sizes(256)[-1] == 256
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]


def _prompts() -> list[dict]:
    g = torch.Generator().manual_seed(5)
    # 7 requests: the decode batch (7, then fewer as requests end) is padded to the captured size 8
    return [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in (3, 9, 16, 17, 30, 41, 64)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_graph_and_eager_decode_agree(arch: str, tmp_path: Path) -> None:
    path = make_tiny_checkpoint(arch, tmp_path / arch, seed=1)
    # different max_tokens so the batch shrinks step by step through the padded sizes
    params = [SamplingParams(max_tokens=8 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(7)]
    results = []
    for eager in (True, False):
        llm = LLM(str(path), device="cuda", dtype="float32", gpu_memory_budget="1GiB", enforce_eager=eager,
                  max_num_seqs=16)
        outs = llm.generate(_prompts(), params)
        results.append([o.outputs[0].token_ids for o in outs])
        assert llm.stats()["kv_pages_used"] == 0
        if not eager:
            assert llm.engine.runner.graph_steps > 20
        else:
            assert llm.engine.runner.graphs is None
    assert results[0] == results[1]
