"""Prometheus metrics (`/metrics`), vLLM-like names prefixed `rimuru:`.

Engine state (running/waiting requests, KV pages, resident experts, PCIe bytes, ...) is read from
the engine thread's latest `stats()` snapshot at scrape time by a custom collector, so scraping
never touches the engine. Per-request latencies are histograms observed when a request finishes.
Each app has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rimuru.server.async_engine import FinishedRequest

PREFIX = "rimuru:"

# stats() key -> (metric name, help); gauges are levels, counters only grow.
GAUGES = {
    "running": ("num_requests_running", "Requests in the running batch."),
    "waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_pages_used": ("kv_pages_used", "KV-cache pages held by requests."),
    "pool_bytes": ("pool_bytes", "Bytes in the unified page pool."),
    "free_bytes": ("pool_free_bytes", "Free bytes in the page pool."),
    "kv_bytes_used": ("kv_bytes_used", "Pool bytes held by KV-cache pages."),
    "expert_bytes_used": ("expert_bytes_used", "Pool bytes held by expert pages (resident experts, load buffers)."),
    "resident_experts": ("resident_experts", "Routed experts resident in the pool (all layers)."),
    "total_experts": ("total_experts", "Routed experts of the model (all layers)."),
    "peak_running": ("num_requests_running_peak", "Most requests ever running at once."),
    "server_tracked_requests": ("server_tracked_requests", "Engine requests the server still routes."),
    "piecewise_overhead_ms": ("piecewise_overhead_ms", "Elastic: measured extra time of a piecewise-graph pass."),
    "cost_compute_ms": ("cost_compute_ms", "Cost adjuster: compute estimate of its last plan (copy-free passes)."),
    "cost_copy_overlap": ("cost_copy_overlap", "Cost adjuster: measured share of compute the copies hide behind."),
    "cost_copy_slowdown": ("cost_copy_slowdown", "Cost adjuster: measured copy time over nominal (>= 1)."),
    "cost_copy_excess": ("cost_copy_excess", "Cost adjuster: experts copied per routed offloaded expert (>= 1)."),
    "cost_target_offloaded": ("cost_target_offloaded", "Cost adjuster: offloaded experts its last plan aims for."),
    "cost_max_offloaded": ("cost_max_offloaded", "Cost adjuster: most offloaded experts stalls may wait for."),
    "cost_grow_reserve_mid_pages": ("cost_grow_reserve_mid_pages",
                                    "Cost adjuster: mid pages kept from admissions for grows."),
}
COUNTERS = {
    "forward_steps": ("forward_steps", "Engine forward steps."),
    "preemptions": ("num_preemptions", "Requests preempted for lack of pages."),
    "expert_bytes_loaded": ("expert_bytes_loaded", "Expert bytes copied host->device (PCIe)."),
    "expert_evictions": ("expert_evictions", "Experts evicted from the pool."),
    "expert_grows": ("expert_grows", "Experts brought back into the pool."),
    "expert_reranks": ("expert_reranks", "Times the resident expert set was re-ranked."),
    "prefetch_hits": ("prefetch_hits", "Routed experts that the predictor had prefetched."),
    "prefetch_misses": ("prefetch_misses", "Routed experts loaded on demand."),
}

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for key, value in stats.items():
            if key in COUNTERS:
                name, doc = COUNTERS[key]
                if _is_number(value):
                    yield CounterMetricFamily(PREFIX + name, doc, value=float(value))
                continue
            name, doc = GAUGES.get(key, (key, f"Engine statistic {key}."))
            if _is_number(value):
                yield GaugeMetricFamily(PREFIX + name, doc, value=float(value))
            elif isinstance(value, list | tuple) and all(_is_number(v) for v in value):
                # per-layer values (e.g. resident experts of each MoE layer)
                fam = GaugeMetricFamily(PREFIX + name, doc + " Per layer.", labels=["layer"])
                for i, v in enumerate(value):
                    fam.add_metric([str(i)], float(v))
                yield fam
                if key == "resident_experts":
                    yield GaugeMetricFamily(PREFIX + "resident_experts_total", doc, value=float(sum(value)))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats))
        r = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to last token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.finished = Counter(
            PREFIX + "request_finished", "Finished engine requests by reason.", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=r)
        self.http_errors = Counter(PREFIX + "http_errors", "Error responses by status.", ["status"], registry=r)

    def observe_finished(self, req: FinishedRequest) -> None:
        t = req.timing
        self.e2e.observe(req.finished_at - t.arrival)
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
            if t.num_tokens > 1:
                self.tpot.observe((req.finished_at - t.first_token) / (t.num_tokens - 1))
        self.finished.labels(req.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(req.prompt_tokens)
        self.generation_tokens.inc(t.num_tokens)

    def count_error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
