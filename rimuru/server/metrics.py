"""Prometheus metrics (`/metrics`): vLLM's names, and ours beside them.

    vllm:*    what vLLM 0.26's PrometheusStatLogger exposes by default, with its names, types, label names
              (model_name = the served model name, engine = "0") and buckets, so a vLLM dashboard reads this server
    rimuru:*  what vLLM has no name for (the page pool, resident experts, PCIe bytes, the adjusters' view) and our
              older names of figures vLLM also has; labelled model_name

Engine state is read from the engine thread's latest `stats()` snapshot at scrape time by collectors, so scraping
never calls into the engine; tokens per engine step are read from its step ring at scrape time (a copy, never a
call). Per-request figures are observed when a request ends (`observe_finished`, on the engine thread), aborted
and failed ones included. Each app has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rimuru.engine.startup_clock import PHASE_KEYS
from rimuru.engine.step_metrics import StepMetrics, StepMetricsRing
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
    "state_bytes_used": ("state_bytes_used", "Pool bytes held by hybrid models' per-request state pages (ssm, conv)."),
    "resident_experts": ("resident_experts", "Routed experts resident in the pool (all layers)."),
    "total_experts": ("total_experts", "Routed experts of the model (all layers)."),
    "peak_running": ("num_requests_running_peak", "Most requests ever running at once."),
    "server_tracked_requests": ("server_tracked_requests", "Engine requests the server still routes."),
    "kv_tokens_max": ("kv_tokens_max", "KV tokens the pool could give requests with every allowed expert evicted."),
    "workspace_bytes": ("workspace_bytes", "Activation workspace the budget reserves (measured at start on a GPU)."),
    "workspace_forward_bytes": ("workspace_forward_bytes", "Workspace profile: the eager pass of the largest step."),
    "workspace_graphs_bytes": ("workspace_graphs_bytes", "Workspace profile: the CUDA graphs' memory pool."),
    "workspace_sampling_bytes": ("workspace_sampling_bytes", "Workspace profile: sampling beside the graphs."),
    "workspace_outside_bytes": ("workspace_outside_bytes",
                                "Workspace profile: device memory the passes made outside torch's allocator."),
    "kernel_warmup_s": ("kernel_warmup_seconds", "Start-up's kernel warm-up (passes building Triton kernel variants)."),
    "kernel_warmup_variants": ("kernel_warmup_variants", "Triton kernel variants the start-up warm-up built."),
    **{f"startup_{key}_s": (f"startup_{key}_seconds", f"Engine start-up: seconds of its {key} phase.")
       for key in PHASE_KEYS},
    "startup_total_s": ("startup_total_seconds", "Engine start-up: seconds from building the model to ready."),
    "piecewise_overhead_ms": ("piecewise_overhead_ms", "Elastic: measured extra time of a piecewise-graph pass."),
    "expert_copy_bandwidth": ("expert_copy_bytes_per_second",
                              "Elastic: host-to-device expert copy bandwidth measured at start-up (bytes/s)."),
    "cost_compute_ms": ("cost_compute_ms", "Cost adjuster: compute estimate of its last plan (copy-free passes)."),
    "cost_copy_overlap": ("cost_copy_overlap", "Cost adjuster: measured share of compute the copies hide behind."),
    "cost_copy_slowdown": ("cost_copy_slowdown", "Cost adjuster: measured copy time over nominal (>= 1)."),
    "cost_copy_excess": ("cost_copy_excess", "Cost adjuster: experts copied per routed offloaded expert (>= 1)."),
    "cost_read_excess": ("cost_read_excess",
                         "Cost adjuster: offloaded experts read per read its estimate expected (>= 1; direct access)."),
    "cost_target_offloaded": ("cost_target_offloaded", "Cost adjuster: offloaded experts its last plan aims for."),
    "cost_max_offloaded": ("cost_max_offloaded", "Cost adjuster: most offloaded experts stalls may wait for."),
    "cost_expected_reads": ("cost_expected_reads",
                            "Cost adjuster: offloaded experts its model expects a decode step to read (last plan)."),
    "cost_tpot_correction": ("cost_tpot_correction",
                             "Cost adjuster, TPOT SLO: measured TPOT p99 over the SLO, accumulated (>= 1)."),
    "cost_grow_reserve_mid_pages": ("cost_grow_reserve_mid_pages",
                                    "Cost adjuster: mid pages kept from admissions for grows."),
}
COUNTERS = {
    "forward_steps": ("forward_steps", "Engine forward steps."),
    "preemptions": ("num_preemptions", "Requests preempted for lack of pages."),
    "kernel_variants_built": ("kernel_variants_built",
                              "Triton kernel variants steps built after start-up (each step waited for its builds)."),
    "expert_bytes_loaded": ("expert_bytes_loaded", "Expert bytes copied host->device (PCIe)."),
    "expert_evictions": ("expert_evictions", "Experts evicted from the pool."),
    "expert_grows": ("expert_grows", "Experts brought back into the pool."),
    "kv_pages_moved": ("kv_pages_moved", "KV pages moved by compaction to make whole mid pages for grows."),
    "expert_reranks": ("expert_reranks", "Times the resident expert set was re-ranked."),
    "cost_plans_held": ("cost_plans_held", "Cost adjuster: steps whose plan was the last one held, its model not run."),
    "prefetch_hits": ("prefetch_hits", "Routed experts that the predictor had prefetched."),
    "prefetch_misses": ("prefetch_misses", "Routed experts loaded on demand."),
    "expert_host_reads_decode": ("expert_host_reads_decode",
                                 "Direct access: offloaded experts decode passes read in host memory."),
    "expert_host_reads_mixed": ("expert_host_reads_mixed",
                                "Direct access: offloaded experts passes with prefill tokens read in host memory."),
    "offloaded_passes_decode": ("offloaded_passes_decode", "Direct access: decode passes with any expert offloaded."),
    "offloaded_passes_mixed": ("offloaded_passes_mixed",
                               "Direct access: passes with prefill tokens and any expert offloaded."),
    "cpu_expert_tokens": ("cpu_expert_tokens", "Expert-token computations the host ran instead of the GPU."),
    "cpu_experts_computed": ("cpu_experts_computed", "Routed offloaded experts computed on the host, not copied."),
    "cpu_expert_bytes_not_copied": ("cpu_expert_bytes_not_copied",
                                    "Expert bytes kept off PCIe by computing them on the host."),
    "cpu_expert_compute_s": ("cpu_expert_compute_seconds", "Host seconds spent computing experts (with transfers)."),
}
# the server's token counters in the snapshot (AsyncEngine): exposed under vLLM's names only
SERVER_TOKEN_COUNTS = ("server_prompt_tokens", "server_prompt_tokens_cached", "server_generation_tokens")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)

# ---- vLLM's label names and buckets ----------------------------------------------------------------
VLLM_LABELS = ["model_name", "engine"]
VLLM_ENGINE = "0"  # one engine core: vLLM's label for data-parallel rank 0
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason, all pre-created
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts (max_value: max_model_len)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return out
            out.append(mantissa * scale)
        scale *= 10


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _one(fam: GaugeMetricFamily | CounterMetricFamily, labels: list[str], value: float) -> Metric:
    fam.add_metric(labels, float(value))
    return fam


class _RimuruStatsCollector(Collector):
    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        model = [self._model]
        for key, value in self._stats().items():
            if key in SERVER_TOKEN_COUNTS:
                continue
            if key in COUNTERS:
                name, doc = COUNTERS[key]
                if _is_number(value):
                    yield _one(CounterMetricFamily(PREFIX + name, doc, labels=["model_name"]), model, value)
                continue
            name, doc = GAUGES.get(key, (key, f"Engine statistic {key}."))
            if _is_number(value):
                yield _one(GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"]), model, value)
            elif isinstance(value, list | tuple) and all(_is_number(v) for v in value):
                # per-layer values (e.g. resident experts of each MoE layer)
                fam = GaugeMetricFamily(PREFIX + name, doc + " Per layer.", labels=["model_name", "layer"])
                for i, v in enumerate(value):
                    fam.add_metric([self._model, str(i)], float(v))
                yield fam
                if key == "resident_experts":
                    yield _one(GaugeMetricFamily(PREFIX + "resident_experts_total", doc, labels=["model_name"]),
                               model, sum(value))


class _VllmStatsCollector(Collector):
    """vLLM's engine-level gauges and counters, from the same snapshot; a figure the engine does not report (a fake
    engine) is left out rather than shown as 0."""

    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self._stats = stats
        self._labels = [model_name, VLLM_ENGINE]

    def collect(self) -> Iterator[Metric]:
        s, labels = self._stats(), self._labels

        def gauge(name: str, doc: str, value: float) -> Metric:
            return _one(GaugeMetricFamily(name, doc, labels=VLLM_LABELS), labels, value)

        def counter(name: str, doc: str, key: str) -> Iterator[Metric]:
            if _is_number(s.get(key)):
                yield _one(CounterMetricFamily(name, doc, labels=VLLM_LABELS), labels, s[key])

        if _is_number(s.get("running")):
            yield gauge("vllm:num_requests_running", "Requests in the running batch.", s["running"])
        if _is_number(s.get("waiting")):
            yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s["waiting"])
            # every waiting request here waits for capacity (KV pages, max_num_seqs, the token budget): nothing
            # defers a request for a transient reason (vLLM's LoRA budget, KV transfer), so 'deferred' stays 0
            fam = GaugeMetricFamily("vllm:num_requests_waiting_by_reason",
                                    "Waiting requests by why they wait: 'capacity' (pages, batch limits) or "
                                    "'deferred' (transient constraints; none here). They sum to "
                                    "vllm:num_requests_waiting.", labels=[*VLLM_LABELS, "reason"])
            fam.add_metric([*labels, "capacity"], float(s["waiting"]))
            fam.add_metric([*labels, "deferred"], 0.0)
            yield fam
        used, free = s.get("kv_pages_used"), s.get("kv_pages_free")
        if _is_number(used) and _is_number(free):
            # the pool's KV capacity is not fixed: evicting experts adds pages, growing them takes pages back
            yield gauge("vllm:kv_cache_usage_perc",
                        "KV pages held by requests over the KV pages requests could hold now (held + free + "
                        "cached for no request), 0..1. The denominator moves with the expert split: evicting "
                        "experts raises it, growing them lowers it.", used / (used + free) if used + free else 0.0)
        yield from counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           "prefix_cache_queries")
        yield from counter("vllm:prefix_cache_hits", "Prompt tokens the prefix cache had.", "prefix_cache_hits")
        yield from counter("vllm:num_preemptions", "Requests preempted for lack of KV pages (recomputed later).",
                           "preemptions")
        yield from counter("vllm:prompt_tokens", "Prompt tokens of requests whose prefill finished (each choice "
                           "of an n>1 request counts its prompt).", "server_prompt_tokens")
        yield from counter("vllm:prompt_tokens_cached", "Of those, tokens the prefix cache gave.",
                           "server_prompt_tokens_cached")
        yield from counter("vllm:generation_tokens", "Tokens generated, counted as they are produced.",
                           "server_generation_tokens")
        prompt, cached = s.get("server_prompt_tokens"), s.get("server_prompt_tokens_cached")
        if _is_number(prompt) and _is_number(cached):
            fam = CounterMetricFamily("vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from: "
                                      "computed here, the local prefix cache, or another instance (never here).",
                                      labels=[*VLLM_LABELS, "source"])
            for source, value in (("local_compute", prompt - cached), ("local_cache_hit", cached),
                                  ("external_kv_transfer", 0)):
                fam.add_metric([*labels, source], float(value))
            yield fam


class _VllmRequestMetrics:
    """vLLM's per-request histograms and counters. Times (RequestTiming: arrival A, first scheduled S, first token
    F, last token L, end E), as vLLM defines them: TTFT F-A, e2e E-A, queue S-A, prefill F-S, decode L-F,
    inference L-S, time per output token (L-F)/(tokens-1), inter-token latency the gap between outputs that bring
    tokens. An ended request is observed in all of them but TTFT and the prefill's computed tokens, which need its
    first token; a phase it never reached counts 0."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        labels = [model_name, VLLM_ENGINE]
        tokens = buckets_1_2_5(max_model_len)

        def hist(name: str, doc: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
            return Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=registry).labels(*labels)

        success = Counter("vllm:request_success", "Ended requests by finish reason (abort: the client went away "
                          "or cancelled; error: the engine step failed).", [*VLLM_LABELS, "finished_reason"],
                          registry=registry)
        self.success = {reason: success.labels(*labels, reason) for reason in FINISHED_REASONS}
        self.ttft = hist("vllm:time_to_first_token_seconds", "Arrival to first token, seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between two outputs of a request that bring "
                        "tokens, seconds.", TOKEN_LATENCY_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Per request: first to last token over the "
                         "tokens after the first, seconds (0 with one token).", TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to end, seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to first scheduled, seconds.",
                          REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to first token, seconds.",
                            REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to last token, seconds.",
                           REQUEST_LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "First scheduled to last token, seconds.",
                              REQUEST_LATENCY_BUCKETS)
        self.prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.generation = hist("vllm:request_generation_tokens", "Generated tokens per request.", tokens)
        self.kv_computed = hist("vllm:request_prefill_kv_computed_tokens", "Prompt tokens per request whose KV the "
                                "prefill computed (the rest came from the prefix cache).", tokens)
        self.max_tokens = hist("vllm:request_params_max_tokens", "The max_tokens of each request (resolved: the "
                               "context left when none was given).", tokens)
        self.n = hist("vllm:request_params_n", "The n of each prompt of a request (observed once its n choices "
                      "have ended).", N_BUCKETS)
        self.most_tokens = hist("vllm:request_max_num_generation_tokens", "The most tokens one of a prompt's n "
                                "choices generated.", tokens)
        self.iteration = hist("vllm:iteration_tokens_total", "Tokens in each engine step's forward pass (prefill "
                              "chunks and decode tokens).", ITERATION_TOKEN_BUCKETS)

    def observe(self, req: FinishedRequest) -> None:
        t, end = req.timing, req.finished_at
        first, last = t.first_token, t.last_token
        # an engine that reports no scheduling time (a fake one) but produced tokens: scheduled on arrival
        scheduled = t.scheduled if t.scheduled is not None else (t.arrival if first is not None else None)
        if scheduled is None:  # ended before the server saw it scheduled: it queued until the end
            queue, prefill, inference = end - t.arrival, 0.0, 0.0
        else:
            queue = scheduled - t.arrival
            prefill = (first if first is not None else end) - scheduled
            inference = (last if last is not None else end) - scheduled
        decode = last - first if first is not None and last is not None else 0.0
        self.success[req.finish_reason if req.finish_reason in self.success else "error"].inc()
        self.e2e.observe(end - t.arrival)
        self.queue.observe(queue)
        self.prefill.observe(prefill)
        self.decode.observe(decode)
        self.inference.observe(inference)
        self.tpot.observe(decode / (t.num_tokens - 1) if t.num_tokens > 1 else 0.0)
        for gap in t.token_gaps:
            self.itl.observe(gap)
        self.prompt.observe(req.prompt_tokens)
        self.generation.observe(t.num_tokens)
        self.max_tokens.observe(req.max_tokens)
        if first is not None:
            self.ttft.observe(first - t.arrival)
            self.kv_computed.observe(req.prompt_tokens - t.cached_tokens)
        choices = req.choices
        if choices is not None and choices.unfinished == 0:
            self.n.observe(choices.n)
            self.most_tokens.observe(choices.most_tokens)

    def observe_steps(self, steps: list[StepMetrics]) -> None:
        for step in steps:
            if step.num_tokens:  # a step that ran no pass (only aborts, or nothing fit) is no iteration
                self.iteration.observe(step.num_tokens)


