"""Workload sampling (ShareGPT, Poisson) and the serving client against the real server on a tiny model."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rimuru.bench.cli import bench_serve
from rimuru.bench.serve_client import BenchConfig, format_summary, run_benchmark, summarize
from rimuru.bench.workload import (
    SampleRequest,
    is_valid_pair,
    iter_sharegpt,
    load_tokenizer,
    poisson_arrivals,
    sample_sharegpt,
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
