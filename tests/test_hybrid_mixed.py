"""A hybrid model's passes with prefill rows, split (models/state_cache.py `LinearStateCache.mixed`): the decode rows
by the paged decode kernels (their torch references on the CPU), the prefill sequences by the chunk form, with every
size a host int of the batch's StepLayout.

On the CPU: the split pass against the gather / scatter reference path and transformers' logits (model level, with
the decodes first, after a prefill, fresh sequences, several prefill sequences); the runner's batch with its decodes
first and its sampled rows in scheduled order; the engine's greedy tokens through the split against transformers'
with chunked prefill beside decodes; and the pass's host syncs counted (rimuru/testing/op_count.py): none in the
linear-attention layers, only fla-core's chunk-index builds of the first layer where fla's path is modelled.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.engine.llm_engine import LLMEngine
from rimuru.engine.scheduler import SchedulerOutput
from rimuru.models import state_cache as state_cache_module
from rimuru.models.forward_batch import StepLayout
from rimuru.testing.op_count import OpCounter, box_kernels
from rimuru.testing.paged_model import PagedModel
from rimuru.testing.paged_model import random_prompts as model_prompts
from rimuru.testing.pools import assert_nothing_held
from rimuru.testing.reference import assert_greedy_matches, random_prompts

pytest.importorskip("transformers")

ARCH = "qwen3_5_moe_text"
ATOL = 1e-3  # the paged decode and the chunk form sum in other orders than the per-token reference
CHUNK = 16
STEPS = 10


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(ARCH, seed=3)


# ---------------------------------------------------------------------------------------------- the layout

def test_the_layout_counts_the_leading_decodes() -> None:
    assert StepLayout.of([1, 1, 5, 3]) == StepLayout(2, 4, 10, 5)
    assert StepLayout.of([4, 1, 1]) == StepLayout(0, 3, 6, 4)  # a decode after a prefill is a one-token prefill
    assert StepLayout.of([1, 1]) == StepLayout(2, 2, 2, 0) and StepLayout.of([1, 1]).num_prefills == 0


# ---------------------------------------------------------------------------------------------- model level

# (seq, tokens) per pass: chunks continuing states, fresh sequences, decodes first and after a prefill, a 70-token
# chunk (past one 64-token delta-rule chunk), a one-token prefill, several prefill sequences beside decodes
def _passes(a: list[int], b: list[int], c: list[int]) -> list[list[tuple[int, list[int]]]]:
    return [
        [(0, c[:29]), (1, b[:6])],
        [(1, b[6:]), (2, a), (0, c[29:])],
        [(1, [5]), (2, [7]), (0, [9]), (3, a[:3])],
        [(3, a[3:4]), (1, [5]), (4, c), (2, [7])],
        [(1, [5]), (2, [7]), (0, [9]), (3, a[4:]), (4, [11]), (5, b[:9])],
        [(1, [5]), (2, [7]), (0, [9]), (3, [11]), (4, [12]), (5, [13])],
    ]


def _run(ckpt: Path, split: bool) -> list[torch.Tensor]:
    hm = PagedModel(ckpt, seed=1)
    cache = hm.model.state_cache
    assert cache is not None
    cache.in_place_decode = split
    a, b, c = model_prompts(2, hm.spec.vocab_size, (5, 17, 70))
    return [out for chunks in _passes(a, b, c) for out in hm.step(chunks)]


def test_split_passes_equal_the_reference_path(ckpt: Path) -> None:
    want, got = _run(ckpt, split=False), _run(ckpt, split=True)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert bool(torch.isfinite(g).all()), i
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=f"output {i}")


@pytest.mark.parametrize("per_group", [1, 2])
def test_prefill_sequences_in_groups_equal_one_group(ckpt: Path, per_group: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # the chunk form takes a pass's prefill sequences in groups of a bounded state size (the workspace's worst step
    # holds hundreds): groups of one and two sequences give the outputs of one group
    def run(grouped: bool) -> tuple[list[torch.Tensor], list[int]]:
        hm = PagedModel(ckpt, seed=1, num_state_pages=48)  # ten sequences' state
        cache = hm.model.state_cache
        assert cache is not None
        cache.in_place_decode = True
        seen: list[int] = []
        if grouped:
            monkeypatch.setattr(state_cache_module, "PREFILL_STATE_GROUP_BYTES", per_group * cache.ssm[0].numel() * 4)
            groups = cache._prefill_seqs

            def counted(*a):  # noqa: ANN002, ANN202
                seqs = groups(*a)
                seen.append(len(seqs.groups))
                assert all(g.last - g.first <= per_group for g in seqs.groups)
                return seqs

            monkeypatch.setattr(cache, "_prefill_seqs", counted)
        a, b, c = model_prompts(2, hm.spec.vocab_size, (5, 17, 70))
        passes = _passes(a, b, c) + [[(0, [3]), (6, a[:3]), (7, b[:4]), (8, c[:6]), (9, a[:2]), (1, b[9:12])]]
        return [out for chunks in passes for out in hm.step(chunks)], seen

    want, _ = run(grouped=False)
    got, seen = run(grouped=True)
    monkeypatch.undo()
    assert max(seen) >= 5 // per_group  # the last pass's five prefill sequences went in several groups
    # the same sums over other matmul shapes (a group's rows): the CPU's kernels block them otherwise, so the logits
    # (|x| ~ 10) differ by float32 rounding, ~1e-5 on a CPU with AMX; the reorderings above are held to ATOL = 1e-3
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=f"output {i}")


@pytest.mark.parametrize("decodes", [0, 2])
def test_a_single_prefill_in_a_static_window_equals_the_split(ckpt: Path, decodes: int) -> None:
    # What a single-prefill mixed graph runs (engine/cuda_graphs.py): the pass's batch as a graph's (no layout, its
    # one prefill sequence found on the device) and its sequence in a window of the pass's rows. Logits and the
    # states left in the pages (the next passes read them) equal those of the split, which takes the layout's
    # host ints; a continued chunk (a state read) and a fresh one, behind decodes or alone, past a 64-row chunk.
    def run(window: bool) -> list[torch.Tensor]:
        hm = PagedModel(ckpt, seed=1)
        cache = hm.model.state_cache
        assert cache is not None
        cache.in_place_decode = True
        a, b, c = model_prompts(2, hm.spec.vocab_size, (5, 17, 70))
        outs = hm.step([(0, c[:30])] + [(1 + i, a[:1 + i]) for i in range(decodes)])  # states to continue
        first = [(1 + i, [a[1 + i]]) for i in range(decodes)]

        def step(chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
            batch = hm.batch(chunks)
            if window:
                batch.layout, batch.padded = None, True
                cache.reserve_graph_rows(batch.num_tokens)
                cache.single_prefill = True
            with torch.inference_mode():
                logits = hm.model.compute_logits(hm.model(batch)[batch.logits_indices])
            cache.single_prefill = False
            return list(logits.split([len(t) for _, t in chunks]))

        outs += step(first + [(0, c[30:])])  # continues a state: 40 rows
        outs += step(first + [(5, b)])  # a fresh sequence
        outs += hm.step([(0, [9]), (5, [11])] + [(1 + i, [3]) for i in range(decodes)])  # decodes read the states
        return outs

    want, got = run(window=False), run(window=True)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert bool(torch.isfinite(g).all()), i
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0, msg=f"output {i}")


def test_split_prefill_equals_transformers(ckpt: Path) -> None:
    from test_qwen3_5_model import hf_logits

    hm = PagedModel(ckpt, seed=2)
    assert hm.model.state_cache is not None
    hm.model.state_cache.in_place_decode = True
    a, b, c = model_prompts(3, hm.spec.vocab_size, (5, 17, 70))
    first = hm.step([(1, b[:1]), (0, c[:40]), (2, a)])  # a one-token fresh sequence first: a decode row
    second = hm.step([(1, b[1:2]), (0, c[40:]), (3, b)])
    torch.testing.assert_close(torch.cat([first[1], second[1]]), hf_logits(ckpt, c), atol=ATOL, rtol=0)
    torch.testing.assert_close(first[2], hf_logits(ckpt, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(second[2], hf_logits(ckpt, b), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([first[0], second[0]]), hf_logits(ckpt, b[:2]), atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- the runner's batch

def test_the_runner_puts_decodes_first_and_samples_in_scheduled_order(ckpt: Path) -> None:
    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=64,
              enable_prefix_caching=False)  # (prefix caching would cut the chunk at a snapshot boundary)
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts((5, 9), seed=30)):
        engine.add_request(str(i), p, params)
    engine.step()
    engine.add_request("new", random_prompts((20,), seed=31)[0], params)
    engine._take_inbox()
    sched = engine.scheduler.schedule()
    # scheduled: the two decodes, the new prompt; put the prompt first to see the runner reorder
    sched.scheduled = [sched.scheduled[2], sched.scheduled[0], sched.scheduled[1]]
    assert [s.num_new_tokens for s in sched.scheduled] == [20, 1, 1]
    h = engine.runner.host_arrays(sched)
    assert h.query_start_loc.tolist() == [0, 1, 2, 22]  # decodes at rows 0 and 1, the prompt after them
    assert h.layout == StepLayout(2, 3, 22, 20)
    assert h.logits_indices.tolist() == [21, 0, 1]  # the prompt's last row, then the two decodes: scheduled order
    reqs = [sched.scheduled[i].request for i in (1, 2, 0)]  # batch order
    assert h.ssm_pages is not None and np.array_equal(h.ssm_pages.T, np.array([r.ssm_pages for r in reqs]))
    assert h.seq_lens.tolist() == [r.num_computed_tokens + s.num_new_tokens for r, s in
                                   zip(reqs, [sched.scheduled[i] for i in (1, 2, 0)], strict=True)]


def test_prompt_logprob_rows_follow_the_decodes_first_order(ckpt: Path) -> None:
    from rimuru.engine.prompt_logprobs import prompt_logprob_rows

    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=64,
              enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts((5, 9), seed=30)):
        engine.add_request(str(i), p, params)
    engine.step()
    prompt = random_prompts((20,), seed=31)[0]
    engine.add_request("new", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                     prompt_logprobs=2))
    engine._take_inbox()
    sched = engine.scheduler.schedule()
    sched.scheduled = [sched.scheduled[2], sched.scheduled[0], sched.scheduled[1]]  # the prompt before the decodes
    order = engine.runner.batch_order(sched.scheduled)
    assert order == [1, 2, 0]
    h = engine.runner.host_arrays(sched)
    rows = prompt_logprob_rows(sched.scheduled, engine.spec.vocab_size, engine.runner.batch_order)
    assert rows is not None and rows.hidden_rows.tolist() == list(range(2, 21))  # after the two decode rows
    # each row's hidden state is the one of the token before its target
    assert h.input_ids[rows.hidden_rows].tolist() == prompt[:19] and rows.targets.tolist() == prompt[1:20]
    # in scheduled order (no reordering) the rows would have been the decodes' and the prompt's first ones
    assert prompt_logprob_rows(sched.scheduled, engine.spec.vocab_size).hidden_rows.tolist() == list(range(19))


# ---------------------------------------------------------------------------------------------- the engine

def serve(engine: LLMEngine, prompts: list[list[int]], arrivals: list[int], steps: int = STEPS) -> list[list[int]]:
    """Greedy tokens of each prompt, added at its engine step (so prompts are chunked beside running decodes)."""
    todo = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    done: dict[int, list[int]] = {}
    step = 0
    while todo or engine.has_unfinished_requests():
        while todo and arrivals[todo[0]] <= step:
            i = todo.pop(0)
            engine.add_request(str(i), prompts[i], params)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
        step += 1
    return [done[i] for i in range(len(prompts))]


class Kinds:
    """Counts the launches of the engine by kind: with a chunk (mixed or prefill) or pure decode."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mixed = self.decode = 0
        launch = engine.runner.launch

        def counted(sched: SchedulerOutput, trace: object) -> object:
            n = [s.num_new_tokens for s in sched.scheduled]
            if max(n) > 1 and 1 in n:
                self.mixed += 1
            elif max(n) == 1:
                self.decode += 1
            return launch(sched, trace)  # type: ignore[arg-type]

        monkeypatch.setattr(engine.runner, "launch", counted)


