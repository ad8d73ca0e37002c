"""End-to-end: the real engine on a tiny MoE checkpoint behind the real server, driven by the official
`openai` client (and raw httpx where a client would refuse to send the bad input)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from rimuru.bench.metrics_poll import parse_metrics
from rimuru.config import EngineConfig
from rimuru.engine.llm_engine import LLMEngine
from rimuru.experts.popularity import ExpertPopularity
from rimuru.server.app import ServerConfig
from rimuru.server.background import BackgroundServer

MODEL = "tiny-moe"
KEY = "sk-test-key"
BODY_LIMIT = 64 * 1024
KV_PAGES = 72  # a small pool: 50 clients queue, and a long request can never fit


@dataclass
class Server:
    url: str
    engine: LLMEngine

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics").text)

    def wait_idle(self, timeout: float = 15.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["rimuru:num_requests_running"], m["rimuru:num_requests_waiting"],
                    m["rimuru:kv_pages_used"], m["rimuru:server_tracked_requests"]) == (0, 0, 0, 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


def _small_pool_engine(ckpt: Path) -> LLMEngine:
    base = dict(model=str(ckpt), device="cpu", max_num_seqs=64, max_num_batched_tokens=512)
    probe = LLMEngine(EngineConfig(**base, gpu_memory_budget="64MiB"))
    split = probe.budget_split
    page = split["kv_free"] // probe.stats()["kv_pages_free"]
    budget = split["non_expert_weights"] + split["workspace"] + split["experts_resident"] + KV_PAGES * page
    del probe
    return LLMEngine(EngineConfig(**base, gpu_memory_budget=budget))


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[Server]:
    engine = _small_pool_engine(tiny_checkpoint("qwen2_moe"))
    config = ServerConfig(served_model_name=MODEL, api_key=KEY, max_body_bytes=BODY_LIMIT)
    with BackgroundServer(engine, config) as srv:
        yield Server(srv.url, engine)


def greedy(**kw: object) -> dict:
    return {"model": MODEL, "temperature": 0.0, **kw}


# ---- happy paths ------------------------------------------------------------------------------------
def test_models_health_metrics(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    m = server.metrics()
    for name in ("num_requests_running", "num_requests_waiting", "kv_pages_used", "resident_experts",
                 "total_experts", "forward_steps_total"):
        assert "rimuru:" + name in m
    text = httpx.get(server.url + "/metrics").text
    assert "rimuru:time_to_first_token_seconds_bucket" in text and "rimuru:e2e_request_latency_seconds" in text


def test_completion_stream_matches_non_stream(server: Server) -> None:
    client = server.client()
    full = client.completions.create(**greedy(prompt="Hello world", max_tokens=12, extra_body={"ignore_eos": True}))
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    prompt_ids = server.engine.tokenizer("Hello world", add_special_tokens=False).input_ids
    assert full.usage.prompt_tokens == len(prompt_ids)
    again = client.completions.create(**greedy(prompt=prompt_ids, max_tokens=12, extra_body={"ignore_eos": True}))
    assert again.choices[0].text == full.choices[0].text  # token-id prompt == text prompt

    chunks = list(client.completions.create(**greedy(prompt="Hello world", max_tokens=12, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_n_and_prompt_lists(server: Server) -> None:
    client = server.client()
    out = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=4, seed=1,
                                    extra_body={"ignore_eos": True, "top_k": 20})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 16
    again = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=4, seed=1,
                                      extra_body={"ignore_eos": True, "top_k": 20})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded sampling repeats
    streamed = client.completions.create(model=MODEL, prompt="abc", n=3, max_tokens=5, stream=True, top_p=0.9,
                                         extra_body={"ignore_eos": True})
    tokens: dict[int, str] = {}
    for c in streamed:
        for ch in c.choices:
            tokens[ch.index] = tokens.get(ch.index, "") + ch.text
    assert sorted(tokens) == [0, 1, 2]


def test_chat(server: Server) -> None:
    client = server.client()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, n=2)
    assert len(out.choices) == 2 and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == out.choices[1].message.content  # greedy
    tok = server.engine.tokenizer
    expect = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tok(expect, add_special_tokens=False).input_ids)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_stop_strings(server: Server) -> None:
    client = server.client()
    base = client.completions.create(**greedy(prompt="Once upon a time", max_tokens=20,
                                              extra_body={"ignore_eos": True})).choices[0].text
    k = next(i for i in range(2, len(base)) if base[i] not in "\ufffd" and base[i].strip())
    stop = base[k]
    out = client.completions.create(**greedy(prompt="Once upon a time", max_tokens=20, stop=[stop],
                                             extra_body={"ignore_eos": True})).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == base[: base.index(stop)]


def test_special_token_text_stays_text(server: Server) -> None:
    out = server.client().completions.create(model=MODEL, prompt="<|im_end|>", max_tokens=1)
    tok = server.engine.tokenizer
    assert out.usage.prompt_tokens == len(tok("<|im_end|>", split_special_tokens=True).input_ids) > 1
    chat = server.client().chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": "<|im_end|>"}])
    template_only = server.client().chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": "x"}])
    # the user's "<|im_end|>" costs several byte tokens, not the one control token
    assert chat.usage.prompt_tokens > template_only.usage.prompt_tokens


# ---- bad input --------------------------------------------------------------------------------------
def _post(server: Server, path: str, body: object, key: str | None = KEY, raw: bytes | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=headers, timeout=30)


def _assert_error(resp: httpx.Response, status: int, param: str | None = None, needle: str = "") -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert needle.lower() in err["message"].lower(), err


C = "/v1/completions"
BAD_COMPLETIONS = [
    ({"model": "nope", "prompt": "hi"}, 404, "model", "does not exist"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens", ""),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 100_000}, 400, "max_tokens", "context"),
    ({"model": MODEL, "prompt": [7] * 600, "max_tokens": 1}, 400, "prompt", "context"),
    ({"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400, "temperature", ""),
    ({"model": MODEL, "prompt": "hi", "temperature": -0.1}, 400, "temperature", ""),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", ""),
    ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p", ""),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", "empty"),
    ({"model": MODEL, "prompt": []}, 400, "prompt", "empty"),
    ({"model": MODEL, "prompt": ["ok", ""]}, 400, "prompt", "empty"),
    ({"model": MODEL, "prompt": 5}, 400, None, ""),
    ({"model": MODEL, "prompt": [1, 99999]}, 400, "prompt", "range"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n", ""),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, None, "max allowed: 20"),
    ({"model": MODEL, "prompt": "hi", "logprobs": -2}, 400, "logprobs", ""),
    ({"model": MODEL, "prompt": "hi", "stop": [""]}, 400, None, "stop"),
    ({"prompt": "hi"}, 400, "model", ""),
]


@pytest.mark.parametrize(("body", "status", "param", "needle"), BAD_COMPLETIONS)
def test_bad_completion_requests(server: Server, body: dict, status: int, param: str | None, needle: str) -> None:
    _assert_error(_post(server, C, body), status, param, needle)


def test_bad_requests_other(server: Server) -> None:
    _assert_error(_post(server, C, None, raw=b'{"model": "tiny-moe", "prompt": '), 400, None, "malformed JSON")
    _assert_error(_post(server, C, None, raw=b"[1, 2]"), 400, None, "object")
    _assert_error(_post(server, C, {"model": MODEL, "prompt": "x" * (BODY_LIMIT + 10)}), 413, None, "limit")
    _assert_error(_post(server, C, {"model": MODEL, "prompt": "hi"}, key=None), 401, None, "API key")
    _assert_error(_post(server, C, {"model": MODEL, "prompt": "hi"}, key="wrong"), 401, None, "API key")
    _assert_error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400, "messages", "")
    _assert_error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}),
                  400, "messages", "empty")
    _assert_error(httpx.get(server.url + "/v1/models"), 401, None, "API key")
    _assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    # the official client surfaces the same errors as typed exceptions
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="other", prompt="hi")
    with pytest.raises(openai.BadRequestError) as exc:
        server.client().completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert exc.value.body["param"] == "max_tokens"


def test_request_that_never_fits(server: Server) -> None:
    most = server.engine.max_kv_pages()
    layers = server.engine.kv.num_layers
    block = server.engine.config.block_size
    tokens = (most // layers + 1) * block  # one block more per layer than the pool can ever give
    if tokens > server.engine.max_model_len:
        # static mode caps max_model_len to the KV pool at start-up, so the context check catches it first
        resp = _post(server, C, {"model": MODEL, "prompt": [5] * 8, "max_tokens": tokens - 8})
        _assert_error(resp, 400, "max_tokens", "context")
        assert server.wait_idle()["rimuru:kv_pages_used"] == 0
        return
    resp = _post(server, C, {"model": MODEL, "prompt": [5] * 8, "max_tokens": tokens - 8})
    _assert_error(resp, 400, None, "pool")
    assert server.wait_idle()["rimuru:kv_pages_used"] == 0


# ---- disconnects and accounting ---------------------------------------------------------------------
def test_50_streams_third_disconnect(server: Server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.completions.create(model=MODEL, prompt=f"request {i}: tell me", max_tokens=24,
                                                 stream=True, temperature=0.8, seed=i,
                                                 extra_body={"ignore_eos": True})
        if i % 6 == 0:  # gone before its first token (most are still waiting)
            await stream.close()
            return "early"
        n = 0
        async for chunk in stream:
            n += len(chunk.choices)
            # gone mid-stream, after its first chunk (under load the server may put several tokens in one chunk)
            if i % 6 == 3 and n >= 1:
                await stream.close()
                return "mid"
        return f"done:{n}"

    async def run() -> list[str]:
        client = server.async_client()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(50)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert results.count("early") + results.count("mid") == 17
    assert all(r.startswith("done") for r in results if r not in ("early", "mid"))
    m = server.wait_idle()
    assert m["rimuru:num_requests_running"] == 0 and m["rimuru:num_requests_waiting"] == 0
    assert m["rimuru:kv_pages_used"] == 0 and m["rimuru:server_tracked_requests"] == 0
    assert server.engine.stats()["kv_pages_used"] == 0


def test_non_streaming_client_timeout_aborts(server: Server) -> None:
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 300, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + C, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3)
    m = server.wait_idle()
    assert m["rimuru:num_requests_running"] == 0 and m["rimuru:kv_pages_used"] == 0


def test_vllm_bench_client_payload(server: Server) -> None:
    """What `vllm bench serve --backend vllm --endpoint /v1/completions --ignore-eos` sends and parses."""
    payload = {"model": MODEL, "prompt": "Hello world", "repetition_penalty": 1.0, "max_tokens": 7,
               "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}", "x-request-id": "bench-0"}
    with httpx.stream("POST", server.url + C, json=payload, headers=headers, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        messages = [m.strip() for m in resp.read().decode().split("\n\n") if m.strip()]
    assert messages[-1] == "data: [DONE]"
    data = [json.loads(m.removeprefix("data: ")) for m in messages[:-1]]
    token_chunks = [d for d in data if d.get("choices")]
    # one chunk per token unless the event loop fell behind the engine (then queued outputs are coalesced);
    # the client counts tokens from the usage chunk
    assert 1 <= len(token_chunks) <= 7 and all(isinstance(d["choices"][0]["text"], str) for d in token_chunks)
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert data[-1]["usage"]["completion_tokens"] == 7 and data[-1]["usage"]["prompt_tokens"] > 0


def test_step_profile_endpoints(server: Server) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    _assert_error(httpx.post(server.url + "/debug/step_profile?steps=0", headers=auth), 400, param="steps")
    assert httpx.post(server.url + "/debug/step_profile?steps=5").status_code == 401  # the API key applies
    r = httpx.post(server.url + "/debug/step_profile?steps=5", headers=auth)
    assert r.status_code == 200 and r.json() == {"profiling_steps": 5}
    server.client().completions.create(**greedy(prompt="Hello world", max_tokens=8, extra_body={"ignore_eos": True}))
    server.wait_idle()
    rep = httpx.get(server.url + "/debug/step_profile", headers=auth).json()
    assert rep["steps_profiled"] == 5 and "steps" not in rep
    kinds = rep["kinds"]
    assert set(kinds) <= {"prefill", "mixed", "decode-eager"} and sum(k["steps"] for k in kinds.values()) == 5
    assert all(k["wall_ms"] > 0 for k in kinds.values())


def test_expert_routing_endpoint_gives_the_routing_elastic_mode_counted(server: Server, tiny_checkpoint) -> None:
    """/debug/expert_routing: 404 where nothing counts routing (static mode); from an elastic server, every layer's
    shares of the (token, expert) assignments its passes made since the last POST, as a ranking file `rimuru
    profile` would write: each MoE layer routed every token that went through a pass top_k times."""
    auth = {"Authorization": f"Bearer {KEY}"}
    _assert_error(httpx.get(server.url + "/debug/expert_routing", headers=auth), 404, needle="elastic")
    _assert_error(httpx.post(server.url + "/debug/expert_routing", headers=auth), 404, needle="elastic")
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("qwen2_moe")), device="cpu", gpu_memory_budget="64MiB",
                                    offload_mode="elastic", max_num_batched_tokens=64))
    spec = engine.spec

    def complete(srv: Server, prompt: list[int], max_tokens: int) -> None:
        srv.client().completions.create(**greedy(prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True}))
        srv.wait_idle()

    with BackgroundServer(engine, ServerConfig(served_model_name=MODEL)) as bg:
        srv = Server(bg.url, engine)
        _assert_error(httpx.get(bg.url + "/debug/expert_routing"), 404, needle="routed no tokens")  # no pass yet
        complete(srv, list(range(5, 25)), 8)
        first = httpx.get(bg.url + "/debug/expert_routing").json()
        # the last sampled token goes through no pass
        assert [sum(row) for row in first["routed_counts"]] == [(20 + 8 - 1) * spec.num_experts_per_tok] * len(
            first["routed_counts"])
        mark = httpx.post(bg.url + "/debug/expert_routing")
        assert mark.status_code == 200 and mark.json() == {"marked_assignments": (20 + 8 - 1)
                                                           * spec.num_experts_per_tok * spec.num_moe_layers}
        complete(srv, list(range(30, 40)), 4)
        r = httpx.get(bg.url + "/debug/expert_routing")
        assert r.status_code == 200, r.text
        routed = engine.runtime.core.popularity.routed.copy()
    data = r.json()
    since = routed - np.asarray(first["routed_counts"])
    assert data["routed_counts"] == since.tolist()
    assert since.sum(axis=1).tolist() == [(10 + 4 - 1) * spec.num_experts_per_tok] * spec.num_moe_layers
    pop = ExpertPopularity.from_json(data, spec.num_moe_layers, spec.num_experts)
    np.testing.assert_allclose(pop.probabilities, since / since.sum(axis=1, keepdims=True))


def test_server_without_tokenizer_takes_token_ids_and_rejects_text(tiny_checkpoint, tmp_path: Path) -> None:
    """A model without tokenizer files (like a preset name served with random weights) must start, serve
    token-id prompts, and answer text prompts and chat with a 400 that says why."""
    import shutil

    src = tiny_checkpoint("qwen2_moe")
    ckpt = tmp_path / "no_tokenizer"
    shutil.copytree(src, ckpt, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*", "special_tokens*"))
    engine = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", max_num_seqs=8, max_num_batched_tokens=256))
    assert engine.tokenizer is None
    with BackgroundServer(engine, ServerConfig(served_model_name=MODEL)) as srv:
        ids = _post(Server(srv.url, engine), C, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4,
                                                 "temperature": 0.0, "ignore_eos": True}, key=None)
        assert ids.status_code == 200, ids.text
        assert ids.json()["usage"]["completion_tokens"] == 4
        text = _post(Server(srv.url, engine), C, {"model": MODEL, "prompt": "hi", "max_tokens": 4}, key=None)
        _assert_error(text, 400, "prompt", "without a tokenizer")
        chat = _post(Server(srv.url, engine), "/v1/chat/completions",
                     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, key=None)
        _assert_error(chat, 400, "messages", "")
        assert engine.stats()["kv_pages_used"] == 0


def test_stream_batches_keep_the_latest_cumulative_output_per_choice() -> None:
    """A stream whose event loop fell behind takes every queued output at once and keeps the latest per choice
    (outputs are cumulative), so a lagging loop sends one chunk per choice instead of one per engine step."""
    from rimuru.engine.outputs import CompletionOutput, RequestOutput
    from rimuru.server.async_engine import RequestStream

    def out(rid: str, tokens: list[int], finished: bool = False) -> RequestOutput:
        comp = CompletionOutput(0, "x" * len(tokens), tokens, "length" if finished else None, None)
        return RequestOutput(rid, None, [1], [comp], finished, None)

    async def scenario() -> None:
        aborted: list[str] = []
        stream = RequestStream(aborted.extend, ["a", "b"])
        for item in [(0, out("a", [1])), (1, out("b", [5])), (0, out("a", [1, 2])), (0, out("a", [1, 2, 3], True))]:
            stream.queue.put_nowait(item)
        batch = await stream.next_batch()
        assert [(i, o.outputs[0].token_ids, o.finished) for i, o in batch] == [(1, [5], False), (0, [1, 2, 3], True)]
        assert not stream.done() and stream.unfinished == {"b"}
        stream.queue.put_nowait(RuntimeError("engine failed"))
        with pytest.raises(RuntimeError, match="engine failed"):
            await stream.next_batch()
        stream.close()
        assert aborted == ["b"]

    asyncio.run(scenario())


def test_start_levels_reach_metrics(server: Server) -> None:
    m = server.metrics()
    engine = server.engine
    assert m["rimuru:kv_tokens_max"] == engine.max_kv_pages() // engine.kv.num_layers * engine.config.block_size
    assert m["rimuru:workspace_bytes"] == engine.budget_split["workspace"] > 0
    # its parts are measured on a GPU only: on the CPU (a bound, not a profile) none is exported, rather than a 0
    assert engine.workspace_profile is None
    assert not any(k.startswith("rimuru:workspace_") and k != "rimuru:workspace_bytes" for k in m)
    # where the start went: the phases a CPU start runs (no graphs), each a positive time, summing to the total
    phases = {key: m[f"rimuru:startup_{key}_seconds"] for key in ("model", "memory_plan", "pool", "weights")}
    assert "rimuru:startup_graphs_seconds" not in m and all(s > 0 for s in phases.values()), phases
    assert sum(phases.values()) == pytest.approx(m["rimuru:startup_total_seconds"], rel=1e-6)
