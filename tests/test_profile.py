"""Routing counts on the device and `rimuru profile`: the counter against bincount, the same counts with the
static and the offloading provider, a profile against an independent count of the routers' decisions, the
ranking file, and the command line end to end on ShareGPT."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rimuru import LLM
from rimuru.bench.profile_experts import (
    count_routing,
    format_summary,
    popularity_from_counts,
    profile_routing,
    top_share,
)
from rimuru.bench.workload import SampleRequest, load_tokenizer, sample_sharegpt
from rimuru.cli import main
from rimuru.experts.offload_provider import OffloadExpertProvider
from rimuru.experts.popularity import ExpertPopularity
from rimuru.experts.routing_counter import HOST_BUFFERS, RoutingCounter
from rimuru.experts.static_provider import StaticExpertProvider
from rimuru.models.moe import SparseMoE

BUDGET = "64MiB"
PROMPT_LENS = (5, 17, 33)
OUTPUT_LENS = (6, 3, 9)
TOP_K = 2  # every tiny model routes each token to 2 of 8 experts


def requests(vocab: int = 300) -> list[SampleRequest]:
    g = torch.Generator().manual_seed(7)
    return [SampleRequest(prompt="", prompt_token_ids=torch.randint(3, vocab, (n,), generator=g).tolist(),
                          output_len=m) for n, m in zip(PROMPT_LENS, OUTPUT_LENS, strict=True)]


def forwarded_tokens(reqs: list[SampleRequest], max_tokens: int | None = None) -> int:
    """Tokens that pass through the model: the prompt and every output token but the last (never fed back)."""
    return sum(r.prompt_len + (r.output_len if max_tokens is None else min(r.output_len, max_tokens)) - 1
               for r in reqs)


class RouterSpy:
    """Counts routing independently of the providers: recomputes softmax -> top-k from each MoE block's input."""

    def __init__(self, model: torch.nn.Module, num_experts: int) -> None:
        self.moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self.counts = np.zeros((len(self.moes), num_experts), dtype=np.int64)
        self.handles = [m.register_forward_pre_hook(self.hook) for m in self.moes]

    def hook(self, module: SparseMoE, args: tuple[torch.Tensor, ...]) -> None:
        logits = F.linear(args[0], module.gate.weight).float()  # [T, E]
        ids = torch.topk(torch.softmax(logits, dim=-1), module.top_k, dim=-1).indices
        self.counts[module.moe_idx] += torch.bincount(ids.flatten(), minlength=self.counts.shape[1]).numpy()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# ---------------------------------------------------------------- the counter


def test_counter_counts_exactly_as_bincount() -> None:
    g = torch.Generator().manual_seed(0)
    L, E = 3, 60
    counter = RoutingCounter(L, E)
    expected = torch.zeros(L, E, dtype=torch.int64)
    for step in range(20):
        layer = step % L
        T, k = int(torch.randint(1, 300, (1,), generator=g)), 4
        ids = torch.randint(0, E, (T, k), generator=g)
        counter.record(layer, ids if step % 2 else ids.int())  # int32 ids are accepted too
        expected[layer] += torch.bincount(ids.flatten(), minlength=E)
    assert counter.counts.dtype == torch.float32 and counter.counts.shape == (L, E)
    snap = counter.snapshot_and_reset()
    assert snap.device.type == "cpu" and torch.equal(snap.long(), expected)
    assert int(snap.sum()) == int(expected.sum())
    assert torch.count_nonzero(counter.counts) == 0  # reset on the device
    counter.record(1, torch.tensor([[0, 0], [59, 0]]))
    assert counter.snapshot_and_reset()[1, [0, 59]].tolist() == [3.0, 1.0]
    with pytest.raises(ValueError, match="needs >= 1 layer and >= 1 expert, got 0 x 8"):
        RoutingCounter(0, 8)


