"""Streaming, disconnects, engine failures and metric types of the OpenAI server: each test starts the real
server on a tiny model and drives it with the official `openai` client (or raw httpx)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from rimuru.bench.metrics_poll import parse_metrics
from rimuru.config import EngineConfig
from rimuru.engine.llm_engine import LLMEngine
from rimuru.server.app import ServerConfig
from rimuru.server.background import BackgroundServer

MODEL = "tiny-moe"


@dataclass
class Server:
    url: str
    engine: LLMEngine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics").text)


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[Server]:
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("qwen2_moe")), device="cpu", max_num_seqs=16,
                                    max_num_batched_tokens=512, gpu_memory_budget="64MiB"))
    with BackgroundServer(engine, ServerConfig(served_model_name=MODEL)) as srv:
        yield Server(srv.url, engine)


def _token_deltas(server: Server, prompt: str, max_tokens: int) -> list[str]:
    """The text each token adds (one streamed chunk per token), greedy, EOS ignored."""
    stream = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    return [c.choices[0].text for c in stream if c.choices]


def test_stream_never_sends_the_start_of_a_stop_string(server: Server) -> None:
    """A stop string whose first character comes with one token and the rest with a later one: the
    streamed deltas must add up to the non-streamed text (vLLM holds back a possible stop-string prefix)."""
    prompt = "Once upon a time"
    deltas = _token_deltas(server, prompt, 40)
    base = "".join(deltas)
    stop = None
    end = 0
    for j, d in enumerate(deltas):
        end += len(d)
        nxt = next((x for x in deltas[j + 1 :] if x), "")
        if d and nxt and base.find(d[-1] + nxt[0]) == end - 1:
            stop = d[-1] + nxt[0]
            break
    assert stop is not None, deltas
    client = server.client()
    kw = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0]
    assert full.finish_reason == "stop" and full.text == base[: base.index(stop)]
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == full.text
    assert chunks[-1].choices[0].finish_reason == "stop"

    chat_kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=40, temperature=0,
                   extra_body={"ignore_eos": True})
    cbase = client.chat.completions.create(**chat_kw).choices[0].message.content
    cstop = next((cbase[i : i + 2] for i in range(1, len(cbase) - 1) if cbase.find(cbase[i : i + 2]) == i), None)
    if cstop:
        cfull = client.chat.completions.create(**chat_kw, stop=[cstop]).choices[0].message.content
        cstream = client.chat.completions.create(**chat_kw, stop=[cstop], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in cstream if c.choices) == cfull


def test_non_streaming_disconnect_aborts_while_tokens_flow(server: Server) -> None:
    """A non-streaming client that goes away must abort its requests even though outputs keep arriving
    (the disconnect check must not depend on a pause in the engine's outputs)."""
    body = {"model": MODEL, "prompt": "a long one", "n": 4, "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    t0 = time.monotonic()
    deadline = t0 + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["rimuru:num_requests_running"] == 0 and m["rimuru:server_tracked_requests"] == 0:
            break
        time.sleep(0.05)
    took = time.monotonic() - t0
    finished = server.engine.stats()
    assert took < 1.5, f"requests ran on {took:.1f}s after the client left: {finished}"


def test_failed_engine_step_errors_the_request_and_the_server_goes_on(server: Server) -> None:
    engine = server.engine
    real_step = engine.step
    calls = {"n": 0}

    def failing_step():  # noqa: ANN202
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    engine.step = failing_step  # type: ignore[method-assign]
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 20, "ignore_eos": True}
        resp = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code == 500 and "boom" in resp.json()["error"]["message"]
        with pytest.raises(openai.APIError):
            for _ in server.client().completions.create(model=MODEL, prompt="hi", max_tokens=20, stream=True,
                                                        extra_body={"ignore_eos": True}):
                calls["n"] = 2  # the next step fails mid-stream
    finally:
        engine.step = real_step  # type: ignore[method-assign]
    out = server.client().completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert out.usage.completion_tokens >= 1
    assert httpx.get(server.url + "/health").status_code == 200


def test_metric_types(server: Server) -> None:
    """Counts that only grow are Prometheus counters (`_total`), levels are gauges."""
    text = httpx.get(server.url + "/metrics").text
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    assert "expert_reranks" in server.engine.stats()
    for name in ("forward_steps", "num_preemptions", "expert_bytes_loaded", "expert_evictions", "expert_grows",
                 "expert_reranks", "prefetch_hits", "prefetch_misses"):
        assert "counter" in (types.get("rimuru:" + name), types.get(f"rimuru:{name}_total")), (name, types)
    for name in ("num_requests_running", "num_requests_waiting", "kv_pages_used"):
        assert types.get("rimuru:" + name) == "gauge", (name, types)
