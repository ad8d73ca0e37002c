"""vLLM's metric names on /metrics: the real engine on a tiny checkpoint behind the real server, scraped after
an aborted stream, a prompt sent twice (the second hits the prefix cache) and an n=2 request; a fake engine for
the failed-step path. The reference lists below are vLLM's default /metrics names, so a dump from a real vLLM
can be diffed against them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rimuru.config import EngineConfig
from rimuru.engine.llm_engine import LLMEngine
from rimuru.server.app import ServerConfig
from rimuru.server.background import BackgroundServer
from rimuru.server.metrics import ServerMetrics, buckets_1_2_5
from tests.test_server_fake_engine import FakeEngine, FakeTokenizer

MODEL = "tiny-moe"
LABELS = {"model_name": MODEL, "engine": "0"}

# vLLM 0.26's default /metrics (PrometheusStatLogger, no LoRA, speculative decoding, KV connector or KV residency
# flags), as exposed: counters with `_total`, histograms by family name. VLLM_DUMP is such a /metrics of a real
# vLLM 0.26 server (Qwen1.5-MoE shapes, prefix caching on, after a serving point), and these lists are checked
# against it.
VLLM_DUMP = (Path(__file__).resolve().parents[1] / "benchmarks/results"
             / "2026-12-06-vllm-0.26-metrics-shared-prefix-20rps-h100.txt")
VLLM_GAUGES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason",
               "vllm:kv_cache_usage_perc", "vllm:engine_sleep_state", "vllm:cache_config_info"}
VLLM_COUNTERS = {"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
                 "vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_cached_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:estimated_flops_per_gpu_total",
                 "vllm:estimated_read_bytes_per_gpu_total", "vllm:estimated_write_bytes_per_gpu_total"}
VLLM_HISTOGRAMS = {"vllm:iteration_tokens_total", "vllm:time_to_first_token_seconds",
                   "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
                   "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                   "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
                   "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                   "vllm:request_max_num_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
                   "vllm:request_prefill_kv_computed_tokens"}
# what we leave out, and why
NOT_EXPOSED = {
    "vllm:engine_sleep_state": "no sleep mode: the engine is always awake",
    "vllm:cache_config_info": "its labels are vLLM's CacheConfig fields; our KV capacity is not a config value",
    "vllm:external_prefix_cache_queries_total": "no KV connector",
    "vllm:external_prefix_cache_hits_total": "no KV connector",
    "vllm:mm_cache_queries_total": "no multimodal inputs",
    "vllm:mm_cache_hits_total": "no multimodal inputs",
    "vllm:estimated_flops_per_gpu_total": "vLLM's analytic per-step performance model; the rimuru: expert and "
                                          "pool metrics count the bytes the engine really moves",
    "vllm:estimated_read_bytes_per_gpu_total": "as estimated_flops_per_gpu",
    "vllm:estimated_write_bytes_per_gpu_total": "as estimated_flops_per_gpu",
}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> tuple[dict[str, str], Samples]:
    """{exposed name: type} of the vllm: families, and every sample by (name, sorted labels)."""
    return parse(httpx.get(url + "/metrics").text)


def parse(text: str) -> tuple[dict[str, str], Samples]:
    types: dict[str, str] = {}
    samples: Samples = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("vllm:") and not fam.name.endswith("_created"):
            types[fam.name + "_total" if fam.type == "counter" else fam.name] = fam.type
        for s in fam.samples:
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, tuple(sorted({**LABELS, **labels}.items()))]


def wait_idle(url: str, timeout: float = 30.0) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        _, s = scrape(url)
        busy = (value(s, "vllm:num_requests_running"), value(s, "vllm:num_requests_waiting"),
                s["rimuru:server_tracked_requests", (("model_name", MODEL),)])
        if busy == (0, 0, 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture(scope="module")
def url(tiny_checkpoint) -> Iterator[str]:
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("qwen2_moe")), device="cpu",
                                    gpu_memory_budget="64MiB"))
    with BackgroundServer(engine, ServerConfig(served_model_name=MODEL)) as srv:
        yield srv.url


def _complete(url: str, prompt: list[int], n: int = 1, max_tokens: int = 4) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "n": n,
            "ignore_eos": True}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _abort_after_first_token(url: str) -> None:
    """A streaming client that leaves once it has a token, long before its 300 tokens."""
    body = {"model": MODEL, "prompt": [7] * 20, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                break


def test_counts_of_an_abort_a_prefix_hit_and_n_choices(url: str) -> None:
    _abort_after_first_token(url)
    deadline = time.monotonic() + 30
    while value(before := wait_idle(url), "vllm:request_success_total", finished_reason="abort") < 1:
        assert time.monotonic() < deadline, "the abort was never counted"
    # the aborted request: counted once, in every per-request histogram (it got a token, so in TTFT too)
    for reason, count in (("abort", 1), ("stop", 0), ("length", 0), ("error", 0), ("repetition", 0)):
        assert value(before, "vllm:request_success_total", finished_reason=reason) == count
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert value(before, f"vllm:{name}_count") == 1, name
    assert value(before, "vllm:request_prompt_tokens_sum") == 20 and value(before, "vllm:prompt_tokens_total") == 20
    aborted_tokens = value(before, "vllm:request_generation_tokens_sum")
    assert 1 <= aborted_tokens < 300 and value(before, "vllm:generation_tokens_total") == aborted_tokens
    assert ("rimuru:request_finished_total", (("finish_reason", "abort"), ("model_name", MODEL))) not in before

    prompt = list(range(3, 3 + 40))  # two full 16-token blocks and a partial one
    first, again = _complete(url, prompt), _complete(url, prompt)
    both = _complete(url, list(range(50, 70)), n=2, max_tokens=3)
    after = wait_idle(url)
    usages = [r["usage"] for r in (first, again, both)]

    # tokens: what the responses reported; vLLM counts an n=2 request's prompt once per choice
    assert delta(after, before, "vllm:prompt_tokens_total") == 40 + 40 + 2 * 20
    assert [u["prompt_tokens"] for u in usages] == [40, 40, 20]
    assert delta(after, before, "vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 14
    # the repeat found the first one's two full blocks
    hits = delta(after, before, "vllm:prefix_cache_hits_total")
    assert hits >= 32 and delta(after, before, "vllm:prefix_cache_queries_total") >= 40 + 40 + 2 * 20
    cached = delta(after, before, "vllm:prompt_tokens_cached_total")
    assert cached >= 32
    assert delta(after, before, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert delta(after, before, "vllm:prompt_tokens_by_source_total", source="local_compute") == 120 - cached
    assert value(after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert delta(after, before, "vllm:request_prefill_kv_computed_tokens_sum") == 120 - cached
    assert delta(after, before, "vllm:request_success_total", finished_reason="length") == 4
    # every engine request that ended is in every per-request histogram, once
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_params_max_tokens", "request_prefill_kv_computed_tokens"):
        assert delta(after, before, f"vllm:{name}_count") == 4, name
    assert delta(after, before, "vllm:request_params_max_tokens_sum") == 4 + 4 + 3 + 3
    # n and the most tokens of a choice: once per prompt, when all its choices have ended
    assert delta(after, before, "vllm:request_params_n_count") == 3
    assert delta(after, before, "vllm:request_params_n_sum") == 1 + 1 + 2
    assert delta(after, before, "vllm:request_max_num_generation_tokens_sum") == 4 + 4 + 3
    # one inter-token gap per token after a request's first; a pass's tokens: prompt tokens computed + one
    # decode token per generated token after the first
    assert delta(after, before, "vllm:inter_token_latency_seconds_count") == 14 - 4
    assert delta(after, before, "vllm:iteration_tokens_total_sum") == (120 - cached) + (14 - 4)
    assert delta(after, before, "vllm:iteration_tokens_total_count") >= 4
    # the rimuru: figures are of finished requests, as they always were
    assert after["rimuru:request_finished_total", (("finish_reason", "length"), ("model_name", MODEL))] == 4
    assert value(after, "vllm:num_preemptions_total") == 0
    assert 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1


def test_names_types_and_labels_are_vllms(url: str) -> None:
    _complete(url, [9] * 5)
    types, samples = scrape(url)
    reference = ({n: "gauge" for n in VLLM_GAUGES} | {n: "counter" for n in VLLM_COUNTERS}
                 | {n: "histogram" for n in VLLM_HISTOGRAMS})
    missing = set(reference) - set(types) - set(NOT_EXPOSED)
    assert not missing, f"vLLM names we do not expose: {sorted(missing)}"
    assert set(types) <= set(reference), f"vllm: names vLLM does not have: {sorted(set(types) - set(reference))}"
    assert {name: reference[name] for name in types} == types
    for (name, labels), _ in samples.items():
        if name.startswith("vllm:"):
            assert dict(labels)["model_name"] == MODEL and dict(labels)["engine"] == "0", (name, labels)
        elif name.startswith("rimuru:"):
            assert dict(labels)["model_name"] == MODEL, (name, labels)
    # vLLM's buckets: its request-latency ones, and 1-2-5 token counts up to max_model_len
    assert ("vllm:e2e_request_latency_seconds_bucket", tuple(sorted({**LABELS, "le": "7680.0"}.items()))) in samples
    les = sorted(float(dict(labels)["le"]) for (name, labels) in samples
                 if name == "vllm:request_prompt_tokens_bucket" and dict(labels)["le"] != "+Inf")
    assert les == [1, 2, 5, 10, 20, 50, 100, 200, 500]  # max_model_len 512
    # the rimuru: figures vLLM also has stay, beside vLLM's
    assert ("rimuru:num_requests_running", (("model_name", MODEL),)) in samples
    assert ("rimuru:num_preemptions_total", (("model_name", MODEL),)) in samples


def test_the_reference_is_what_a_real_vllm_exposes() -> None:
    """The lists above against the committed /metrics of vLLM 0.26: every vllm: family, its type and its labels."""
    types, samples = parse(VLLM_DUMP.read_text())
    reference = ({n: "gauge" for n in VLLM_GAUGES} | {n: "counter" for n in VLLM_COUNTERS}
                 | {n: "histogram" for n in VLLM_HISTOGRAMS})
    assert types == reference
    for (name, labels), _ in samples.items():
        if name.startswith("vllm:") and not name.startswith("vllm:cache_config_info"):
            keys = {k for k, _ in labels} - {"le", "finished_reason", "reason", "source", "sleep_state"}
            assert keys == {"model_name", "engine"}, (name, labels)
    # the label values our families take are vLLM's
    reasons = {dict(labels)["finished_reason"] for (name, labels) in samples if name == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    sources = {dict(labels)["source"] for (name, labels) in samples if name == "vllm:prompt_tokens_by_source_total"}
    assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}
    waiting = {dict(labels)["reason"] for (name, labels) in samples if name == "vllm:num_requests_waiting_by_reason"}
    assert waiting == {"capacity", "deferred"}


def test_buckets_1_2_5() -> None:
    assert buckets_1_2_5(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert buckets_1_2_5(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_kv_usage_and_waiting_reasons_from_the_snapshot() -> None:
    """kv_cache_usage_perc: pages held over pages requests could hold now (held + free or cached)."""
    stats = {"running": 2, "waiting": 3, "kv_pages_used": 30, "kv_pages_free": 90, "preemptions": 1}
    text = ServerMetrics(lambda: stats, MODEL, 512).render().decode()
    lab = 'engine="0",model_name="tiny-moe"'
    assert f"vllm:kv_cache_usage_perc{{{lab}}} 0.25" in text
    assert f'vllm:num_requests_waiting_by_reason{{{lab},reason="capacity"}} 3.0' in text
    assert f'vllm:num_requests_waiting_by_reason{{{lab},reason="deferred"}} 0.0' in text
    assert f"vllm:num_preemptions_total{{{lab}}} 1.0" in text
    assert 'rimuru:num_preemptions_total{model_name="tiny-moe"} 1.0' in text


class _FailingEngine(FakeEngine):
    """Its second step fails: the request it was running ends with the step."""

    def __init__(self) -> None:
        super().__init__(FakeTokenizer())
        self.steps = 0

    def step(self) -> list:
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("boom")
        return super().step()


def test_a_failed_step_counts_as_error() -> None:
    with BackgroundServer(_FailingEngine(), ServerConfig(served_model_name=MODEL)) as srv:
        resp = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 5})
        assert resp.status_code == 500
        _, s = scrape(srv.url)
    assert value(s, "vllm:request_success_total", finished_reason="error") == 1
    assert value(s, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(s, "vllm:time_to_first_token_seconds_count") == 1  # its first step gave a token
    assert ("vllm:kv_cache_usage_perc", tuple(sorted(LABELS.items()))) not in s  # a fake engine reports no pages