def test_counter_with_a_row_mask_counts_real_rows_in_one_launch_a_layer() -> None:
    # a padded graph batch: every layer routes the same [T, k] rows, the last two are padding
    from rimuru.testing.op_count import OpCounter

    g = torch.Generator().manual_seed(1)
    L, E, T, k = 4, 16, 6, 2
    mask = torch.tensor([True, True, True, True, False, False])
    ids = [torch.randint(0, E, (T, k), generator=g) for _ in range(L)]
    counter = RoutingCounter(L, E)
    ops = OpCounter()
    counter.row_mask = mask
    with ops.counting():
        for layer in range(L):
            counter.record(layer, ids[layer])
    counter.row_mask = None
    launches = sum(c.launches for c in ops.regions.values())
    assert launches <= L + 3  # one scatter a layer; the mask's weights (copy, view, cast) built once
    expected = torch.stack([torch.bincount(ids[layer][:4].flatten(), minlength=E) for layer in range(L)])
    assert torch.equal(counter.snapshot_and_reset().long(), expected)
    # another mask (another pass's padding) is honoured, not the first one's weights
    counter.row_mask = torch.tensor([True, False, False, False, False, False])
    counter.record(0, ids[0])
    counter.row_mask = None
    counter.record(1, ids[1])  # no mask: every row counts
    snap = counter.snapshot_and_reset().long()
    assert torch.equal(snap[0], torch.bincount(ids[0][:1].flatten(), minlength=E))
    assert torch.equal(snap[1], torch.bincount(ids[1].flatten(), minlength=E))


def test_counter_writes_into_one_fixed_tensor() -> None:
    # graph-capture friendly: record() never replaces the counts tensor (a captured graph keeps its address)
    counter = RoutingCounter(2, 8)
    ptr = counter.counts.data_ptr()
    counter.record(0, torch.tensor([[1, 2]]))
    counter.snapshot_and_reset()
    counter.record(1, torch.tensor([[3, 3], [3, 4]]))
    assert counter.counts.data_ptr() == ptr
    assert counter.counts.tolist() == [[0.0] * 8, [0, 0, 0, 3, 1, 0, 0, 0]]


def test_providers_record_only_when_a_counter_is_set(tiny_checkpoint) -> None:
    llm = LLM(str(tiny_checkpoint("qwen3_moe", seed=3)), device="cpu", gpu_memory_budget=BUDGET)
    provider = llm.engine.runtime.provider
    assert isinstance(provider, StaticExpertProvider) and provider.counter is None
    assert all(block.provider is provider for block in llm.engine.model.moe_blocks())
    ids = torch.tensor([[1, 5], [5, 7]])
    table = provider.table(0, ids)  # no counter: the contract is unchanged
    provider.counter = RoutingCounter(2, 8)
    assert torch.equal(provider.table(0, ids), table)
    assert provider.counter.counts[0].tolist() == [0, 1, 0, 0, 0, 2, 0, 1]


# ---------------------------------------------------------------- profiling through the engine


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_static_and_fixed_providers_count_the_same(tiny_checkpoint, arch: str) -> None:
    path = str(tiny_checkpoint(arch, seed=3))
    reqs = requests()
    static = LLM(path, device="cpu", gpu_memory_budget=BUDGET)
    fixed = LLM(path, device="cpu", gpu_memory_budget=BUDGET, offload_mode="fixed", offload_access="copy",
                resident_experts=2)
    assert isinstance(fixed.engine.runtime.provider, OffloadExpertProvider)
    got = {}
    for name, llm in (("static", static), ("fixed", fixed)):
        spy = RouterSpy(llm.engine.model, 8)
        got[name] = count_routing(llm, reqs, temperature=0.0)
        spy.remove()
        assert np.array_equal(got[name], spy.counts), name  # the providers saw exactly what the routers chose
        assert llm.engine.runtime.provider.counter is None  # detached afterwards
        assert llm.stats()["kv_pages_used"] == 0
    assert fixed.stats()["prefetch_misses"] > 0  # routing did cross the load buffers
    assert np.array_equal(got["static"], got["fixed"])
    num_moe = {"qwen3_moe": 2, "qwen2_moe": 2}[arch]  # qwen2_moe: 3 layers, layer 1 dense
    assert got["static"].shape == (num_moe, 8) and got["static"].dtype == np.int64
    assert got["static"].sum(axis=1).tolist() == [forwarded_tokens(reqs) * TOP_K] * num_moe


