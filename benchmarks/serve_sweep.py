"""Serving rate sweep: for each server configuration, start it once, replay ShareGPT at each request rate.

One process drives the whole sweep: for every configuration (`--configs`) it starts a server (Rimuru
`static` / `fixed` / `elastic-paper` / `elastic-cost` / `elastic` / `elastic-slo`, or vLLM at 32 GiB / unlimited),
waits for `/health`, and for every rate (`--rates`) runs a benchmark client on identical ShareGPT
requests (same dataset, `--num-prompts`, `--seed`, EOS ignored): ours (`rimuru bench serve`) by
default, or vLLM's own (`vllm bench serve --backend vllm`) with `--client vllm`. While a point runs,
a poller samples the server's Prometheus `/metrics` (both `rimuru:` and `vllm:` names) for the peak
running / waiting requests and a memory timeline; `/metrics` counters read before and after each point
give the expert bytes copied over PCIe, the prefetch hit rate and the prefix-cache hit rate (prompt tokens
the prefix cache had over those looked up: `vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`, the names
both engines expose) of that point alone. The prefix-caching workloads are the client's
(`--client-args "--dataset shared-prefix"` or `"--dataset sharegpt-multiturn"`).

The result is ONE JSON (run metadata from benchmarks/common.metadata: device, date, commit -- RIMURU_COMMIT
on a machine without git history -- exact command; plus one row per (config, rate)), rewritten after
every point so a run cut short keeps what it measured. A server that fails to start, a client that
fails and a point skipped for lack of time each leave a row with `status` != "ok" and the reason; the
sweep goes on. Every server and client this script starts is stopped on exit, on errors, on timeouts
and on SIGTERM / SIGINT / SIGHUP; servers listen on 127.0.0.1 only. The one exception is `--detach`: it
starts the (single) configuration's server in its own session and exits, so the server outlives a device
call whose 10 minutes cannot hold its start and a point (vLLM with `--cpu-offload-gb` on Qwen3); the next
call's sweep with the same flags and `--attach` measures on it and stops it.

    PYTHONPATH=. python benchmarks/serve_sweep.py --configs static,vllm --rates 10,20 --num-prompts 500 \\
        --client vllm --output-json $OUT/sweep.json --time-budget-s 560

Configurations (add more with `--define NAME=rimuru:FLAGS` or `NAME=vllm:FLAGS`):
    static, fixed, elastic-paper, elastic-cost   rimuru serve --offload-mode ... [--adjuster paper|cost]
    elastic, elastic-slo                         elastic's defaults; with --slo-ttft-p99-ms 2000 --slo-tpot-p99-ms 50
    vllm, vllm-unlimited                         vLLM's OpenAI server at --gpu-memory-budget | at 0.9 of the GPU
A vLLM configuration that does not set --gpu-memory-utilization gets the budget as a share of the GPU's memory (what
CUDA reports, the figure vLLM multiplies, recorded as gpu_total_bytes): 32 GiB is 0.2288 of an H200 and about 0.40 of an
H100 80GB, so both engines hold the same memory on whichever card the run gets.
`--plot-from A.json [B.json ...] --plot out.png` only draws (throughput and TTFT p50 against rate).
Beside it: sweep_processes.py (starting, detaching, adopting and stopping servers), sweep_plots.py (the
plots), result_files.py (the run, i.e. the code, a committed result file measured).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slo import TPOT_P99_SLO_MS, TTFT_P99_SLO_MS  # noqa: E402
from sweep_plots import plot, plot_memory  # noqa: E402
from sweep_processes import (  # noqa: E402
    DetachedServer,
    SweepError,
    free_port,
    is_healthy,
    log_tail,
    port_is_free,
    process_start_ticks,
    start_detached,
    start_process,
    stop_process,
    wait_healthy,
)

REPO = Path(__file__).resolve().parents[1]
ANCHOR_MODEL = Path("/tmp/anchor/qwen15moe")  # vllm-anchor's model folder (config.json + tokenizer)
ANCHOR_DATA = Path("/tmp/anchor/sharegpt.json")
VLLM_SITE = Path("/tmp/site")  # where gpu-install.sh puts vLLM's wheels
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_USE_FLASHINFER_SAMPLER": "0"}

BUILTIN_CONFIGS: dict[str, tuple[str, list[str]]] = {
    "static": ("rimuru", ["--offload-mode", "static"]),
    "fixed": ("rimuru", ["--offload-mode", "fixed", "--resident-experts", "0.85"]),  # 51 of 60 (Qwen1.5-MoE)
    "elastic-paper": ("rimuru", ["--offload-mode", "elastic", "--adjuster", "paper"]),
    "elastic-cost": ("rimuru", ["--offload-mode", "elastic", "--adjuster", "cost"]),
    "elastic": ("rimuru", ["--offload-mode", "elastic"]),  # the default adjuster and limit
    # the targets the serving benchmarks judge by (a rate's SLO: TTFT p99 and TPOT p99, benchmarks/common.py)
    "elastic-slo": ("rimuru", ["--offload-mode", "elastic", "--slo-ttft-p99-ms", f"{TTFT_P99_SLO_MS:g}",
                               "--slo-tpot-p99-ms", f"{TPOT_P99_SLO_MS:g}"]),
    "vllm": ("vllm", []),  # --gpu-memory-utilization from --gpu-memory-budget (vllm_memory_flags)
    "vllm-unlimited": ("vllm", ["--gpu-memory-utilization", "0.9"]),
}

# Every row carries these keys (None where not measured), whatever its status.
ROW_FIELDS = (
    "config", "server", "rate", "num_prompts", "client", "status", "error",
    "completed", "failed", "duration_s", "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "median_itl_ms", "p99_itl_ms", "peak_running", "peak_waiting", "expert_bytes_pcie", "prefetch_hits",
    "prefetch_misses", "prefetch_hit_rate", "preemptions", "forward_steps", "kernel_variants_built",
    "kernel_warmup_s", "kernel_warmup_variants",
    "expert_evictions", "expert_grows", "kv_pages_moved",
    "piecewise_overhead_ms", "expert_copy_bandwidth", "kv_tokens_max", "workspace_bytes", "workspace_parts",
    "startup_phases", "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_hit_rate", "total_input_tokens", "total_cached_tokens", "median_ttft_first_turn_ms",
    "median_ttft_later_turns_ms", "p99_ttft_first_turn_ms", "p99_ttft_later_turns_ms", "point_wall_s", "timeline",
)
_SUMMARY_KEYS = ("completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
                 "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                 "median_itl_ms", "p99_itl_ms", "total_input_tokens",
                 # our client: prefix-cache tokens the server reported, TTFT of first and later turns (multi-turn)
                 "total_cached_tokens", "median_ttft_first_turn_ms", "median_ttft_later_turns_ms",
                 "p99_ttft_first_turn_ms", "p99_ttft_later_turns_ms")


# ---------------------------------------------------------------------------------------------- metrics

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]?Inf)(\s+\d+)?$")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, label sets of one name summed (per-layer series, vLLM's engine labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None:
            continue
        value = float(m.group(3))
        if math.isnan(value):
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def metric(values: dict[str, float], *names: str) -> float | None:
    """The first of `names` present (each also tried with the `_total` suffix prometheus_client adds to counters)."""
    for name in names:
        for key in (name, name + "_total"):
            if key in values:
                return values[key]
    return None


def running_waiting(values: dict[str, float]) -> tuple[float | None, float | None]:
    return (metric(values, "rimuru:num_requests_running", "vllm:num_requests_running"),
            metric(values, "rimuru:num_requests_waiting", "vllm:num_requests_waiting"))


def save_metrics_text(base_url: str, path: Path, timeout: float = 3.0) -> None:
    """The server's /metrics exposition as it is, into `path` (what a dashboard would scrape: names, labels, help)."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as resp:  # noqa: S310 - 127.0.0.1 only
            text = resp.read().decode("utf-8", errors="replace")
    except (OSError, urllib.error.URLError) as e:
        text = f"# /metrics could not be read: {e}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def scrape(base_url: str, timeout: float = 3.0) -> dict[str, float]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as resp:  # noqa: S310 - 127.0.0.1 only
        return parse_prometheus(resp.read().decode("utf-8", errors="replace"))


