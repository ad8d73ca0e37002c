"""`make demo` / `python -m rimuru.demo`: serve a small MoE checkpoint, replay ShareGPT, compare modes.

Steps: (1) build a demo checkpoint (real HF format: config, safetensors, tokenizer with a chat
template) unless one is given; (2) pick one memory budget where every expert fits but leaves little
KV cache, so offloading experts would buy concurrency; (3) for each offload mode start `rimuru serve`
in a subprocess under that budget, replay the same ShareGPT sample with the benchmark client while
polling /metrics, stop the server; (4) print a side-by-side table and plot the memory split over
time. A mode the engine does not implement yet is reported as such, not hidden.

The request rate is set from this machine's measured speed (unless --request-rate is given): about
1.5 times what static mode completes with the KV room the budget leaves, so a queue forms on any machine.
Results go to --out-dir (default demo-out/); the tracked docs/demo.md and docs/demo_memory.png change
only with --update-docs. The temporary checkpoint and server logs are removed at the end (--keep-work
keeps them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODES = ("static", "fixed", "elastic")
DEMO_SHAPE = dict(num_hidden_layers=4, num_experts=16, moe_intermediate_size=64, mlp_only_layers=[])


def build_checkpoint(out: Path) -> Path:
    from rimuru.testing.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen2_moe", out, seed=0, **DEMO_SHAPE)


def pick_budget(ckpt: Path, kv_tokens: int, engine_flags: dict) -> tuple[int, dict]:
    """A budget holding non-expert weights, workspace, every expert, and KV for about `kv_tokens` tokens."""
    from rimuru.config import EngineConfig
    from rimuru.engine.llm_engine import LLMEngine

    probe = LLMEngine(EngineConfig(model=str(ckpt), gpu_memory_budget="256MiB", **engine_flags))
    split = probe.budget_split
    st = probe.stats()
    page = split["kv_free"] // st["kv_pages_free"]
    pages = -(-kv_tokens // probe.config.block_size) * probe.kv.num_layers
    budget = split["non_expert_weights"] + split["workspace"] + split["experts_resident"] + pages * page
    return budget, {"expert_bytes": split["experts_resident"], "kv_page_bytes": page,
                    "total_experts": st["total_experts"]}


def measured_request_rate(ckpt: Path, budget: int, flags: dict, kv_tokens: int, prompt_len: int,
                          output_len: int) -> float:
    """Requests per second static mode completes on this machine with the KV room of `budget`, times 1.5: the
    sequences that fit at once (KV tokens over a typical request's) generate together, timed."""
    from rimuru import LLM, SamplingParams

    llm = LLM(str(ckpt), gpu_memory_budget=budget, offload_mode="static", **flags)
    fit = max(1, kv_tokens // (prompt_len + output_len))
    prompts = [{"prompt_token_ids": [3 + (i + j) % 50 for j in range(prompt_len)]} for i in range(fit)]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    del llm
    return 1.5 * fit / max(elapsed, 1e-6)


def start_server(ckpt: Path, mode: str, budget: int, port: int, flags: dict, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rimuru.cli", "serve", str(ckpt), "--port", str(port),
           "--served-model-name", "demo", "--offload-mode", mode, "--gpu-memory-budget", str(budget),
           "--log-level", "warning"]
    for k, v in flags.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 180.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_args(url: str, ckpt: Path, args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(
        base_url=url, model="demo", dataset="sharegpt", dataset_path=None, num_prompts=args.num_prompts,
        request_rate=args.request_rate, burstiness=1.0, max_concurrency=None, seed=args.seed,
        tokenizer=str(ckpt), prompt_format="text", sharegpt_output_len=None, max_prompt_len=args.max_prompt_len,
        max_total_len=args.max_prompt_len + args.max_output_len, max_output_len=args.max_output_len,
        api_key=None, poll_metrics=0.25, output_json=None, no_progress=False)


def peak(timeline: list[dict], key: str) -> float:
    return max((s.get(key, 0.0) for s in timeline), default=0.0)


def table(rows: list[dict]) -> str:
    cols = [("mode", "mode", "{}"), ("status", "status", "{}"), ("completed", "completed", "{:.0f}"),
            ("failed", "failed", "{:.0f}"), ("req/s", "request_throughput", "{:.2f}"),
            ("out tok/s", "output_throughput", "{:.1f}"), ("TTFT p50 ms", "median_ttft_ms", "{:.0f}"),
            ("TTFT p99 ms", "p99_ttft_ms", "{:.0f}"), ("TPOT p50 ms", "median_tpot_ms", "{:.1f}"),
            ("peak running", "peak_running", "{:.0f}"), ("peak waiting", "peak_waiting", "{:.0f}"),
            ("peak KV pages", "peak_kv", "{:.0f}"), ("min resident experts", "min_resident", "{:.0f}")]
    head = "| " + " | ".join(c[0] for c in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    lines = [head, sep]
    for r in rows:
        cells = [fmt.format(r[key]) if key in r else "—" for _, key, fmt in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], path: Path, budget: int, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for mode, tl in runs.items():
        t = [s["t"] for s in tl]
        kv_mib = [s.get("rimuru:kv_pages_used", 0) * info["kv_page_bytes"] / 2**20 for s in tl]
        exp_mib = [s.get("rimuru:resident_experts", 0) / max(info["total_experts"], 1) * info["expert_bytes"] / 2**20
                   for s in tl]
        axes[0].plot(t, kv_mib, label=f"{mode}: KV cache")
        axes[0].plot(t, exp_mib, "--", label=f"{mode}: resident experts")
        axes[1].plot(t, [s.get("rimuru:num_requests_running", 0) for s in tl], label=f"{mode}: running")
        axes[1].plot(t, [s.get("rimuru:num_requests_waiting", 0) for s in tl], ":", label=f"{mode}: waiting")
        axes[2].plot(t, [s.get("rimuru:expert_bytes_loaded_total", 0) / 2**20 for s in tl], label=mode)
    axes[0].set_ylabel("MiB in the pool")
    axes[0].set_title(f"memory split over time (budget {budget / 2**20:.1f} MiB), from /metrics")
    axes[1].set_ylabel("requests")
    axes[2].set_ylabel("expert MiB loaded (PCIe)")
    axes[2].set_xlabel("seconds since the benchmark started")
    for ax in axes:
        ax.legend(fontsize=7, loc="upper right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Rimuru demo: one small MoE model, static vs elastic offloading")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: build a demo one)")
    ap.add_argument("--modes", default="static,fixed,elastic")
    ap.add_argument("--num-prompts", type=int, default=60)
    ap.add_argument("--request-rate", type=float, default=None,
                    help="req/s (default: 1.5x what static completes on this machine, measured first)")
    ap.add_argument("--max-prompt-len", type=int, default=192)
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--kv-tokens", type=int, default=640, help="KV room (tokens) left beside all experts")
    ap.add_argument("--expert-offload-limit", type=int, default=8,
                    help="elastic mode: the most experts a layer may offload (of 16)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="demo-out", help="writes demo.md and demo_memory.png here")
    ap.add_argument("--update-docs", action="store_true", help="also write docs/demo.md and docs/demo_memory.png")
    ap.add_argument("--keep-work", action="store_true", help="keep the temporary checkpoint and server logs")
    ap.add_argument("--resident-experts", type=float, default=0.5,
                    help="fixed mode: experts kept resident per layer (a count, or a fraction < 1)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="rimuru-demo-"))
    try:
        return _run(args, work)
    finally:
        if args.keep_work:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> int:
    from rimuru.bench.cli import bench_serve

    ckpt = Path(args.model) if args.model else build_checkpoint(work / "demo-moe")
    flags = {"device": "cpu", "max_model_len": args.max_prompt_len + args.max_output_len + 16,
             "max_num_seqs": 64, "max_num_batched_tokens": 1024}
    mode_flags = {"elastic": {"expert_offload_limit": args.expert_offload_limit},
                  "fixed": {"resident_experts": args.resident_experts}}
    budget, info = pick_budget(ckpt, args.kv_tokens, flags)
    print(f"checkpoint {ckpt}; budget {budget} B: all experts {info['expert_bytes']} B + KV for ~{args.kv_tokens} "
          "tokens", flush=True)
    rate_note = "given"
    if args.request_rate is None:
        args.request_rate = round(measured_request_rate(ckpt, budget, flags, args.kv_tokens, args.max_prompt_len // 2,
                                                        args.max_output_len), 2)
        rate_note = "1.5x what static mode completed on this machine, measured first"
        print(f"request rate {args.request_rate} req/s ({rate_note})", flush=True)
    url = f"http://127.0.0.1:{args.port}"
    rows: list[dict] = []
    runs: dict[str, list[dict]] = {}
    for mode in args.modes.split(","):
        log = work / f"serve-{mode}.log"
        print(f"\n=== {mode}: starting rimuru serve (log {log})", flush=True)
        proc = start_server(ckpt, mode, budget, args.port, {**flags, **mode_flags.get(mode, {})}, log)
        try:
            if not wait_ready(proc, url):
                reason = log.read_text().strip().splitlines()[-1:] or ["server did not start"]
                print(f"{mode}: not run: {reason[0]}", flush=True)
                rows.append({"mode": mode, "status": f"not run: {reason[0][:120]}"})
                continue
            report = asyncio.run(bench_serve(bench_args(url, ckpt, args)))
        finally:
            stop_server(proc)
        tl = report.get("metrics_timeline", [])
        runs[mode] = tl
        rows.append({"mode": mode, "status": "ok", **report,
                     "peak_running": peak(tl, "rimuru:num_requests_running"),
                     "peak_waiting": peak(tl, "rimuru:num_requests_waiting"),
                     "peak_kv": peak(tl, "rimuru:kv_pages_used"),
                     "min_resident": min((s.get("rimuru:resident_experts", 0) for s in tl), default=0)})
        out_dir = Path(args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"bench-{mode}.json").write_text(json.dumps(report, indent=1))
    result = table(rows)
    print("\n" + result)
    folders = [Path(args.out_dir)] + ([Path("docs")] if args.update_docs else [])
    text = (
        "# Demo: `make demo` (python -m rimuru.demo)\n\n"
        f"Generated on {os.cpu_count()} CPU cores, no GPU. Model: the demo "
        f"qwen2_moe checkpoint ({DEMO_SHAPE['num_hidden_layers']} layers, {DEMO_SHAPE['num_experts']} experts/layer, "
        f"random weights); budget {budget / 2**20:.2f} MiB = every expert "
        f"({info['expert_bytes'] / 2**20:.2f} MiB) + KV for about {args.kv_tokens} tokens + weights + workspace; "
        f"fixed mode keeps {args.resident_experts:g} of each layer's experts resident. "
        f"ShareGPT: {args.num_prompts} prompts at {args.request_rate} req/s ({rate_note}; Poisson, seed {args.seed}), "
        f"prompts <= {args.max_prompt_len} tokens, replies capped at {args.max_output_len} tokens, EOS ignored. "
        "The numbers vary with the machine.\n\n"
        + result + "\n\n![memory split over time](demo_memory.png)\n")
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        if runs:
            plot(runs, folder / "demo_memory.png", budget, info)
        (folder / "demo.md").write_text(text)
        print(f"wrote {folder / 'demo.md'}" + (f" and {folder / 'demo_memory.png'}" if runs else ""))
    return 0 if any(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
