"""CUDA graphs: replayed steps give the same greedy tokens as eager steps (GPU only), and the capture ladders.

float32 on the GPU, so that the comparison is about the graph machinery (static buffers, padding,
replay) and not about bf16 rounding between differently sized GEMMs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.engine.cuda_graphs import MAX_MIXED_GRAPH_TOKENS, StepGraphs, _TensorPlace, capture_sizes, token_buckets
from rimuru.testing.tiny_models import ARCHS, make_tiny_checkpoint

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_an_unowned_view_reads_the_memory_without_keeping_it() -> None:
    """What mixed graphs' hidden states are read through: the same elements, and the memory's owner alone decides
    when it is freed (no reference that would keep a graph's output out of later captures' reach)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    with torch.inference_mode():
        owner = torch.arange(24, dtype=torch.float32).view(4, 6)[1:]  # an offset into its storage
        view = _TensorPlace.of(owner).unowned_view()
        assert view.shape == owner.shape and view.stride() == owner.stride() and torch.equal(view, owner)
        owner[0, 2] = -1.0
        assert view[0, 2] == -1.0
        alive = StorageWeakRef(owner.untyped_storage())
        del owner
        assert alive.expired()  # the view kept nothing


def test_capture_ladder() -> None:
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and capture_sizes(256)[-1] == 256
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]


def test_token_buckets() -> None:
    assert token_buckets(4096) == [32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096]
    assert token_buckets(100) == [32, 64, 100]
    assert token_buckets(10**6)[-1] == MAX_MIXED_GRAPH_TOKENS


def test_max_capture_size_caps_both_ladders() -> None:
    def ladders(cap: int | None, seqs: int = 256, tokens: int = 4096) -> tuple[list[int], list[int]]:
        g = StepGraphs(torch.nn.Identity(), torch.device("cpu"), num_layers=2, max_num_seqs=seqs, max_model_len=64,
                       block_size=16, max_num_batched_tokens=tokens, max_capture_size=cap)
        assert g.max_seqs == seqs  # mixed graphs still take every running sequence
        return g.sizes, g.token_sizes

    assert ladders(None) == (capture_sizes(256), token_buckets(4096))  # default: up to the step budget
    assert ladders(512) == (capture_sizes(256), [32, 64, 128, 256, 512])  # vLLM's default at 256 sequences
    assert ladders(100) == (capture_sizes(100), [32, 64, 100])  # decode batches above 100 run eagerly
    assert ladders(10**5) == (capture_sizes(256), token_buckets(4096))
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        LLM("unused", max_cudagraph_capture_size=0)


def test_a_capture_cap_leaves_the_workspace_bound_as_measured() -> None:
    # the H200 probe of a capped engine (cap 512, T = 4096) used 1,641 MB against 1,625 MB uncapped: its eager
    # steps fill the room the smaller graph pool leaves, so the bound does not depend on the cap (charging a whole
    # eager pass would reserve ~681 MB for nothing). tests/test_engine.py holds the bound to that probe's peaks.
    import json

    from rimuru.config import EngineConfig
    from rimuru.engine.setup import workspace_bytes
    from rimuru.model_spec import load_model_spec
    from rimuru.sim.cost_model import H200_WORKSPACE_SCRATCH

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    capped = json.loads((results / "2026-11-30-probe-workspace-elastic-4096tok-cap512-5ca9050-h200.json").read_text())
    uncapped = json.loads((results / "2026-11-30-probe-workspace-elastic-4096tok-5ca9050-h200.json").read_text())
    assert capped["max_cudagraph_capture_size"] == 512 and uncapped["max_cudagraph_capture_size"] is None
    assert capped["measured_workspace"] < 1.05 * uncapped["measured_workspace"]
    spec = load_model_spec("qwen1.5-moe-a2.7b")

    def bound(cap: int | None) -> int:
        cfg = EngineConfig(model="qwen1.5-moe-a2.7b", max_num_batched_tokens=4096, max_cudagraph_capture_size=cap)
        return workspace_bytes(spec, cfg, torch.bfloat16, H200_WORKSPACE_SCRATCH)

    assert bound(100) == bound(512) == bound(4096) == bound(None) >= capped["measured_workspace"]