_TIMELINE = {  # timeline key -> metric names (first present wins)
    "running": ("rimuru:num_requests_running", "vllm:num_requests_running"),
    "waiting": ("rimuru:num_requests_waiting", "vllm:num_requests_waiting"),
    "kv_pages_used": ("rimuru:kv_pages_used",),
    "pool_free_bytes": ("rimuru:pool_free_bytes",),
    "kv_bytes_used": ("rimuru:kv_bytes_used",),
    "expert_bytes_used": ("rimuru:expert_bytes_used",),
    "state_bytes_used": ("rimuru:state_bytes_used",),  # hybrid models' ssm and conv pages
    "resident_experts": ("rimuru:resident_experts_total", "rimuru:resident_experts"),
    "cost_compute_ms": ("rimuru:cost_compute_ms",),
    "cost_copy_overlap": ("rimuru:cost_copy_overlap",),
    "cost_copy_slowdown": ("rimuru:cost_copy_slowdown",),
    "cost_copy_excess": ("rimuru:cost_copy_excess",),
    "cost_read_excess": ("rimuru:cost_read_excess",),  # direct access: measured reads over the estimate's
    "cost_target_offloaded": ("rimuru:cost_target_offloaded",),
    "cost_grow_reserve_mid_pages": ("rimuru:cost_grow_reserve_mid_pages",),
    "cost_tpot_correction": ("rimuru:cost_tpot_correction",),  # with a TPOT SLO: measured p99 over it, learned
    "expert_bytes_loaded": ("rimuru:expert_bytes_loaded",),
    # beside expert_bytes_loaded and forward_steps (the reads a step made), what the adjuster's model expected
    "cost_expected_reads": ("rimuru:cost_expected_reads",),
    "forward_steps": ("rimuru:forward_steps",),
    # direct access: offloaded experts read in host memory, and the passes with experts out, by kind of pass
    **{f"{name}_{kind}": (f"rimuru:{name}_{kind}",)
       for name in ("expert_host_reads", "offloaded_passes") for kind in ("decode", "mixed")},
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}