def test_profile_matches_independent_count_and_round_trips(tiny_checkpoint, tmp_path: Path) -> None:
    llm = LLM(str(tiny_checkpoint("qwen3_moe", seed=3)), device="cpu", gpu_memory_budget=BUDGET)
    provider = llm.engine.runtime.provider
    outer = RoutingCounter(2, 8)  # a counter somebody else attached: left alone and restored
    provider.counter = outer
    reqs = requests()
    spy = RouterSpy(llm.engine.model, 8)
    pop = profile_routing(llm, reqs, model_name="tiny-qwen3", max_tokens=4, seed=5)
    spy.remove()
    assert provider.counter is outer and torch.count_nonzero(outer.counts) == 0
    total = forwarded_tokens(reqs, max_tokens=4) * TOP_K
    assert spy.counts.sum(axis=1).tolist() == [total, total]
    assert np.array_equal(pop.probabilities, spy.counts / total)  # counts / total, bit for bit
    assert np.allclose(pop.probabilities.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert (pop.model, pop.num_prompts, pop.num_layers, pop.num_experts) == ("tiny-qwen3", 3, 2, 8)
    assert np.array_equal(pop.rankings[:, 0], spy.counts.argmax(axis=1))

    path = tmp_path / "ranking.json"
    pop.save(path)
    back = ExpertPopularity.load(path, num_layers=2, num_experts=8)
    assert np.array_equal(back.probabilities, pop.probabilities) and np.array_equal(back.rankings, pop.rankings)
    assert (back.model, back.num_prompts, back.date) == ("tiny-qwen3", 3, pop.date)
    # the same seed gives the same counts
    assert np.array_equal(profile_routing(llm, reqs, max_tokens=4, seed=5).probabilities, pop.probabilities)


def test_profile_refuses_graphs_busy_engines_and_no_requests(tiny_checkpoint) -> None:
    llm = LLM(str(tiny_checkpoint("qwen3_moe", seed=3)), device="cpu", gpu_memory_budget=BUDGET)
    with pytest.raises(ValueError, match="no requests to profile"):
        count_routing(llm, [])
    llm.engine.runner.graphs = object()  # type: ignore[assignment]  # as if decode graphs were captured
    with pytest.raises(ValueError, match="enforce_eager=True"):
        count_routing(llm, requests())
    llm.engine.runner.graphs = None
    bad = [*requests(), SampleRequest(prompt="", prompt_token_ids=[1, 300], output_len=2)]  # id 300 >= vocab
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 300\)"):
        count_routing(llm, bad)
    assert not llm.engine.has_unfinished_requests() and llm.stats()["kv_pages_used"] == 0  # aborted cleanly
    assert llm.engine.runtime.provider.counter is None


def test_popularity_from_counts_and_summary() -> None:
    counts = np.array([[1, 4, 2, 3], [5, 5, 5, 5]])
    pop = popularity_from_counts(counts, "m", num_prompts=2)
    assert pop.probabilities.tolist() == [[0.1, 0.4, 0.2, 0.3], [0.25] * 4] and pop.num_prompts == 2
    k, shares = top_share(pop)
    assert k == 1 and shares.tolist() == [0.4, 0.25]
    assert format_summary(pop, top=2).splitlines() == [
        "expert routing of m: 2 prompts, 2 MoE layers x 4 experts (uniform share 25.00 %)",
        "  layer   0  top-2 1:40.00%  3:30.00%  | top 1: 40.0 %",
        "  layer   1  top-2 0:25.00%  1:25.00%  | top 1: 25.0 %",
        "skew: the top 1 of 4 experts (25 %) take 32.5 % of the routing on average (min 25.0 % layer 1, "
        "max 40.0 % layer 0); uniform routing would give 25.0 %",
    ]
    with pytest.raises(ValueError, match="MoE layer 1 routed no tokens"):
        popularity_from_counts(np.array([[1, 0], [0, 0]]), "m", 1)


