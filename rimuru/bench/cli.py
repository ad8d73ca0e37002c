"""`rimuru bench serve`: replay ShareGPT against an OpenAI-compatible server and report latencies.

Datasets: `sharegpt` (one request per conversation, vLLM's sampling), `shared-prefix` (the same requests
behind one fixed system prompt of `--shared-prefix-len` tokens) and `sharegpt-multiturn` (conversations
replayed turn by turn, each turn's prompt the history so far; `--request-rate` is then conversations/s)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    s = bench_sub.add_parser("serve", help="replay ShareGPT against a running server")
    add_serve_args(s)
    s.set_defaults(func=run_serve)


def add_serve_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--model", required=True, help="the served model name")
    s.add_argument("--dataset", "--dataset-name", dest="dataset", default="sharegpt", choices=DATASETS,
                   help="sharegpt: first turns; shared-prefix: each behind one system prompt of --shared-prefix-len "
                        "tokens (vLLM's prefix_repetition with one prefix); sharegpt-multiturn: conversations with "
                        ">= 2 user turns, turn i's prompt turns 1..i-1 (with the dataset's replies) and user turn i")
    s.add_argument("--dataset-path", default=None, help="a ShareGPT JSON file (default: the bundled one)")
    s.add_argument("--num-prompts", type=int, default=100, help="requests to send (sharegpt-multiturn: turns)")
    s.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s (Poisson); inf = all at once. sharegpt-multiturn: conversations/s, each "
                        "conversation's next turn sent when its previous one finished")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions (the prompt; shared-prefix and multi-turn: concatenated) or "
                        "/v1/chat/completions (messages: system + user, or the conversation's turns)")
    s.add_argument("--shared-prefix-len", type=int, default=None,
                   help=f"shared-prefix: the system prompt's length in tokens (default {DEFAULT_SHARED_PREFIX_LEN}); "
                        "the ShareGPT limits apply to the prompt behind it")
    s.add_argument("--turn-think-time-s", type=float, default=None,
                   help="sharegpt-multiturn: seconds between a turn's end and the next turn's send (default 0)")
    s.add_argument("--burstiness", type=float, default=1.0)
    s.add_argument("--max-concurrency", type=int, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the Qwen vocabulary)")
    s.add_argument("--prompt-format", choices=["text", "token-ids"], default="text")
    s.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length")
    s.add_argument("--max-prompt-len", type=int, default=1024,
                   help="longest prompt in tokens (sharegpt-multiturn: the oldest turns are dropped to fit)")
    s.add_argument("--max-total-len", type=int, default=2048)
    s.add_argument("--max-output-len", type=int, default=None, help="cap on each reply's length")
    s.add_argument("--api-key", default=None)
    s.add_argument("--poll-metrics", type=float, default=0.0, help="sample /metrics every S seconds (0: off)")
    s.add_argument("--output-json", default=None)
    s.add_argument("--no-progress", action="store_true")


DATASETS = ["sharegpt", "shared-prefix", "sharegpt-multiturn"]
DEFAULT_SHARED_PREFIX_LEN = 1024
NEWER_FLAG_DEFAULTS = {"endpoint": "completions", "shared_prefix_len": None, "turn_think_time_s": None}


def check_serve_args(args: argparse.Namespace) -> None:
    """Flags that contradict each other or the dataset stop the run with a message saying which."""
    def bad(msg: str) -> None:
        raise SystemExit(f"rimuru bench serve: {msg}")

    if args.shared_prefix_len is not None:
        if args.dataset != "shared-prefix":
            bad(f"--shared-prefix-len is for --dataset shared-prefix, not {args.dataset}")
        if args.shared_prefix_len < 1:
            bad(f"--shared-prefix-len must be at least 1 token, got {args.shared_prefix_len}")
    if args.turn_think_time_s is not None:
        if args.dataset != "sharegpt-multiturn":
            bad(f"--turn-think-time-s is for --dataset sharegpt-multiturn, not {args.dataset}")
        if args.turn_think_time_s < 0:
            bad(f"--turn-think-time-s must be >= 0, got {args.turn_think_time_s}")
    if args.endpoint == "chat" and args.prompt_format == "token-ids":
        bad("--endpoint chat sends text messages; --prompt-format token-ids needs --endpoint completions")


def sample_requests(args: argparse.Namespace, tokenizer: object) -> list:
    from rimuru.bench.workload import sample_shared_prefix, sample_sharegpt, sample_sharegpt_multiturn

    limits = {"path": args.dataset_path, "fixed_output_len": args.sharegpt_output_len,
              "max_prompt_len": args.max_prompt_len, "max_total_len": args.max_total_len,
              "max_output_len": args.max_output_len}
    if args.dataset == "shared-prefix":
        n = args.shared_prefix_len if args.shared_prefix_len is not None else DEFAULT_SHARED_PREFIX_LEN
        return sample_shared_prefix(tokenizer, args.num_prompts, n, args.seed, **limits)
    if args.dataset == "sharegpt-multiturn":
        return sample_sharegpt_multiturn(tokenizer, args.num_prompts, args.seed, **limits)
    return sample_sharegpt(tokenizer, args.num_prompts, args.seed, **limits)


def git_commit() -> str | None:
    """The source commit results are recorded with: RIMURU_COMMIT when set, else HEAD of the checkout. The GPU
    machine's copy of the tree carries a `.git` that need not be the tree's commit (it can answer an earlier HEAD
    for a later tree), so device commands set RIMURU_COMMIT and it wins."""
    env = os.environ.get("RIMURU_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


async def bench_serve(args: argparse.Namespace) -> dict:
    from rimuru.bench.metrics_poll import MetricsPoller
    from rimuru.bench.serve_client import BenchConfig, run_benchmark, summarize
    from rimuru.bench.workload import conversation_indices, load_tokenizer, poisson_arrivals

    for name, default in NEWER_FLAG_DEFAULTS.items():  # a Namespace built in code (the demo) may lack them
        if not hasattr(args, name):
            setattr(args, name, default)
    check_serve_args(args)
    tokenizer = load_tokenizer(args.tokenizer)
    requests = sample_requests(args, tokenizer)
    # one arrival per conversation (a single-turn request is one)
    arrivals = poisson_arrivals(len(conversation_indices(requests)), args.request_rate, args.seed, args.burstiness)
    cfg = BenchConfig(base_url=args.base_url, model=args.model, request_rate=args.request_rate,
                      max_concurrency=args.max_concurrency, prompt_format=args.prompt_format,
                      api_key=args.api_key, seed=args.seed, endpoint=args.endpoint,
                      think_time_s=args.turn_think_time_s or 0.0)
    poller = MetricsPoller(args.base_url, args.poll_metrics) if args.poll_metrics > 0 else None
    if poller:
        poller.start()
    results, duration = await run_benchmark(cfg, requests, arrivals, show_progress=not args.no_progress)
    if poller:
        await poller.stop()
    summary = summarize(results, duration)
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "git_commit": git_commit(),
        "base_url": args.base_url,
        "model": args.model,
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "prompt_format": args.prompt_format,
        "endpoint": args.endpoint,
        "shared_prefix_len": (args.shared_prefix_len or DEFAULT_SHARED_PREFIX_LEN)
        if args.dataset == "shared-prefix" else None,
        "turn_think_time_s": args.turn_think_time_s,
        **summary,
        "input_lens": [r.prompt_len for r in results],
        "cached_tokens": [r.cached_tokens for r in results],
        "conversation_ids": [r.conversation for r in results],
        "turns": [r.turn for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts_s": [r.ttft for r in results],
        "errors": [r.error for r in results if r.error][:50],
    }
    if poller:
        report["metrics_timeline"] = [{"t": t, **vals} for t, vals in poller.samples]
    return report


def run_serve(args: argparse.Namespace) -> int:
    from rimuru.bench.serve_client import format_summary

    report = asyncio.run(bench_serve(args))
    print(format_summary(report))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(report, indent=1, default=float))
        print(f"wrote {args.output_json}")
    return 0 if report["completed"] > 0 or not report["num_prompts"] else 1