class MetricsPoller:
    """Samples /metrics every `interval` s in a thread: peaks of running / waiting and a compact timeline."""

    def __init__(self, base_url: str, interval: float) -> None:
        self.base_url = base_url
        self.interval = interval
        self.peak_running: float | None = None
        self.peak_waiting: float | None = None
        self.timeline: dict[str, list[float | None]] = {"t": [], **{k: [] for k in _TIMELINE}}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-poller", daemon=True)

    def _loop(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            try:
                values = scrape(self.base_url, timeout=min(3.0, self.interval * 4))
            except (OSError, urllib.error.URLError, ValueError):
                values = None
            if values is not None:
                run, wait = running_waiting(values)
                if run is not None:
                    self.peak_running = max(self.peak_running or 0.0, run)
                if wait is not None:
                    self.peak_waiting = max(self.peak_waiting or 0.0, wait)
                self.timeline["t"].append(round(time.monotonic() - t0, 3))
                for key, names in _TIMELINE.items():
                    self.timeline[key].append(metric(values, *names))
            self._stop.wait(self.interval)

    def __enter__(self) -> MetricsPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def compact_timeline(self) -> dict[str, list[float | None]]:
        return {k: v for k, v in self.timeline.items() if any(x is not None for x in v)}


def _debug_route(base_url: str, path: str, post: bool = False) -> dict[str, Any] | None:
    """A Rimuru debug route's JSON (server/debug_routes.py); None when the server has no answer (not Rimuru, or
    nothing to report)."""
    try:
        req = urllib.request.Request(f"{base_url}{path}", method="POST" if post else "GET")
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - 127.0.0.1 only
            return json.loads(resp.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None


def step_profile(base_url: str, start_steps: int | None = None) -> dict[str, Any] | None:
    """Rimuru's serving step profiler (`/debug/step_profile`): starts it for `start_steps` steps, or reads its
    report (per step kind: host phases, GPU forward time, expert waits). None when the server has none."""
    if start_steps is not None:
        return _debug_route(base_url, f"/debug/step_profile?steps={start_steps}", post=True)
    return _debug_route(base_url, "/debug/step_profile")


def expert_routing(base_url: str, mark: bool = False) -> dict[str, Any] | None:
    """Rimuru's routing (`/debug/expert_routing`, elastic mode): `mark` starts counting from now; else the routing
    since the mark, as a ranking file (`rimuru simulate --expert-ranking`, `regime_map.py build --routing-profile`).
    None when the server counts none."""
    return _debug_route(base_url, "/debug/expert_routing", post=mark)


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    def delta(*names: str) -> float | None:
        a, b = metric(after, *names), metric(before, *names)
        return None if a is None or b is None else a - b

    hits, misses = delta("rimuru:prefetch_hits"), delta("rimuru:prefetch_misses")
    rate = hits / (hits + misses) if hits is not None and misses is not None and hits + misses > 0 else None
    # prompt tokens the prefix cache had over those looked up; a server with prefix caching off looks up none
    # (both counters stay), which counts as a hit rate of 0
    prefix_q = delta("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")  # the latter: older vLLM
    prefix_h = delta("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
    prefix_rate = (None if prefix_q is None or prefix_h is None
                   else prefix_h / prefix_q if prefix_q > 0 else 0.0)
    return {
        "expert_bytes_pcie": delta("rimuru:expert_bytes_loaded"),
        "prefetch_hits": hits,
        "prefetch_misses": misses,
        "prefetch_hit_rate": rate,
        "preemptions": delta("rimuru:num_preemptions", "vllm:num_preemptions"),
        "forward_steps": delta("rimuru:forward_steps"),
        "kernel_variants_built": delta("rimuru:kernel_variants_built"),  # steps that waited for a Triton build
        "expert_evictions": delta("rimuru:expert_evictions"),
        "expert_grows": delta("rimuru:expert_grows"),
        "kv_pages_moved": delta("rimuru:kv_pages_moved"),  # KV compaction for experts coming home
        # elastic with graphs: what the engine measured at start-up (a level, not a delta)
        "piecewise_overhead_ms": metric(after, "rimuru:piecewise_overhead_ms"),
        "expert_copy_bandwidth": metric(after, "rimuru:expert_copy_bytes_per_second"),  # bytes/s, elastic
        "kv_tokens_max": metric(after, "rimuru:kv_tokens_max"),
        "workspace_bytes": metric(after, "rimuru:workspace_bytes"),
        # its measured parts (GPU): forward, graphs, sampling, outside torch (engine/workspace_profile.py)
        "workspace_parts": {part: metric(after, f"rimuru:workspace_{part}_bytes")
                            for part in ("forward", "graphs", "sampling", "outside")},
        # the engine's start-up by phase (rimuru/engine/startup_clock.py's keys), and in all
        "startup_phases": {name[len("rimuru:startup_"):-len("_seconds")]: value for name, value in after.items()
                           if name.startswith("rimuru:startup_") and name.endswith("_seconds")} or None,
        "kernel_warmup_s": metric(after, "rimuru:kernel_warmup_seconds"),  # levels fixed at start
        "kernel_warmup_variants": metric(after, "rimuru:kernel_warmup_variants"),
        "prefix_cache_queries": prefix_q,
        "prefix_cache_hits": prefix_h,
        "prefix_cache_hit_rate": prefix_rate,
    }


# ---------------------------------------------------------------------------------------------- sweep


def detached_record_path(log_dir: str, name: str) -> Path:
    """Where `--detach` leaves what `--attach` needs to adopt its server (pid, start time, command, GPUs)."""
    return Path(log_dir) / f"server-{name}.detached.json"


@dataclass
class Config:
    name: str
    server: str  # rimuru | vllm
    flags: list[str]


@dataclass
class Sweep:
    args: argparse.Namespace
    meta: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    servers: dict[str, dict[str, Any]] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    start_s_seen: list[float] = field(default_factory=list)
    _gpu_total: int | None = None  # bytes, gpu_total_bytes()
    tail_s_seen: list[float] = field(default_factory=list)

    # -- output

    def write(self) -> None:
        path = Path(self.args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {**self.meta, "elapsed_s": round(time.monotonic() - self.started, 1), "servers": self.servers,
               "rows": self.rows}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=float) + "\n")
        os.replace(tmp, path)

    def add_row(self, cfg: Config, rate: float, status: str, error: str | None = None, **values: Any) -> None:
        row: dict[str, Any] = dict.fromkeys(ROW_FIELDS)
        row.update(config=cfg.name, server=cfg.server, rate=rate, num_prompts=self.args.num_prompts,
                   client=self.args.client, status=status, error=error, label=self.args.label)
        row.update(values)
        self.rows.append(row)
        self.write()
        if status == "ok":
            print(f"[sweep] {cfg.name} @ {rate:g} req/s: " + ", ".join(
                f"{k} {_fmt(row[k])}" for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                                "p99_tpot_ms", "peak_running", "peak_waiting", "expert_bytes_pcie",
                                                "prefetch_hit_rate", "prefix_cache_hit_rate")), flush=True)
        else:
            print(f"[sweep] {cfg.name} @ {rate:g} req/s: {status}: {(error or '').splitlines()[0][:300]}", flush=True)

    # -- time budget

    def remaining_s(self) -> float:
        if self.args.time_budget_s is None:
            return math.inf
        return self.args.time_budget_s - (time.monotonic() - self.started)

    def point_estimate_s(self, rate: float) -> float:
        arrivals = self.args.num_prompts / rate if rate > 0 and math.isfinite(rate) else 0.0
        return arrivals + max(self.tail_s_seen, default=self.args.tail_estimate_s)

    def start_estimate_s(self) -> float:
        return max(self.start_s_seen, default=self.args.start_estimate_s)

    # -- commands

    def env_for(self, server: str, client: bool = False) -> dict[str, str]:
        """The environment of a server (`client`: of a benchmark client). A Rimuru server runs the code under
        --server-root (default: this tree), so two versions can be measured by one client."""
        env = dict(os.environ)
        root = REPO if client else self.root_for(server)
        paths = [str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if server == "vllm":
            env.update(VLLM_ENV)
            if self.args.vllm_site:
                paths.append(self.args.vllm_site)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def root_for(self, server: str) -> Path:
        """Where a server runs from (its cwd and the head of its PYTHONPATH: `python -m` imports from the cwd)."""
        return Path(self.args.server_root).resolve() if server == "rimuru" else REPO

    def server_command(self, cfg: Config, port: int) -> list[str]:
        a = self.args
        if cfg.server == "rimuru":
            model = str(Path(a.model).resolve()) if Path(a.model).exists() else a.model  # cwd may be another tree
            return [sys.executable, "-m", "rimuru.cli", "serve", model, "--load-format", a.load_format,
                    "--gpu-memory-budget", a.gpu_memory_budget, "--device", a.device, *cfg.flags,
                    *shlex.split(a.rimuru_args), "--host", "127.0.0.1", "--port", str(port),
                    "--served-model-name", a.served_model_name, "--log-level", "warning"]
        extra = shlex.split(a.vllm_args)
        memory = [] if sets_vllm_memory([*cfg.flags, *extra]) else \
            vllm_memory_flags(budget_bytes(a.gpu_memory_budget), self.gpu_total_bytes())
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model, "--load-format",
                a.load_format, *memory, *cfg.flags, "--max-model-len", str(a.vllm_max_model_len), *extra,
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", a.served_model_name]

    def gpu_total_bytes(self) -> int:
        """The memory of the GPU the servers see (CUDA_VISIBLE_DEVICES as set), as CUDA reports it; read once, in a
        child process, so that this process never holds a CUDA context beside the servers."""
        if self._gpu_total is None:
            why = ""
            try:
                probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info()[1])"],
                                       env=self.env_for("rimuru", client=True), capture_output=True, text=True,
                                       timeout=300)
                lines = probe.stdout.strip().splitlines()
                if probe.returncode == 0 and lines and lines[-1].isdigit():
                    self._gpu_total = int(lines[-1])
                else:
                    why = (probe.stderr.strip().splitlines() or lines or ["no output"])[-1]
            except subprocess.TimeoutExpired:
                why = "the probe did not answer in 300 s"
            if self._gpu_total is None:
                raise SystemExit(f"serve_sweep: cannot read the GPU's memory, which vLLM's --gpu-memory-utilization "
                                 f"is a share of ({why}); give the vLLM configuration its own "
                                 f"--gpu-memory-utilization")
        return self._gpu_total

    def client_command(self, base_url: str, rate: float, num_prompts: int, seed: int, out_dir: Path) -> list[str]:
        a = self.args
        if a.client == "vllm":
            cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
                   "--base-url", base_url, "--endpoint", "/v1/completions", "--model", a.served_model_name,
                   "--tokenizer", a.tokenizer or a.model, "--dataset-name", "sharegpt", "--dataset-path",
                   str(a.dataset_path), "--num-prompts", str(num_prompts), "--request-rate", f"{rate:g}",
                   "--seed", str(seed), "--ignore-eos", "--save-result", "--result-dir", str(out_dir),
                   "--result-filename", "result.json", "--percentile-metrics", "ttft,tpot,itl,e2el",
                   "--metric-percentiles", "50,99"]
        else:
            cmd = [sys.executable, "-m", "rimuru.cli", "bench", "serve", "--base-url", base_url, "--model",
                   a.served_model_name, "--num-prompts", str(num_prompts), "--request-rate", f"{rate:g}",
                   "--seed", str(seed), "--output-json", str(out_dir / "result.json"), "--no-progress"]
            if a.dataset_path:
                cmd += ["--dataset-path", str(a.dataset_path)]
            if a.tokenizer:
                cmd += ["--tokenizer", a.tokenizer]
            cmd += prompt_format_args(a.model)
        return cmd + shlex.split(a.client_args)

    # -- one point

    def run_client(self, cfg: Config, base_url: str, rate: float, num_prompts: int, seed: int,
                   timeout_s: float, server: subprocess.Popen | DetachedServer) -> dict[str, Any]:
        """Runs one client pass; returns its normalised summary. Raises SweepError on failure."""
        with tempfile.TemporaryDirectory(prefix="sweep-client-") as tmp:
            out_dir = Path(tmp)
            log_path = out_dir / "client.log"
            cmd = self.client_command(base_url, rate, num_prompts, seed, out_dir)
            proc = start_process(cmd, self.env_for("vllm" if self.args.client == "vllm" else "rimuru", client=True),
                                 log_path)
            try:
                deadline = time.monotonic() + timeout_s
                while proc.poll() is None:
                    if server.poll() is not None:
                        raise SweepError(f"server exited with code {server.returncode} during the point")
                    if time.monotonic() > deadline:
                        raise SweepError(f"client ran past {timeout_s:.0f} s (killed)\n{log_tail(log_path)}")
                    time.sleep(0.2)
            finally:
                stop_process(proc, grace_s=5)
            result_path = out_dir / "result.json"
            if not result_path.exists():
                raise SweepError(f"client exited with code {proc.returncode} and wrote no result\n"
                                 f"{log_tail(log_path)}")
            return normalise_result(json.loads(result_path.read_text()), num_prompts)

    def run_config(self, cfg: Config, rates: list[float]) -> None:
        a = self.args
        if cfg.server == "vllm" and not self.vllm_ok:
            for rate in rates:
                self.add_row(cfg, rate, "error", f"vLLM is not importable (PYTHONPATH + --vllm-site {a.vllm_site})")
            return
        if cfg.server == "vllm" and not Path(a.model).is_dir():
            for rate in rates:
                self.add_row(cfg, rate, "error", f"vLLM needs a model directory, got {a.model!r}")
            return
        if a.detach:
            self.detach_server(cfg, rates)
            return
        launched_at = None  # an attached server's launch, on the wall clock (it started in another process)
        if a.attach:
            adopted = self.attached_server(cfg, rates)
            if adopted is None:
                return
            server, log_path, launched_at = adopted
            port, t0 = a.port, time.monotonic()
            info = self.servers[cfg.name]
        else:
            need = self.start_estimate_s() + self.point_estimate_s(rates[0])
            if self.remaining_s() < need:
                for rate in rates:
                    self.add_row(cfg, rate, "skipped", f"time budget: {self.remaining_s():.0f} s left, "
                                                       f"~{need:.0f} s needed to start the server and run a point")
                return
            port = a.port or free_port()
            if not port_is_free(port):
                for rate in rates:
                    self.add_row(cfg, rate, "error", f"port {port} on 127.0.0.1 is already in use")
                return
            log_path = Path(a.log_dir) / f"server-{cfg.name}.log"
            cmd = self.server_command(cfg, port)
            info = {"command": shlex.join(cmd), "port": port, "log": str(log_path)}
            self.servers[cfg.name] = info
            print(f"[sweep] {time.monotonic() - self.started:.1f} s: starting {cfg.name}: {shlex.join(cmd)}",
                  flush=True)
            t0 = time.monotonic()
            server = start_process(cmd, self.env_for(cfg.server), log_path, cwd=self.root_for(cfg.server))
        base_url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_healthy(base_url, server, min(a.server_timeout_s, max(self.remaining_s() - 5, 1)), log_path)
            except SweepError as err:
                tail = log_tail(log_path)
                info["error"], info["log_tail"] = str(err), tail
                for rate in rates:
                    self.add_row(cfg, rate, "error", f"server failed to start: {err}\n{tail}")
                return
            if launched_at is None:
                info["start_s"] = round(time.monotonic() - t0, 1)
                self.start_s_seen.append(info["start_s"])
            else:
                info["start_s"] = round(time.time() - launched_at, 1)
            print(f"[sweep] {cfg.name} healthy after {info['start_s']} s", flush=True)
            if a.warmup_prompts > 0:
                try:
                    tw = time.monotonic()
                    self.run_client(cfg, base_url, math.inf, a.warmup_prompts, a.seed + 1,
                                    min(a.point_timeout_s, max(self.remaining_s() - 5, 1)), server)
                    info["warmup_s"] = round(time.monotonic() - tw, 1)
                except SweepError as err:
                    info["warmup_error"] = str(err)[:2000]
            for i, rate in enumerate(rates):
                if server.poll() is not None:
                    for r in rates[i:]:
                        self.add_row(cfg, r, "error", f"server exited with code {server.returncode}\n"
                                                      f"{log_tail(log_path)}")
                    return
                need = self.point_estimate_s(rate)
                if self.remaining_s() < need:
                    for r in rates[i:]:
                        self.add_row(cfg, r, "skipped", f"time budget: {self.remaining_s():.0f} s left, "
                                                        f"~{self.point_estimate_s(r):.0f} s needed")
                    return
                self.run_point(cfg, base_url, rate, server, log_path)
        finally:
            print(f"[sweep] stopping {cfg.name}", flush=True)
            stop_process(server)
            deadline = time.monotonic() + 15
            while not port_is_free(port) and time.monotonic() < deadline:
                time.sleep(0.5)
            info["stopped"] = port_is_free(port) and server.poll() is not None
            info["log_tail"] = info.get("log_tail") or log_tail(log_path, 15)
            if a.attach:  # measured and stopped: no later --attach may adopt this pid again
                with contextlib.suppress(OSError):
                    record = detached_record_path(a.log_dir, cfg.name)
                    record.rename(record.with_name(record.name.replace(".detached.", ".stopped.")))
            self.write()

    def detach_server(self, cfg: Config, rates: list[float]) -> None:
        """`--detach`: start the server in its own session and return at once, leaving a record for a
        later `--attach` sweep (the device's next call) that measures on it. No ok rows: nothing is measured."""
        a = self.args
        if not port_is_free(a.port):
            for rate in rates:
                self.add_row(cfg, rate, "error", f"--detach: port {a.port} on 127.0.0.1 is already in use")
            return
        log_path = Path(a.log_dir) / f"server-{cfg.name}.log"
        cmd = self.server_command(cfg, a.port)
        env = self.env_for(cfg.server)
        pid = start_detached(cmd, env, log_path, cwd=self.root_for(cfg.server))
        record = {"command": shlex.join(cmd), "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
                  "port": a.port, "pid": pid, "start_ticks": process_start_ticks(pid), "log": str(log_path),
                  "started_at": time.time()}
        detached_record_path(a.log_dir, cfg.name).write_text(json.dumps(record) + "\n")
        self.servers[cfg.name] = {**record, "detached": True}
        print(f"[sweep] {cfg.name} started detached (pid {pid}, port {a.port}): {record['command']}", flush=True)

    def attached_server(self, cfg: Config, rates: list[float]) -> tuple[DetachedServer, Path, float] | None:
        """`--attach`: the server an earlier `--detach` sweep started for this configuration, checked to be
        that process (pid and start time) running the very command, on the GPUs, this sweep would have
        started. Returns (server, log, its launch time on the wall clock), or None after recording error
        rows (a refused server is left as it is)."""
        a = self.args

        def refuse(why: str) -> None:
            for rate in rates:
                self.add_row(cfg, rate, "error", f"--attach: {why}")

        path = detached_record_path(a.log_dir, cfg.name)
        try:
            record = json.loads(path.read_text())
            pid, log, started_at = int(record["pid"]), Path(record["log"]), float(record["started_at"])
            start_ticks = record.get("start_ticks")
        except (OSError, ValueError, KeyError, TypeError) as err:
            refuse(f"no usable detached server record for {cfg.name} at {path} ({err!r})")
            return None
        expected = shlex.join(self.server_command(cfg, a.port))
        if record.get("command") != expected:
            refuse(f"the detached server runs another command:\n{record.get('command')}\nnot\n{expected}")
            return None
        visible = self.env_for(cfg.server).get("CUDA_VISIBLE_DEVICES")
        if record.get("cuda_visible_devices") != visible:
            refuse(f"the detached server sees CUDA devices {record.get('cuda_visible_devices')!r}, this sweep "
                   f"{visible!r}")
            return None
        server = DetachedServer(pid, start_ticks)
        if server.poll() is not None:
            refuse(f"the detached server (pid {pid}) is gone\n{log_tail(log)}")
            return None
        self.servers[cfg.name] = {**record, "attached": True}
        # already healthy: its start_s (from the launch) also counts the time between the two calls
        self.servers[cfg.name]["healthy_at_attach"] = is_healthy(f"http://127.0.0.1:{a.port}")
        print(f"[sweep] {cfg.name}: attached to pid {pid} on port {a.port}", flush=True)
        return server, log, started_at

    def run_point(self, cfg: Config, base_url: str, rate: float, server: subprocess.Popen | DetachedServer,
                  log_path: Path) -> None:
        a = self.args
        t0 = time.monotonic()
        try:
            before = scrape(base_url)
        except (OSError, urllib.error.URLError, ValueError):
            before = {}
        timeout = min(a.point_timeout_s, max(self.remaining_s() - 5, 1))
        profiling = (cfg.server == "rimuru" and a.profile_steps > 0
                     and step_profile(base_url, a.profile_steps) is not None)
        routing = cfg.server == "rimuru" and expert_routing(base_url, mark=True) is not None
        poller = MetricsPoller(base_url, a.poll_interval_s)
        try:
            with poller:
                summary = self.run_client(cfg, base_url, rate, a.num_prompts, a.seed, timeout, server)
        except SweepError as err:
            tail = log_tail(log_path, 15) if server.poll() is not None else ""
            self.add_row(cfg, rate, "error", f"{err}\n{tail}".strip(), point_wall_s=round(time.monotonic() - t0, 1),
                         peak_running=poller.peak_running, peak_waiting=poller.peak_waiting,
                         timeline=poller.compact_timeline())
            return
        try:
            after = scrape(base_url)
        except (OSError, urllib.error.URLError, ValueError):
            after = {}
        if a.save_metrics_text:
            save_metrics_text(base_url, Path(a.save_metrics_text) / f"metrics-{cfg.name}-{rate:g}rps.txt")
        wall = time.monotonic() - t0
        arrivals = a.num_prompts / rate if math.isfinite(rate) and rate > 0 else 0.0
        self.tail_s_seen.append(max(0.0, wall - arrivals))
        status = "ok" if summary.get("completed") else "error"
        error = None if status == "ok" else point_error(summary)
        if profiling:
            summary["step_profile"] = step_profile(base_url)
        if routing and (realised := expert_routing(base_url)) is not None:  # elastic: the routing of this point
            out = Path(a.output_json)
            path = out.with_name(f"{out.stem}-routing-{cfg.name}-{rate:g}rps.json")
            path.write_text(json.dumps({**realised, "num_prompts": a.num_prompts}) + "\n")
            summary["routing_file"] = path.name
        self.add_row(cfg, rate, status, error, **summary, **counter_deltas(before, after),
                     peak_running=poller.peak_running, peak_waiting=poller.peak_waiting,
                     point_wall_s=round(wall, 1), timeline=poller.compact_timeline())

    def run(self, configs: list[Config], rates: list[float]) -> None:
        self.vllm_ok = vllm_importable(self.env_for("vllm")) if any(c.server == "vllm" for c in configs) else False
        self.write()
        for cfg in configs:
            self.run_config(cfg, rates)
        self.write()


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def normalise_result(raw: dict[str, Any], num_prompts: int) -> dict[str, Any]:
    """Our client's report or vLLM's --save-result JSON -> the row's summary fields."""
    out = {k: raw.get(k) for k in _SUMMARY_KEYS}
    out["duration_s"] = raw.get("duration_s", raw.get("duration"))
    for name in ("ttft", "tpot", "itl"):  # vLLM with --metric-percentiles 50 also writes p50_*
        if out.get(f"median_{name}_ms") is None:
            out[f"median_{name}_ms"] = raw.get(f"p50_{name}_ms")
    if out["failed"] is None and out["completed"] is not None:
        out["failed"] = num_prompts - int(out["completed"])
    # why requests failed, as the client recorded it (ours: "errors"; vLLM's --save-result: one string per
    # request, "" for a success): the first few distinct messages
    out["client_errors"] = list(dict.fromkeys(str(e) for e in raw.get("errors") or [] if e))[:5]
    return out