PROMPTS = ((12, 0), (30, 0), (7, 2), (40, 3), (1, 5), (21, 6))  # (length, arrival step)


def test_the_engine_through_the_split_decodes_transformers_tokens(ckpt: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = random_prompts(tuple(n for n, _ in PROMPTS), seed=32)
    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=CHUNK, async_scheduling=True)
    engine = llm.engine
    assert engine.model.state_cache is not None
    engine.model.state_cache.in_place_decode = True
    kinds = Kinds(engine, monkeypatch)
    got = serve(engine, prompts, [a for _, a in PROMPTS])
    assert kinds.mixed > 3 and kinds.decode > 0
    assert_greedy_matches(ckpt, prompts, got, STEPS)
    assert_nothing_held(engine)


# ---------------------------------------------------------------------------------------------- host syncs

def _mixed_pass(ckpt: Path) -> tuple[LLM, Callable[[], None]]:
    """An engine whose next step is two decodes beside a 12-token chunk; returns a function running that pass."""
    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=CHUNK)
    engine = llm.engine
    assert engine.model.state_cache is not None
    engine.model.state_cache.in_place_decode = True
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts((5, 6), seed=33)):
        engine.add_request(str(i), p, params)
    engine.step()
    engine.add_request("c", random_prompts((30,), seed=34)[0], params)
    engine._take_inbox()
    sched = engine.scheduler.schedule()
    assert sorted(s.num_new_tokens for s in sched.scheduled) == [1, 1, 14]
    runner = engine.runner

    def run() -> None:
        batch = runner.prepare(sched)  # a new batch and layout per pass, as every step
        engine.model.compute_logits(engine.model(batch)[batch.logits_indices])

    return llm, run


def test_a_split_pass_never_syncs_the_host_in_its_linear_layers(ckpt: Path) -> None:
    _, run = _mixed_pass(ckpt)
    with torch.inference_mode():
        for emulate_fla, want in ((False, 0), (True, 2)):
            counter = OpCounter()
            with box_kernels(counter, emulate_fla=emulate_fla), counter.counting():
                run()
                run()  # a second pass: its own cu_seqlens tensor, so fla builds its chunk indices again
            total = counter.total()
            # torch's chunk form: no sync at all; fla's path: its two chunk-index builds, in the first layer only
            assert total.syncs == 2 * want, (emulate_fla, total.sync_sites)
            assert set(total.sync_sites) <= {"fla_chunk_gated_delta_rule"}


def test_the_reference_path_still_syncs_where_the_split_does_not(ckpt: Path) -> None:
    llm, run = _mixed_pass(ckpt)
    llm.engine.model.state_cache.in_place_decode = False  # the gather / scatter path
    counter = OpCounter()
    with torch.inference_mode(), box_kernels(counter), counter.counting():
        run()
    n_lin = len(llm.engine.spec.linear_layer_ids)
    assert counter.total().syncs == n_lin  # write's padding test only: pad_varlen reads the host's max_query_len