class ServerMetrics:
    """`steps`: the engine's per-step ring (LLMEngine.step_metrics), read at each render for the steps since the
    last one; None (a fake engine): vllm:iteration_tokens_total stays empty."""

    def __init__(self, stats: Callable[[], dict], model_name: str, max_model_len: int,
                 steps: StepMetricsRing | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_RimuruStatsCollector(stats, model_name))
        self.registry.register(_VllmStatsCollector(stats, model_name))
        r = self.registry
        self.vllm = _VllmRequestMetrics(r, model_name, max_model_len)
        self._steps = steps
        self._last_step: StepMetrics | None = None
        self._render_lock = threading.Lock()
        model = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", model,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Mean time per output token after the first.",
                              model, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.", model,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.finished = Counter(PREFIX + "request_finished", "Finished engine requests by reason.",
                                [*model, "finish_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", model,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens of finished requests.",
                                         model, registry=r).labels(model_name)
        self.http_errors = Counter(PREFIX + "http_errors", "Error responses by status.", [*model, "status"],
                                   registry=r)
        self._model = model_name

    def observe_finished(self, req: FinishedRequest) -> None:
        self.vllm.observe(req)
        if req.finish_reason in ("abort", "error"):  # the rimuru: figures have always been of finished requests
            return
        t = req.timing
        self.e2e.observe(req.finished_at - t.arrival)
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
            if t.num_tokens > 1:
                self.tpot.observe((req.finished_at - t.first_token) / (t.num_tokens - 1))
        self.finished.labels(self._model, req.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(req.prompt_tokens)
        self.generation_tokens.inc(t.num_tokens)

    def count_error(self, status: int) -> None:
        self.http_errors.labels(self._model, str(status)).inc()

    def render(self) -> bytes:
        with self._render_lock:
            self.vllm.observe_steps(self._new_steps())
            return generate_latest(self.registry)

    def _new_steps(self) -> list[StepMetrics]:
        """The steps the ring gained since the last render, found by the last one seen (the ring drops its
        oldest steps, so indices move; a step object does not)."""
        if self._steps is None:
            return []
        try:
            # one C-level copy, with the GIL held throughout: the engine thread cannot append in the middle
            steps = list(self._steps.steps)
        except RuntimeError:  # it did (an interpreter without a GIL): these steps wait for the next render
            return []
        start = len(steps)
        while start > 0 and steps[start - 1] is not self._last_step:
            start -= 1  # not found (first render, or more new steps than the ring holds): all are new
        if steps:
            self._last_step = steps[-1]
        return steps[start:]