def prompt_format_args(model: str) -> list[str]:
    """Our client's prompt format for `model`: a preset name is served without a tokenizer and takes token ids
    only (a text prompt gets HTTP 400, so every request of the point would fail); a model directory has its
    tokenizer, so text, as vLLM's client sends. `--client-args` can override it."""
    return [] if Path(model).is_dir() else ["--prompt-format", "token-ids"]


def point_error(summary: dict[str, Any]) -> str:
    """The row's error when no request completed, with the client's reasons where it gave any: "no request
    completed" alone leaves a failed GPU point without its cause."""
    reasons = summary.get("client_errors") or []
    return "no request completed" + (f"; the client's errors: {' | '.join(reasons)}" if reasons else "")


def vllm_importable(env: dict[str, str]) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([sys.executable, "-c", probe], env=env, timeout=60, capture_output=True).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def check_rimuru_flags(flags: list[str], env: dict[str, str], cwd: Path = REPO) -> None:
    """Fails fast when --rimuru-args names a flag `rimuru serve` does not have (e.g. a router not built yet)."""
    wanted = [f.split("=")[0] for f in flags if f.startswith("--")]
    if not wanted:
        return
    out = subprocess.run([sys.executable, "-m", "rimuru.cli", "serve", "--help"], env=env, capture_output=True,
                         text=True, timeout=120, cwd=cwd)
    missing = [f for f in wanted if not re.search(rf"(^|\s){re.escape(f)}\b", out.stdout)]
    if missing:
        raise SystemExit(f"rimuru serve has no flag {', '.join(missing)} (see `rimuru serve --help`)")