# ---------------------------------------------------------------- the command line


def test_cli_profile_sharegpt_end_to_end(tiny_checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt = tiny_checkpoint("qwen3_moe", seed=3)
    out = tmp_path / "sub" / "ranking.json"
    rc = main(["profile", str(ckpt), "--device", "cpu", "--gpu-memory-budget", BUDGET, "--dataset", "sharegpt",
               "--num-prompts", "4", "--max-tokens", "4", "--max-prompt-len", "48", "--seed", "1",
               "--output", str(out), "--no-progress"])
    assert rc == 0
    pop = ExpertPopularity.load(out, num_layers=2, num_experts=8)
    assert (pop.model, pop.num_prompts) == (ckpt.name, 4)
    assert np.allclose(pop.probabilities.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert json.loads(out.read_text())["date"] == pop.date != ""
    # the same ShareGPT requests, drawn independently with the checkpoint's tokenizer (context 512)
    reqs = sample_sharegpt(load_tokenizer(str(ckpt)), 4, 1, max_prompt_len=48, max_total_len=512, max_output_len=4)
    assert len(reqs) == 4 and all(r.prompt_len <= 48 and r.output_len == 4 for r in reqs)
    tokens = forwarded_tokens(reqs)
    scaled = pop.probabilities * tokens * TOP_K  # back to counts: whole numbers summing to every assignment
    assert np.allclose(scaled, np.round(scaled), rtol=0, atol=1e-6)
    assert np.round(scaled).sum(axis=1).tolist() == [tokens * TOP_K] * 2
    printed = capsys.readouterr().out
    assert f"expert routing of {ckpt.name}: 4 prompts, 2 MoE layers x 8 experts" in printed
    assert "  layer   0  top-5 " in printed and "  layer   1  top-5 " in printed
    assert "skew: the top 2 of 8 experts (25 %)" in printed
    assert f"4 requests, {tokens} tokens routed per layer" in printed


def test_cli_lists_profile() -> None:
    from rimuru.cli import build_parser

    args = build_parser().parse_args(["profile", "m", "--output", "r.json"])
    assert (args.dataset, args.num_prompts, args.max_tokens, args.seed, args.enforce_eager) == \
        ("sharegpt", 500, None, 0, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_async_snapshots_take_the_pinned_buffers_in_turn() -> None:
    # each snapshot holds its own pass's counts for HOST_BUFFERS - 1 more calls; no host buffer is allocated per step
    counter = RoutingCounter(2, 8, device="cuda")
    n = HOST_BUFFERS
    snaps = []
    for step in range(2 * n):
        counter.record(step % 2, torch.tensor([[step % 7, 7]], device="cuda"))
        host, done = counter.snapshot_and_reset_async()
        assert done is not None and host.is_pinned()
        done.synchronize()
        snaps.append((host.data_ptr(), host.clone(), host))
        for back in range(1, min(step, n - 1) + 1):  # the snapshots taken before are still intact
            assert torch.equal(snaps[step - back][2], snaps[step - back][1])
    ptrs = [p for p, _, _ in snaps]
    assert ptrs[:n] == ptrs[n:] and len(set(ptrs[:n])) == n
    for step, (_, snap, _) in enumerate(snaps):
        expected = torch.zeros(2, 8)
        expected[step % 2, step % 7] += 1
        expected[step % 2, 7] += 1
        assert torch.equal(snap, expected)
