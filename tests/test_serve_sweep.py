"""benchmarks/serve_sweep.py on a tiny model on the CPU: rows for every (config, rate), servers stopped,
a server that cannot start recorded as an error row while the sweep goes on (broken first: the
sweep goes on to start and measure the next configuration)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # the sweep's own modules, as the script sees them

from sweep_plots import plot_series  # noqa: E402
from sweep_processes import (  # noqa: E402
    DetachedServer,
    free_port,
    port_is_free,
    process_ended,
    process_start_ticks,
    start_detached,
)

from benchmarks.serve_sweep import (  # noqa: E402
    ROW_FIELDS,
    Sweep,
    build_parser,
    counter_deltas,
    normalise_result,
    parse_configs,
    parse_prometheus,
    point_error,
    prompt_format_args,
    running_waiting,
    sets_vllm_memory,
    vllm_memory_flags,
)
from rimuru.experts.popularity import ExpertPopularity  # noqa: E402
from rimuru.model_spec import load_model_spec  # noqa: E402


def _tiny_sharegpt(path: Path, n: int = 12) -> Path:
    words = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old oak tree".split()
    recs = []
    for i in range(n):
        q = " ".join(words[(i + j) % len(words)] for j in range(8 + i % 5))
        a = " ".join(words[(2 * i + j) % len(words)] for j in range(6 + i % 3))
        recs.append({"id": f"c{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
    path.write_text(json.dumps(recs))
    return path


def test_prometheus_parsing_and_deltas() -> None:
    text = "\n".join([
        "# HELP rimuru:num_requests_running x", "rimuru:num_requests_running 3.0",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0', 'vllm:num_requests_waiting{engine="1"} 1.0',
        "rimuru:expert_bytes_loaded_total 100.0", "rimuru:prefetch_hits_total 3.0",
        "rimuru:prefetch_misses_total 1.0", 'rimuru:resident_experts{layer="0"} 4.0', "garbage line",
    ])
    m = parse_prometheus(text)
    assert running_waiting(m) == (3.0, 3.0)
    after = dict(m, **{"rimuru:expert_bytes_loaded_total": 300.0, "rimuru:prefetch_hits_total": 9.0,
                       "rimuru:prefetch_misses_total": 3.0})
    d = counter_deltas(m, after)
    assert d["expert_bytes_pcie"] == 200.0 and d["prefetch_hits"] == 6.0 and d["prefetch_hit_rate"] == 0.75
    assert counter_deltas({}, {})["prefetch_hit_rate"] is None
    # evictions are a delta over the point, the start-up piecewise overhead a level read at its end
    moved = dict(after, **{"rimuru:expert_evictions_total": 7.0, "rimuru:piecewise_overhead_ms": 1.5,
                           "rimuru:expert_copy_bytes_per_second": 5.3e10})
    d = counter_deltas(dict(m, **{"rimuru:expert_evictions_total": 2.0}), moved)
    assert d["expert_evictions"] == 5.0 and d["piecewise_overhead_ms"] == 1.5 and d["expert_grows"] is None
    assert d["expert_copy_bandwidth"] == 5.3e10
    vllm = normalise_result({"completed": 9, "duration": 2.0, "p50_ttft_ms": 5.0, "p99_ttft_ms": 9.0}, 10)
    assert vllm["failed"] == 1 and vllm["duration_s"] == 2.0 and vllm["median_ttft_ms"] == 5.0
    assert vllm["client_errors"] == [] and point_error(vllm) == "no request completed"
    # a point where nothing completed says why, as the client recorded it (vLLM: "" per success; ours: errors)
    failed = normalise_result({"completed": 0, "errors": ["", "HTTP 404: no model m", "HTTP 404: no model m",
                                                          "ReadTimeout: x"]}, 3)
    assert failed["client_errors"] == ["HTTP 404: no model m", "ReadTimeout: x"]
    assert point_error(failed) == "no request completed; the client's errors: HTTP 404: no model m | ReadTimeout: x"
    # a preset is served without a tokenizer (text prompts get HTTP 400): our client sends token ids to it
    assert prompt_format_args("qwen1.5-moe-a2.7b") == ["--prompt-format", "token-ids"]
    assert prompt_format_args(str(REPO / "tests")) == []
    with pytest.raises(SystemExit):
        parse_configs("static,nope", [])
    assert parse_configs("x", ["x=rimuru:--offload-mode fixed"])[0].flags == ["--offload-mode", "fixed"]


def test_plot_lines_split_by_run_only_where_runs_overlap(tmp_path: Path) -> None:
    def rows(config: str, *rates: float) -> list[dict]:
        return [{"config": config, "label": "zipf1.0", "status": "ok", "rate": r, "output_throughput": 10 * r,
                 "median_ttft_ms": 1.0} for r in rates]
    # a run is the code a file measured (its git_commit), whatever the file is called
    files = {"a.json": ("f3ae023acfff", rows("elastic-cost", 40, 10)),
             "b.json": ("784e9b06acc0", rows("elastic-cost", 30)),
             "c.json": ("784e9b06acc0", rows("static", 10) + [{"config": "static", "status": "error", "rate": 20.0}]),
             "d.json": (None, rows("static", 20))}
    for name, (commit, rs) in files.items():
        (tmp_path / name).write_text(json.dumps({"git_commit": commit, "rows": rs}))
    series = plot_series(sorted(tmp_path.iterdir()))
    assert series == {
        "elastic-cost (zipf1.0), code f3ae023": [(10, 100, 1.0), (40, 400, 1.0)],  # sorted by rate
        "elastic-cost (zipf1.0), code 784e9b0": [(30, 300, 1.0)],
        "static (zipf1.0), code 784e9b0": [(10, 100, 1.0)],  # the error row is not drawn
        "static (zipf1.0)": [(20, 200, 1.0)],  # a file that records no commit
    }


def test_sweep_on_tiny_model(tiny_checkpoint, tmp_path: Path) -> None:
    ckpt = tiny_checkpoint("qwen2_moe")
    data = _tiny_sharegpt(tmp_path / "sharegpt.json")
    out = tmp_path / "sweep.json"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "serve_sweep.py"), "--model", str(ckpt), "--device", "cpu",
        "--load-format", "auto", "--gpu-memory-budget", "64MiB", "--configs", "broken,fixed,elastic",
        "--define", "broken=rimuru:--dtype nonsense", "--rates", "20,40", "--num-prompts", "3",
        # copies: their host waits and prefetches are what the rows must carry
        "--define", "fixed=rimuru:--offload-mode fixed --resident-experts 0.85 --offload-access copy",
        "--dataset-path", str(data), "--client-args", "--max-prompt-len 60 --max-total-len 80 --max-output-len 5",
        "--poll-interval-s", "0.1", "--server-timeout-s", "60", "--point-timeout-s", "60",
        "--label", "cpu-test", "--output-json", str(out), "--save-metrics-text", str(tmp_path / "metrics"),
    ]
    env = {"PYTHONPATH": str(REPO), "RIMURU_COMMIT": "test-commit", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    for key in ("device", "date", "git_commit", "command", "rows", "servers", "configs", "rates"):
        assert key in doc
    assert "--configs broken,fixed,elastic" in doc["command"]
    rows = doc["rows"]
    assert [(r["config"], r["rate"]) for r in rows] == [
        ("broken", 20.0), ("broken", 40.0), ("fixed", 20.0), ("fixed", 40.0), ("elastic", 20.0), ("elastic", 40.0)]
    for r in rows:
        assert set(ROW_FIELDS) <= set(r), set(ROW_FIELDS) - set(r)
        assert r["label"] == "cpu-test" and r["num_prompts"] == 3 and r["client"] == "rimuru"
    for r in rows:
        if r["config"] == "broken":
            assert r["status"] == "error" and "server failed to start" in r["error"]
            assert "nonsense" in r["error"]  # the server log's tail says why
            continue
        assert r["status"] == "ok", r["error"]
        assert r["completed"] == 3 and r["failed"] == 0
        assert r["output_throughput"] > 0 and r["median_ttft_ms"] > 0 and r["p99_tpot_ms"] is not None
        assert r["peak_running"] is not None and r["peak_waiting"] is not None
        assert r["forward_steps"] and r["forward_steps"] > 0  # /metrics deltas of this point alone
        assert r["timeline"]["t"] and "running" in r["timeline"]
    fixed = [r for r in rows if r["config"] == "fixed"]  # offloads: expert copies and prefetches are counted
    assert all(r["expert_bytes_pcie"] is not None and r["prefetch_hits"] is not None for r in fixed)
    for r in fixed:  # the serving step profile of each point: per-kind means, expert waits of the offloading provider
        prof = r["step_profile"]
        assert prof["steps_profiled"] >= r["forward_steps"] > 0 and prof["all"]["expert_wait_ms"] is not None
    # elastic mode counts its routing: each point's, beside the result file, as a ranking file; fixed mode counts none
    assert all("routing_file" not in r for r in fixed)
    spec = load_model_spec(str(ckpt))
    for r in (r for r in rows if r["config"] == "elastic"):
        assert r["routing_file"] == f"sweep-routing-elastic-{r['rate']:g}rps.json"
        routing = json.loads((tmp_path / r["routing_file"]).read_text())
        pop = ExpertPopularity.from_json(routing, spec.num_moe_layers, spec.num_experts)
        assert pop.num_prompts == 3
        # this point's assignments only: every token of its passes, top_k times in each MoE layer
        per_layer = {sum(row) for row in routing["routed_counts"]}
        assert len(per_layer) == 1 and per_layer.pop() % spec.num_experts_per_tok == 0
    assert doc["servers"]["fixed"]["start_s"] is not None  # one start serves both rates
    for name in ("fixed", "broken"):
        srv = doc["servers"][name]
        assert port_is_free(srv["port"]), f"{name}'s port {srv['port']} still taken"
        assert srv["stopped"], name
    # the memory split over time at one rate: the pool's bytes by kind are in the timeline, and plotted
    for r in fixed:
        tl = r["timeline"]
        assert max(tl["expert_bytes_used"]) > 0 and tl["kv_bytes_used"] and tl["pool_free_bytes"]
        assert set(tl["state_bytes_used"]) <= {0.0, None}  # sampled for every model; no state pages here
    # the raw /metrics text after each measured point (the broken server measured none)
    saved = sorted(p.name for p in (tmp_path / "metrics").iterdir())
    assert saved == [f"metrics-{c}-{r}rps.txt" for c in ("elastic", "fixed") for r in (20, 40)], saved
    text = (tmp_path / "metrics" / "metrics-fixed-40rps.txt").read_text()
    assert "# HELP vllm:num_requests_running" in text and "vllm:num_requests_running{" in text, text[:500]
    png = tmp_path / "memory.png"
    plot = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve_sweep.py"), "--plot-from", str(out),
                           "--plot-memory", str(png), "--plot-memory-rate", "40"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert png.stat().st_size > 10_000
    none = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve_sweep.py"), "--plot-from", str(out),
                           "--plot-memory", str(png), "--plot-memory-rate", "7"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert none.returncode != 0 and "no ok rows with a timeline at 7" in none.stderr


def test_detached_server_is_measured_by_a_later_attach(tiny_checkpoint, tmp_path: Path) -> None:
    """A server too slow to start and measure within one device call: `--detach` starts it in its own
    session and exits (the server lives on); `--attach` with the same flags measures on it and stops it.
    An attach whose flags would start another server refuses it instead of measuring the wrong one."""
    ckpt = tiny_checkpoint("qwen2_moe")
    data = _tiny_sharegpt(tmp_path / "sharegpt.json")
    logs = tmp_path / "logs"
    port = free_port()
    base = [
        sys.executable, str(REPO / "benchmarks" / "serve_sweep.py"), "--model", str(ckpt), "--device", "cpu",
        "--load-format", "auto", "--gpu-memory-budget", "64MiB", "--configs", "static", "--rates", "20",
        "--num-prompts", "3", "--dataset-path", str(data), "--port", str(port), "--log-dir", str(logs),
        "--client-args", "--max-prompt-len 60 --max-total-len 80 --max-output-len 5",
        "--poll-interval-s", "0.1", "--server-timeout-s", "90", "--point-timeout-s", "60",
    ]
    env = {"PYTHONPATH": str(REPO), "RIMURU_COMMIT": "test-commit", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    detach = subprocess.run([*base, "--detach", "--output-json", str(tmp_path / "d.json")],
                            capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    doc = json.loads((tmp_path / "d.json").read_text())
    pid = doc["servers"].get("static", {}).get("pid")
    try:
        assert detach.returncode == 0, detach.stdout[-2000:] + detach.stderr[-2000:]
        assert doc["rows"] == []  # nothing measured by the launch
        record = json.loads((logs / "server-static.detached.json").read_text())
        assert record["pid"] == pid and record["start_ticks"] == process_start_ticks(pid)
        os.kill(pid, 0)  # outlived the sweep that started it
        other = subprocess.run([*base, "--attach", "--rimuru-args=--max-num-seqs 8", "--output-json",
                                str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60, env=env,
                               cwd=REPO)
        assert other.returncode == 1
        (row,) = json.loads((tmp_path / "x.json").read_text())["rows"]
        assert row["status"] == "error" and "runs another command" in row["error"]
        attach_began = time.time()
        attach = subprocess.run([*base, "--attach", "--output-json", str(tmp_path / "a.json")],
                                capture_output=True, text=True, timeout=150, env=env, cwd=REPO)
        assert attach.returncode == 0, attach.stdout[-3000:] + attach.stderr[-3000:]
        doc = json.loads((tmp_path / "a.json").read_text())
        (row,) = doc["rows"]
        assert row["status"] == "ok" and row["completed"] == 3 and row["forward_steps"] > 0, row["error"]
        srv = doc["servers"]["static"]
        assert srv["attached"] and srv["pid"] == pid and srv["stopped"] and port_is_free(port)
        assert srv["start_s"] >= attach_began - record["started_at"]  # counted from the launch, not the attach
        assert isinstance(srv["healthy_at_attach"], bool)
        # consumed: a second attach finds no record rather than a pid that may name another process by then
        assert not (logs / "server-static.detached.json").exists()
        assert (logs / "server-static.stopped.json").exists()
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def test_a_detached_server_that_exits_or_whose_pid_is_reused_counts_as_exited(tmp_path: Path) -> None:
    # our own child: reaped, with its exit code (a zombie would otherwise look alive to kill(pid, 0)), also when it
    # exited before it was adopted and another Popen ran meanwhile (subprocess reaps the children of collected
    # Popens it still tracks whenever a new one starts)
    pid = start_detached([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), tmp_path / "log")
    start = process_start_ticks(pid)
    deadline = time.monotonic() + 30
    while not process_ended(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    gc.collect()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    server = DetachedServer(pid, start)
    assert server.wait(timeout=30) == 3 and server.poll() == 3
    # a live pid whose start time differs from the record's names another process: not the server
    me = process_start_ticks(os.getpid())
    assert me is not None and DetachedServer(os.getpid(), me).poll() is None
    assert DetachedServer(os.getpid(), me + 1).poll() == -1


def test_prefix_cache_hit_rate_from_metrics_deltas() -> None:
    # vLLM's names (prometheus_client adds _total to counters), summed over engine labels as any other
    before = parse_prometheus('vllm:prefix_cache_queries_total{engine="0"} 100.0\n'
                              'vllm:prefix_cache_hits_total{engine="0"} 10.0\n')
    after = parse_prometheus('vllm:prefix_cache_queries_total{engine="0"} 500.0\n'
                             'vllm:prefix_cache_hits_total{engine="0"} 310.0\n')
    d = counter_deltas(before, after)
    assert (d["prefix_cache_queries"], d["prefix_cache_hits"], d["prefix_cache_hit_rate"]) == (400.0, 300.0, 0.75)
    assert counter_deltas(after, after)["prefix_cache_hit_rate"] == 0.0  # nothing looked up: caching off
    assert counter_deltas({}, {})["prefix_cache_hit_rate"] is None  # a server without the counters
    ours = normalise_result({"completed": 2, "total_input_tokens": 90, "total_cached_tokens": 32,
                             "median_ttft_later_turns_ms": 3.0}, 2)
    assert ours["total_cached_tokens"] == 32 and ours["median_ttft_later_turns_ms"] == 3.0
    assert ours["median_ttft_first_turn_ms"] is None


def _tiny_multiturn_sharegpt(path: Path, n: int = 4, turns: int = 3) -> Path:
    words = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old oak tree".split()
    recs = []
    for i in range(n):
        conv = []
        for t in range(turns):
            conv.append({"from": "human", "value": " ".join(words[(i + t + j) % len(words)] for j in range(8))})
            conv.append({"from": "gpt", "value": " ".join(words[(2 * i + t + j) % len(words)] for j in range(5))})
        recs.append({"id": f"m{i}", "conversations": conv})
    path.write_text(json.dumps(recs))
    return path


@pytest.mark.parametrize("dataset", ["shared-prefix", "sharegpt-multiturn"])
def test_prefix_caching_workloads_hit_with_caching_on_and_not_off(tiny_checkpoint, tmp_path: Path,
                                                                  dataset: str) -> None:
    """Both prefix-caching workloads through the sweep, one server with prefix caching on (the default) and one
    with it off: the rows' hit rate from /metrics is > 0 on and 0 off, and the client's cached tokens agree."""
    ckpt = tiny_checkpoint("qwen2_moe")
    if dataset == "shared-prefix":
        data = _tiny_sharegpt(tmp_path / "sharegpt.json")
        client = "--dataset shared-prefix --shared-prefix-len 64 --max-prompt-len 60 --max-total-len 80"
    else:
        data = _tiny_multiturn_sharegpt(tmp_path / "multi.json")
        client = "--dataset sharegpt-multiturn --endpoint chat --turn-think-time-s 0.01 --max-prompt-len 300 " \
                 "--max-total-len 320"
    out = tmp_path / "sweep.json"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "serve_sweep.py"), "--model", str(ckpt), "--device", "cpu",
        "--load-format", "auto", "--gpu-memory-budget", "64MiB", "--configs", "on,off",
        "--define", "on=rimuru:--enable-prompt-tokens-details",
        "--define", "off=rimuru:--no-enable-prefix-caching --enable-prompt-tokens-details",
        "--rates", "20", "--num-prompts", "6", "--dataset-path", str(data),
        "--client-args", f"{client} --max-output-len 4", "--profile-steps", "0",
        "--poll-interval-s", "0.2", "--server-timeout-s", "60", "--point-timeout-s", "60", "--output-json", str(out),
    ]
    env = {"PYTHONPATH": str(REPO), "RIMURU_COMMIT": "test-commit", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    for r in rows.values():
        assert r["status"] == "ok", r["error"]
        assert r["completed"] == 6 and r["prefix_cache_queries"] is not None and r["total_input_tokens"] > 0
    on, off = rows["on"], rows["off"]
    assert on["prefix_cache_hit_rate"] > 0 and on["prefix_cache_hits"] > 0 and on["total_cached_tokens"] > 0
    assert off["prefix_cache_hit_rate"] == 0.0 and off["total_cached_tokens"] == 0
    if dataset == "sharegpt-multiturn":  # the TTFT of first and later turns, from the client's report
        assert on["median_ttft_first_turn_ms"] > 0 and on["median_ttft_later_turns_ms"] > 0
    else:
        assert on["median_ttft_first_turn_ms"] is None


def test_a_vllm_server_gets_the_budget_as_its_share_of_the_gpu() -> None:
    h200, h100 = 139.81 * 2**30, 79.19 * 2**30  # what CUDA reports as the cards' totals
    assert vllm_memory_flags(32 * 2**30, int(h200)) == ["--gpu-memory-utilization", "0.2288"]
    assert vllm_memory_flags(32 * 2**30, int(h100)) == ["--gpu-memory-utilization", "0.4040"]
    assert float(vllm_memory_flags(72 * 2**30, int(h100))[1]) * h100 <= 72 * 2**30  # rounded down: never above
    with pytest.raises(SystemExit, match="does not fit this GPU"):
        vllm_memory_flags(100 * 2**30, int(h100))
    assert sets_vllm_memory(["--gpu-memory-utilization", "0.9"]) and sets_vllm_memory(["--kv-cache-memory=8G"])
    assert sets_vllm_memory(["--gpu_memory_utilization=0.5"])  # vLLM's parser takes the underscore spelling too
    assert not sets_vllm_memory(["--enforce-eager"])

    args = build_parser().parse_args(["--gpu-memory-budget", "32GiB", "--configs", "vllm,vllm-unlimited",
                                      "--rates", "1", "--vllm-args=--enforce-eager"])
    sweep = Sweep(args=args, meta={})
    sweep._gpu_total = int(h100)  # as gpu_total_bytes() would read it on an H100
    vllm, unlimited = parse_configs("vllm,vllm-unlimited", [])
    cmd = sweep.server_command(vllm, 8000)
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.4040" and "--enforce-eager" in cmd
    cmd = sweep.server_command(unlimited, 8000)  # a configuration that sizes itself keeps its own share
    assert cmd.count("--gpu-memory-utilization") == 1 and cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.9"


def test_a_budget_the_card_cannot_hold_stops_the_sweep_before_a_server_starts(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Sweep, "gpu_total_bytes", lambda self: 80 * 2**30)
    started: list[object] = []
    monkeypatch.setattr(Sweep, "run", lambda self, configs, rates: started.append(configs))
    from benchmarks import serve_sweep

    with pytest.raises(SystemExit, match="does not fit this GPU"):
        serve_sweep.main(["--configs", "vllm", "--rates", "1", "--gpu-memory-budget", "100GiB",
                          "--output-json", str(tmp_path / "out.json")])
    assert not started
    serve_sweep.main(["--configs", "vllm", "--rates", "1", "--gpu-memory-budget", "32GiB",
                      "--output-json", str(tmp_path / "out.json")])
    assert started  # (Sweep.run stubbed: nothing is served)