def sweep_metadata(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """benchmarks.common.metadata, computed in a child process so this one never holds a CUDA context."""
    extra = {"command": command, "client": args.client, "model": args.model, "num_prompts": args.num_prompts,
             "seed": args.seed, "gpu_memory_budget": args.gpu_memory_budget, "label": args.label,
             "dataset_path": str(args.dataset_path) if args.dataset_path else "packaged ShareGPT",
             "ignore_eos": True, "rimuru_args": args.rimuru_args, "vllm_args": args.vllm_args,
             "server_root": args.server_root, "server_commit": args.server_commit,
             "client_args": args.client_args}
    code = ("import json, sys; from benchmarks.common import metadata; "
            "print(json.dumps(metadata('serve_sweep', **json.loads(sys.argv[1]))))")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    try:
        out = subprocess.run([sys.executable, "-c", code, json.dumps(extra)], env=env, capture_output=True,
                             text=True, timeout=180, cwd=REPO, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
        return {"benchmark": "serve_sweep", "metadata_error": str(err)[:500],
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "git_commit": os.environ.get("RIMURU_COMMIT", "unknown"), **extra}


# ---------------------------------------------------------------------------------------------- CLI


def budget_bytes(budget: str) -> int:
    """`--gpu-memory-budget` in bytes, read as Rimuru's servers read it."""
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))
    from rimuru.config import parse_bytes

    return parse_bytes(budget)