def test_mixed_graph_host_arrays_pad_tokens_and_sequences(tmp_path: Path) -> None:
    """The padded arrays a mixed graph reads: the real prefix equals the eager batch; padding tokens write no KV
    and belong to no sequence; padded sequences are empty; q_tile_start counts each sequence's q tiles."""
    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "m", seed=1)
    llm = LLM(str(path), device="cpu", gpu_memory_budget="256MiB", max_num_batched_tokens=48)
    engine = llm.engine
    for i, n in enumerate((30, 5, 9)):
        engine.add_request(f"r{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the three prompts (44 tokens) fit the 48-token step
    engine.add_request("r3", list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine._take_inbox()
    sched = engine.scheduler.schedule()  # r0's rest and the decodes of r1, r2 + a chunk of r3: a mixed step
    runner = engine.runner
    runner.q_block = 16
    plain = runner.host_arrays(sched)
    T, B = len(plain.input_ids), len(plain.seq_lens)
    assert B == 4 and T > B  # a mixed step
    h = runner.host_arrays(sched, pad_tokens=64, pad_seqs=6)
    assert h.input_ids.shape == (64,) and (h.input_ids[T:] == 0).all() and (h.input_ids[:T] == plain.input_ids).all()
    assert (h.positions[:T] == plain.positions).all() and (h.positions[T:] == 0).all()
    assert (h.slot_mapping[:, :T] == plain.slot_mapping).all() and (h.slot_mapping[:, T:] == -1).all()
    assert (h.query_start_loc[: B + 1] == plain.query_start_loc).all() and (h.query_start_loc[B:] == T).all()
    assert (h.seq_lens[:B] == plain.seq_lens).all() and (h.seq_lens[B:] == 0).all()
    assert (h.block_tables == plain.block_tables).all()
    assert h.num_sampled == plain.num_sampled == len(plain.logits_indices)
    assert (h.logits_indices[: h.num_sampled] == plain.logits_indices).all() and h.logits_indices.shape == (6,)
    q_lens = np.diff(plain.query_start_loc)
    assert h.q_tile_start.tolist() == [0, *np.cumsum(-(-q_lens // 16)).tolist(), *[h.q_tile_start[B]] * 2]
    assert len(h.fields()) == 8 and len(plain.fields()) == 7


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


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_graphs_agree_with_eager(arch: str, tmp_path: Path) -> None:
    """Chunked prefills mixed with decodes (a 96-token step budget): every step of the graph run replays a
    decode or a mixed graph, and the greedy tokens equal the eager run's."""
    path = make_tiny_checkpoint(arch, tmp_path / arch, seed=2)
    g = torch.Generator().manual_seed(9)
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()}
               for n in (150, 7, 61, 230, 33, 96, 12)]
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(7)]
    results, runners = [], []
    # eager; every step a graph; graphs of at most 64 tokens (--max-cudagraph-capture-size: larger steps eager)
    for eager, cap in ((True, None), (False, None), (False, 64)):
        llm = LLM(str(path), device="cuda", dtype="float32", gpu_memory_budget="1GiB", enforce_eager=eager,
                  max_num_seqs=16, max_num_batched_tokens=96, max_cudagraph_capture_size=cap)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert llm.stats()["kv_pages_used"] == 0
        runners.append(llm.engine.runner)
    eager_runner, graph_runner, capped_runner = runners
    assert eager_runner.graph_steps == 0
    assert graph_runner.mixed_graph_steps >= 6 and graph_runner.graph_steps > graph_runner.mixed_graph_steps
    assert capped_runner.graphs.token_sizes[-1] == 64 and 0 < capped_runner.graph_steps < graph_runner.graph_steps
    assert results[0] == results[1] == results[2]


@gpu
@pytest.mark.gpu
def test_prompt_logprobs_from_mixed_graphs_equal_eager(tmp_path: Path) -> None:
    """Prompt rows read a mixed graph's own hidden states in the graphs' pool, no copy: the prompt logprobs of
    chunked prefills (a 96-token step budget: every step with a chunk replays a mixed graph of its size, decode graphs
    between them, async scheduling launching the next step before the last is read) equal the eager run's, and so
    do the tokens."""
    path = make_tiny_checkpoint("qwen2_moe", tmp_path / "m", seed=2)
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in (150, 7, 61)]
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0)]
    results, runners = [], []
    for eager in (True, False):
        llm = LLM(str(path), device="cuda", dtype="float32", gpu_memory_budget="1GiB", enforce_eager=eager,
                  max_num_seqs=16, max_num_batched_tokens=96)
        results.append(llm.generate(prompts, params))
        runners.append(llm.engine.runner)
    assert runners[1].mixed_graph_steps >= 2 and runners[1].graph_steps > runners[1].mixed_graph_steps
    eager_outs, graph_outs = results
    assert [o.outputs[0].token_ids for o in graph_outs] == [o.outputs[0].token_ids for o in eager_outs]
    for i in (0, 2):
        a, b = graph_outs[i].prompt_logprobs, eager_outs[i].prompt_logprobs
        assert a is not None and b is not None and len(a) == len(b) == len(prompts[i]["prompt_token_ids"])
        for x, y in zip(a[1:], b[1:], strict=True):
            assert list(x) == list(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
