"""Workload sampling (ShareGPT, Poisson) and the serving client against the real server on a tiny model."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rimuru.bench.cli import add_serve_args, bench_serve, check_serve_args
from rimuru.bench.serve_client import BenchConfig, format_summary, run_benchmark, summarize
from rimuru.bench.workload import (
    SampleRequest,
    conversation_indices,
    is_valid_pair,
    iter_sharegpt,
    load_tokenizer,
    poisson_arrivals,
    sample_shared_prefix,
    sample_sharegpt,
    sample_sharegpt_multiturn,
    shared_prefix,
)
from rimuru.config import EngineConfig
from rimuru.engine.llm_engine import LLMEngine
from rimuru.server.app import ServerConfig
from rimuru.server.background import BackgroundServer


def test_truncated_sharegpt_file_keeps_whole_records(tmp_path: Path) -> None:
    recs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
            for i in range(3)]
    text = json.dumps(recs)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.rindex('"a"')])  # cut inside the last record, as the packaged file is
    assert [r["id"] for r in iter_sharegpt(cut)] == ["0", "1"]
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    assert [r["id"] for r in iter_sharegpt(whole)] == ["0", "1", "2"]


def test_bundled_sharegpt_sampling_is_deterministic_and_filtered() -> None:
    tok = load_tokenizer(None)  # the Qwen vocabulary
    a = sample_sharegpt(tok, 20, seed=3)
    b = sample_sharegpt(tok, 20, seed=3)
    assert len(a) == 20 and a == b
    assert all(is_valid_pair(r.prompt_len, r.output_len) for r in a)
    assert sample_sharegpt(tok, 20, seed=4) != a
    assert not is_valid_pair(3, 100) and not is_valid_pair(100, 3) and not is_valid_pair(1025, 10)
    assert not is_valid_pair(1000, 1049) and is_valid_pair(1000, 1048)
    assert is_valid_pair(100, 2, check_output=False)


def test_poisson_arrivals() -> None:
    t = poisson_arrivals(4000, request_rate=10.0, seed=1)
    assert t == poisson_arrivals(4000, request_rate=10.0, seed=1)
    assert t[0] == 0.0 and all(x <= y for x, y in zip(t, t[1:], strict=False))
    gaps = np.diff(t)
    assert abs(gaps.mean() - 0.1) < 0.01 and abs(gaps.std() - 0.1) < 0.015  # exponential: std == mean
    assert poisson_arrivals(5, float("inf")) == [0.0] * 5


@pytest.fixture(scope="module")
def served(tiny_checkpoint) -> Iterator[tuple[str, Path]]:
    ckpt = tiny_checkpoint("qwen2_moe")
    engine = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", gpu_memory_budget="64MiB"))
    with BackgroundServer(engine, ServerConfig(served_model_name="tiny")) as srv:
        yield srv.url, ckpt


@pytest.mark.parametrize("prompt_format", ["text", "token-ids"])
def test_client_against_real_server(served: tuple[str, Path], prompt_format: str) -> None:
    url, ckpt = served
    tok = load_tokenizer(str(ckpt))
    reqs = sample_sharegpt(tok, 8, seed=0, max_prompt_len=120, max_total_len=150, max_output_len=12)
    assert len(reqs) == 8
    reqs.append(SampleRequest(prompt="x", prompt_token_ids=[1], output_len=100_000))  # fails: too long
    cfg = BenchConfig(base_url=url, model="tiny", prompt_format=prompt_format, max_concurrency=4)
    results, duration = asyncio.run(run_benchmark(cfg, reqs, poisson_arrivals(len(reqs), 50.0), False))
    s = summarize(results, duration)
    assert s["completed"] == 8 and s["failed"] == 1 and s["errors_by_status"] == {"400": 1}
    assert [r.output_tokens for r in results[:8]] == [r.output_len for r in reqs[:8]]  # ignore_eos honoured
    assert [r.prompt_len for r in results[:8]] == [r.prompt_len for r in reqs[:8]]
    assert s["mean_ttft_ms"] > 0 and s["median_itl_ms"] > 0 and s["output_throughput"] > 0
    assert "Output token throughput" in format_summary(s)


def test_bench_serve_command_writes_json(served: tuple[str, Path], tmp_path: Path) -> None:
    url, ckpt = served
    out = tmp_path / "bench.json"
    args = argparse.Namespace(
        base_url=url, model="tiny", dataset="sharegpt", dataset_path=None, num_prompts=6, request_rate=20.0,
        burstiness=1.0, max_concurrency=None, seed=0, tokenizer=str(ckpt), prompt_format="text",
        sharegpt_output_len=None, max_prompt_len=100, max_total_len=130, max_output_len=8, api_key=None,
        poll_metrics=0.05, output_json=str(out), no_progress=True,
    )
    report = asyncio.run(bench_serve(args))
    assert report["completed"] == 6 and report["failed"] == 0
    for key in ("date", "command", "git_commit", "request_throughput", "output_throughput", "mean_ttft_ms",
                "median_tpot_ms", "p99_itl_ms"):
        assert key in report
    assert report["metrics_timeline"] and "rimuru:kv_pages_used" in report["metrics_timeline"][0]


# ---------------------------------------------------------------------------------------------- prefix caching


def _multiturn_sharegpt(path: Path, n: int = 6, turns: int = 4) -> Path:
    """Conversations of `turns` user turns each (the first one with a system message, one that breaks the
    alternation after two turns), words from a fixed list so every tokenizer encodes them."""
    words = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old oak tree".split()
    recs = []
    for i in range(n):
        conv = [{"from": "system", "value": "be brief"}] if i == 0 else []
        for t in range(turns):
            conv.append({"from": "human", "value": " ".join(words[(i + t + j) % len(words)] for j in range(6 + t))})
            conv.append({"from": "gpt", "value": " ".join(words[(2 * i + t + j) % len(words)] for j in range(5))})
        if i == 1:
            conv[4:] = [{"from": "gpt", "value": "two replies in a row"}] + conv[4:]
        recs.append({"id": f"m{i}", "conversations": conv})
    recs.append({"id": "single", "conversations": [{"from": "human", "value": "only one turn here"},
                                                   {"from": "gpt", "value": "and one reply"}]})
    path.write_text(json.dumps(recs))
    return path


def test_shared_prefix_workload_is_deterministic_and_starts_with_the_same_tokens() -> None:
    tok = load_tokenizer(None)
    for n in (1, 7, 64, 1024):
        text, ids = shared_prefix(tok, n, seed=5)
        assert len(ids) == n and tok.encode(text) == ids
    assert shared_prefix(tok, 64, seed=5) == shared_prefix(tok, 64, seed=5) != shared_prefix(tok, 64, seed=6)
    a = sample_shared_prefix(tok, 12, 256, seed=2)
    assert a == sample_shared_prefix(tok, 12, 256, seed=2) and len(a) == 12
    text, ids = shared_prefix(tok, 256, seed=2)
    plain = sample_sharegpt(tok, 12, seed=2)
    for r, p in zip(a, plain, strict=True):
        assert r.prompt_token_ids[:256] == ids and r.prompt_len > 256  # the same first N tokens
        assert tok.encode(r.prompt)[:256] == ids  # the concatenated text too, as a server tokenizes it
        assert r.messages == ({"role": "system", "content": text}, {"role": "user", "content": p.prompt})
        assert r.output_len == p.output_len and r.conversation is None  # ShareGPT's output lengths
    with pytest.raises(ValueError, match="at least one token"):
        shared_prefix(tok, 0)


def test_multiturn_workload_replays_conversations_with_growing_histories(tiny_checkpoint, tmp_path: Path) -> None:
    tok = load_tokenizer(str(tiny_checkpoint("qwen2_moe")))
    data = str(_multiturn_sharegpt(tmp_path / "multi.json"))
    reqs = sample_sharegpt_multiturn(tok, 14, seed=1, path=data, max_prompt_len=400, max_total_len=420)
    assert reqs == sample_sharegpt_multiturn(tok, 14, seed=1, path=data, max_prompt_len=400, max_total_len=420)
    assert reqs != sample_sharegpt_multiturn(tok, 14, seed=2, path=data, max_prompt_len=400, max_total_len=420)
    assert len(reqs) == 14
    convs = [[reqs[i] for i in c] for c in conversation_indices(reqs)]
    assert [r.conversation for c in convs for r in c] == [r.conversation for r in reqs]  # turns stay together
    for c in convs:
        assert [r.turn for r in c] == list(range(len(c)))
        assert len(c) >= 2 or c is convs[-1]  # only the last may be cut by the request count
        for prev, cur in zip(c, c[1:], strict=False):
            assert cur.prompt_token_ids[: prev.prompt_len] == prev.prompt_token_ids  # the history grows
            assert cur.messages[: len(prev.messages)] == prev.messages and len(cur.messages) == len(prev.messages) + 2
            assert cur.messages[len(prev.messages)]["role"] == "assistant"
        for r in c:
            assert [m["role"] for m in r.messages] == ["user", "assistant"] * r.turn + ["user"]
            assert r.prompt.startswith("User: ") and r.prompt.endswith("Assistant:")
            assert tok.encode(r.prompt) == r.prompt_token_ids  # the concatenated text, as a server tokenizes it
    # the record that breaks the alternation keeps its first two turns; the single-turn one is never used
    all_reqs = sample_sharegpt_multiturn(tok, 1000, seed=1, path=data, max_prompt_len=400, max_total_len=420)
    assert sorted(len(c) for c in conversation_indices(all_reqs)) == [2, 4, 4, 4, 4, 4]
    # a tight prompt limit drops the oldest turns: histories stay within it and still end on the user's turn
    tight = sample_sharegpt_multiturn(tok, 1000, seed=1, path=data, max_prompt_len=90, max_total_len=400)
    assert tight and all(r.prompt_len <= 90 for r in tight)
    assert any(len(r.messages) < 2 * r.turn + 1 for r in tight)
    assert all(r.messages[0]["role"] == "user" and r.messages[-1]["role"] == "user" for r in tight)


@pytest.fixture(scope="module")
def served_with_details(tiny_checkpoint) -> Iterator[tuple[str, Path]]:
    """A server (prefix caching on, as by default) whose usage reports prompt_tokens_details.cached_tokens."""
    ckpt = tiny_checkpoint("qwen2_moe")
    engine = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", gpu_memory_budget="64MiB"))
    with BackgroundServer(engine, ServerConfig(served_model_name="tiny", enable_prompt_tokens_details=True)) as srv:
        yield srv.url, ckpt


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_multiturn_turns_go_in_order_each_after_the_previous_finished(
        served_with_details: tuple[str, Path], tmp_path: Path, endpoint: str) -> None:
    url, ckpt = served_with_details
    tok = load_tokenizer(str(ckpt))
    reqs = sample_sharegpt_multiturn(tok, 12, seed=0, path=str(_multiturn_sharegpt(tmp_path / "m.json")),
                                     max_prompt_len=300, max_total_len=320, max_output_len=4)
    convs = conversation_indices(reqs)
    think = 0.05
    cfg = BenchConfig(base_url=url, model="tiny", endpoint=endpoint, think_time_s=think,
                      prompt_format="text" if endpoint == "chat" else "token-ids")
    # every conversation starts at once: they run side by side, each one's turns one after another
    results, duration = asyncio.run(run_benchmark(cfg, reqs, [0.0] * len(convs), False))
    assert all(r.success for r in results), [r.error for r in results]
    for c in convs:
        rs = [results[i] for i in c]
        assert [r.turn for r in rs] == list(range(len(c))) and len({r.conversation for r in rs}) == 1
        for prev, cur in zip(rs, rs[1:], strict=False):
            assert cur.start >= prev.end + think * 0.9  # sent after the previous turn ended, plus the think time
            assert cur.prompt_len > prev.prompt_len  # the server saw the growing history
            assert cur.cached_tokens is not None and cur.cached_tokens >= 16  # a block of the history was cached
    starts = sorted(results[c[0]].start for c in convs)
    assert starts[-1] - starts[0] < min(results[c[0]].end for c in convs) - starts[0]  # conversations overlap
    s = summarize(results, duration)
    assert s["conversations"] == len(convs) and s["cached_tokens_reported"] == len(reqs)
    assert s["total_cached_tokens"] == sum(r.cached_tokens for r in results) > 0
    assert 0 < s["cached_token_fraction"] < 1
    assert s["median_ttft_first_turn_ms"] > 0 and s["median_ttft_later_turns_ms"] > 0
    assert "TTFT, later turns" in format_summary(s)
    with pytest.raises(ValueError, match="arrival times"):
        asyncio.run(run_benchmark(cfg, reqs, [0.0] * len(reqs), False))


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(["--model", "tiny", *argv])


def test_bench_serve_shared_prefix_on_chat_reports_cached_tokens(served_with_details: tuple[str, Path],
                                                                  tmp_path: Path) -> None:
    url, ckpt = served_with_details
    out = tmp_path / "bench.json"
    args = _serve_args("--base-url", url, "--dataset", "shared-prefix", "--shared-prefix-len", "48",
                       "--endpoint", "chat", "--num-prompts", "5", "--request-rate", "inf", "--max-concurrency",
                       "1", "--tokenizer", str(ckpt), "--max-prompt-len", "100", "--max-total-len", "130",
                       "--max-output-len", "4", "--output-json", str(out), "--no-progress")
    report = asyncio.run(bench_serve(args))
    assert report["completed"] == 5 and report["endpoint"] == "chat" and report["shared_prefix_len"] == 48
    assert all(n > 48 for n in report["input_lens"])
    # one at a time: after the first, every request finds the prefix's full blocks cached
    assert report["cached_tokens"][0] == 0 and all(c >= 32 for c in report["cached_tokens"][1:])
    assert report["total_cached_tokens"] == sum(report["cached_tokens"])
    assert report["conversation_ids"] == [None] * 5 and "mean_ttft_first_turn_ms" not in report


def test_bench_serve_flags_that_contradict_stop_with_a_message() -> None:
    def fails(*argv: str, match: str) -> None:
        with pytest.raises(SystemExit, match=match):
            check_serve_args(_serve_args(*argv))

    fails("--shared-prefix-len", "16", match="--shared-prefix-len is for --dataset shared-prefix")
    fails("--dataset", "shared-prefix", "--shared-prefix-len", "0", match="at least 1 token")
    fails("--turn-think-time-s", "1", match="--turn-think-time-s is for --dataset sharegpt-multiturn")
    fails("--dataset", "sharegpt-multiturn", "--turn-think-time-s", "-1", match="must be >= 0")
    fails("--endpoint", "chat", "--prompt-format", "token-ids", match="needs --endpoint completions")
    check_serve_args(_serve_args("--dataset", "sharegpt-multiturn", "--turn-think-time-s", "0.5", "--endpoint",
                                 "chat"))
    with pytest.raises(SystemExit) as err:  # argparse: an unknown dataset or endpoint
        _serve_args("--dataset", "prefix_repetition")
    assert err.value.code == 2