def sets_vllm_memory(flags: list[str]) -> bool:
    """Whether vLLM flags size its memory themselves (a share of the GPU, or the KV cache's bytes)."""
    own = ("--gpu-memory-utilization", "--kv-cache-memory", "--kv-cache-memory-bytes")
    return any(f.split("=", 1)[0].replace("_", "-") in own for f in flags if f.startswith("--"))


def vllm_memory_flags(budget_bytes: int, gpu_total_bytes: int) -> list[str]:
    """`--gpu-memory-utilization` for a budget: the budget's share of the GPU's memory, rounded down to four digits
    (vLLM's server then holds at most the budget)."""
    if not 0 < budget_bytes <= gpu_total_bytes:
        raise SystemExit(f"serve_sweep: a budget of {budget_bytes / 2**30:.2f} GiB does not fit this GPU's "
                         f"{gpu_total_bytes / 2**30:.2f} GiB")
    return ["--gpu-memory-utilization", f"{math.floor(budget_bytes / gpu_total_bytes * 1e4) / 1e4:.4f}"]


def parse_configs(names: str, defines: list[str]) -> list[Config]:
    table = dict(BUILTIN_CONFIGS)
    for d in defines:
        name, sep, spec = d.partition("=")
        server, sep2, flags = spec.partition(":")
        if not sep or not sep2 or server not in ("rimuru", "vllm") or not name:
            raise SystemExit(f"bad --define {d!r}: use NAME=rimuru:FLAGS or NAME=vllm:FLAGS")
        table[name] = (server, shlex.split(flags))
    configs = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name not in table:
            raise SystemExit(f"unknown config {name!r}; known: {', '.join(table)} (or --define NAME=rimuru:FLAGS)")
        configs.append(Config(name, *table[name]))
    if not configs:
        raise SystemExit("--configs names no configuration")
    return configs


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"bad --rates {text!r}: use e.g. 10,20,30") from None
    if not rates or any(r <= 0 for r in rates):
        raise SystemExit(f"bad --rates {text!r}: positive numbers (inf = all at once)")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="static,fixed,elastic-paper,elastic-cost")
    p.add_argument("--define", action="append", default=[], metavar="NAME=SERVER:FLAGS",
                   help="an extra configuration, e.g. 'fixed45=rimuru:--offload-mode fixed --resident-experts 45'")
    p.add_argument("--rates", default="10,20,30,40,60", help="request rates in req/s, comma separated")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client", choices=["rimuru", "vllm"], default="rimuru",
                   help="benchmark client: ours (rimuru bench serve) or vLLM's (vllm bench serve --backend vllm)")
    p.add_argument("--model", default=str(ANCHOR_MODEL) if ANCHOR_MODEL.is_dir() else "qwen1.5-moe-a2.7b",
                   help="model directory or Rimuru preset (default: the vllm-anchor folder if present)")
    p.add_argument("--served-model-name", default="qwen15moe")
    p.add_argument("--tokenizer", default=None, help="client tokenizer (default: --model if it is a directory)")
    p.add_argument("--dataset-path", default=str(ANCHOR_DATA) if ANCHOR_DATA.exists() else None,
                   help="ShareGPT JSON (default: the vllm-anchor one if present, else our packaged dataset)")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--gpu-memory-budget", default="32GiB",
                   help="Rimuru servers' budget; vLLM servers' too, as --gpu-memory-utilization, unless they set it")
    p.add_argument("--device", default="auto", help="Rimuru servers' device (auto | cuda | cpu)")
    p.add_argument("--rimuru-args", default="", help="more flags for every Rimuru server (one string)")
    p.add_argument("--server-root", default=str(REPO),
                   help="the source tree Rimuru servers run (e.g. an older commit's `git archive`; the client and "
                        "this script stay this tree's)")
    p.add_argument("--server-commit", default=None, help="the commit --server-root holds (stored in the metadata)")
    p.add_argument("--vllm-args", default="", help="more flags for every vLLM server, e.g. --enforce-eager")
    p.add_argument("--vllm-max-model-len", type=int, default=4096)
    p.add_argument("--vllm-site", default=str(VLLM_SITE) if VLLM_SITE.is_dir() else None,
                   help="extra PYTHONPATH for vLLM's server and client (gpu-install.sh's /tmp/site)")
    p.add_argument("--client-args", default="", help="more flags for the client (one string)")
    p.add_argument("--save-metrics-text", default=None, metavar="DIR",
                   help="after each point, the server's raw /metrics text into DIR/metrics-CONFIG-RATErps.txt")
    p.add_argument("--label", default=None, help="a tag stored in the metadata and every row (e.g. uniform, zipf1.0)")
    p.add_argument("--port", type=int, default=0, help="server port on 127.0.0.1 (0: a free one per server)")
    p.add_argument("--detach", action="store_true",
                   help="only start each configuration's server, in its own session, and exit: it outlives this "
                        "process (a device call) for a later --attach sweep; needs --port and --log-dir")
    p.add_argument("--attach", action="store_true",
                   help="measure on the servers a --detach sweep started (same flags), waiting for /health, and "
                        "stop them at the end; their start time counts from the launch")
    p.add_argument("--server-timeout-s", type=float, default=420.0, help="longest wait for /health")
    p.add_argument("--point-timeout-s", type=float, default=540.0, help="longest client run per point")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no server or point that would not finish within this many seconds from the start")
    p.add_argument("--start-estimate-s", type=float, default=90.0, help="server start time assumed until one is seen")
    p.add_argument("--tail-estimate-s", type=float, default=30.0,
                   help="seconds a point takes beyond its arrivals (client start, drain), until one is seen")
    p.add_argument("--warmup-prompts", type=int, default=0, help="unrecorded requests (all at once) after each start")
    p.add_argument("--profile-steps", type=int, default=2000,
                   help="Rimuru servers: profile this many steps of each point (step profiler; ~1 us per mark) and "
                   "keep the per-kind report in the row as step_profile; 0 = off")
    p.add_argument("--poll-interval-s", type=float, default=0.5)
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG: throughput and TTFT p50 against rate, one line per config")
    p.add_argument("--plot-from", nargs="+", default=None, help="only draw --plot from these sweep JSONs")
    p.add_argument("--plot-memory", default=None, help="PNG: the memory split over time at --plot-memory-rate")
    p.add_argument("--plot-memory-rate", type=float, default=40.0)
    return p


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """SIGTERM / SIGHUP become SystemExit so `finally` blocks stop the servers (SIGINT already does)."""
    old = {s: signal.signal(s, _raise_exit) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot_from:
        if not (args.plot or args.plot_memory):
            raise SystemExit("--plot-from needs --plot OUT.png and/or --plot-memory OUT.png")
        if args.plot:
            plot([Path(p) for p in args.plot_from], Path(args.plot))
        if args.plot_memory:
            plot_memory([Path(p) for p in args.plot_from], args.plot_memory_rate, Path(args.plot_memory))
        return 0
    if not args.output_json:
        raise SystemExit("--output-json is required")
    configs = parse_configs(args.configs, args.define)
    rates = parse_rates(args.rates)
    if args.num_prompts < 1:
        raise SystemExit("--num-prompts must be at least 1")
    if args.tokenizer is None and Path(args.model).is_dir():
        args.tokenizer = args.model
    if args.client == "vllm" and not args.dataset_path:
        raise SystemExit("--client vllm needs --dataset-path (a ShareGPT JSON, e.g. /tmp/anchor/sharegpt.json)")
    if args.client == "vllm" and not args.tokenizer:
        raise SystemExit("--client vllm needs a tokenizer directory (--tokenizer or a --model directory)")
    if args.detach or args.attach:
        if args.detach and args.attach:
            raise SystemExit("--detach and --attach exclude each other")
        if not args.port or not args.log_dir:
            raise SystemExit("--detach / --attach need a fixed --port and --log-dir (the record lives there)")
        if len(configs) != 1:
            raise SystemExit("--detach / --attach take one configuration (one server on --port)")
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["serve_sweep.py", *argv])
    with contextlib.ExitStack() as stack:
        if args.log_dir is None:
            args.log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="sweep-logs-"))
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        stack.enter_context(exit_on_signals())
        sweep = Sweep(args, {})
        if any(c.server == "rimuru" for c in configs):
            check_rimuru_flags(shlex.split(args.rimuru_args), sweep.env_for("rimuru"), sweep.root_for("rimuru"))
        if args.client == "vllm" and not vllm_importable(sweep.env_for("vllm")):
            raise SystemExit(f"--client vllm: vLLM is not importable (PYTHONPATH + --vllm-site {args.vllm_site})")
        sweep.meta = sweep_metadata(args, command)
        sweep.meta.update(configs={c.name: {"server": c.server, "flags": c.flags} for c in configs}, rates=rates)
        if not args.attach and any(c.server == "vllm" and not sets_vllm_memory([*c.flags, *shlex.split(args.vllm_args)])
                                   for c in configs):
            # before any server starts: a budget the card cannot hold, or a GPU that cannot be read, stops here
            vllm_memory_flags(budget_bytes(args.gpu_memory_budget), sweep.gpu_total_bytes())
            sweep.meta["gpu_total_bytes"] = sweep.gpu_total_bytes()
        sweep.run(configs, rates)
    if args.detach:
        if not sweep.servers:
            print(f"[sweep] started nothing; wrote {args.output_json}", flush=True)
            return 1
        print(f"[sweep] started {', '.join(sweep.servers)} detached; wrote {args.output_json}", flush=True)
        return 0
    ok = sum(r["status"] == "ok" for r in sweep.rows)
    print(f"[sweep] {ok} of {len(sweep.rows)} points measured; wrote {args.output_json}", flush=True)
    if args.plot and ok:
        plot([Path(args.output_json)], Path(args.plot))
    if args.plot_memory and ok:
        plot_memory([Path(args.output_json)], args.plot_memory_rate, Path(args.plot_memory))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
