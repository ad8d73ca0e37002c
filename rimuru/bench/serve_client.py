"""Async serving benchmark client: replays requests against an OpenAI-compatible `/v1/completions` (a prompt:
text or token ids) or `/v1/chat/completions` (the request's messages).

It streams every request (`stream_options.include_usage`, `ignore_eos`, as vLLM's client does) and
measures on the client: TTFT = first chunk carrying a choice, ITL = gaps between such chunks,
TPOT = (latency - TTFT) / (output tokens - 1) with the output tokens taken from the usage chunk, and the
prompt tokens the server's prefix cache gave (`usage.prompt_tokens_details.cached_tokens`) where the server
reports them (vLLM's and ours with `--enable-prompt-tokens-details`).

Requests of one conversation (multi-turn) go one after another: the first turn at the conversation's arrival,
each next turn once the previous one finished (plus a think time).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from tqdm.asyncio import tqdm

from rimuru.bench.workload import SampleRequest, conversation_indices


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    status: int | None = None
    start: float = 0.0
    end: float = 0.0  # when the response ended (perf_counter), success or not
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, None where not reported
    conversation: int | None = None
    turn: int = 0


@dataclass
class BenchConfig:
    base_url: str
    model: str
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    prompt_format: str = "text"  # text | token-ids
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 6 * 3600
    endpoint: str = "completions"  # completions | chat
    think_time_s: float = 0.0  # multi-turn: pause between a turn's end and the next turn's send


ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def request_payload(cfg: BenchConfig, req: SampleRequest) -> dict:
    """The JSON body of `req`: chat messages (the request's, or one user message holding its prompt) for the
    chat endpoint, the prompt as text or token ids for completions."""
    payload: dict = {"model": cfg.model}
    if cfg.endpoint == "chat":
        payload["messages"] = list(req.messages) if req.messages else [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt if cfg.prompt_format == "text" else req.prompt_token_ids
    payload.update({
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": cfg.ignore_eos,
    })
    return payload


async def send_one(client: httpx.AsyncClient, cfg: BenchConfig, req: SampleRequest) -> RequestResult:
    payload = request_payload(cfg, req)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    res = RequestResult(prompt_len=req.prompt_len, conversation=req.conversation, turn=req.turn)
    st = time.perf_counter()
    res.start = st
    last = st
    got_first = False
    try:
        async with client.stream("POST", cfg.base_url.rstrip("/") + ENDPOINTS[cfg.endpoint], json=payload,
                                 headers=headers) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if not got_first:
                        res.ttft = now - st
                        got_first = True
                    else:
                        res.itl.append(now - last)
                    last = now
                elif chunk.get("usage"):
                    usage = chunk["usage"]
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    res.prompt_len = int(usage.get("prompt_tokens") or res.prompt_len)
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    res.cached_tokens = int(cached) if cached is not None else None
        res.latency = last - st
        res.success = got_first
        if not got_first:
            res.error = "no token chunk received"
    except Exception as exc:  # network errors count as failed requests, not crashes
        res.error = f"{type(exc).__name__}: {exc}"
    res.end = time.perf_counter()
    return res


async def run_benchmark(cfg: BenchConfig, requests: list[SampleRequest], arrivals: list[float],
                        show_progress: bool = True) -> tuple[list[RequestResult], float]:
    """Sends the requests, bounded by max_concurrency; returns their results (in `requests`' order) and the
    duration. `arrivals` holds one send offset per conversation (`conversation_indices`' order; a request
    without a conversation is one): its first turn is sent then, every next turn `think_time_s` after the previous
    turn's response ended."""
    convs = conversation_indices(requests)
    if len(arrivals) != len(convs):
        raise ValueError(f"{len(arrivals)} arrival times for {len(convs)} conversations")
    limits = httpx.Limits(max_connections=cfg.max_concurrency or 10_000, max_keepalive_connections=256)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    pbar = tqdm(total=len(requests), desc="requests", disable=not show_progress)

    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        start = time.perf_counter()

        async def send(req: SampleRequest) -> RequestResult:
            if sem is None:
                res = await send_one(client, cfg, req)
            else:
                async with sem:
                    res = await send_one(client, cfg, req)
            pbar.update(1)
            return res

        results: list[RequestResult | None] = [None] * len(requests)

        async def conversation(turns: list[int], at: float) -> None:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            for n, i in enumerate(turns):
                if n and cfg.think_time_s > 0:
                    await asyncio.sleep(cfg.think_time_s)
                results[i] = await send(requests[i])

        await asyncio.gather(*(conversation(c, t) for c, t in zip(convs, arrivals, strict=True)))
        duration = time.perf_counter() - start
    pbar.close()
    return [r for r in results if r is not None], duration


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    ttft = [r.ttft * 1e3 for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1e3 for r in ok if r.output_tokens > 1]
    itl = [x * 1e3 for r in ok for x in r.itl]
    e2e = [r.latency * 1e3 for r in ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            key = str(r.status) if r.status is not None else "network"
            errors[key] = errors.get(key, 0) + 1
    out = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors_by_status": errors,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    # prompt tokens the server's prefix cache gave, over the successful requests whose usage reported them
    reported = [r for r in ok if r.cached_tokens is not None]
    out["cached_tokens_reported"] = len(reported)
    out["total_cached_tokens"] = sum(r.cached_tokens or 0 for r in reported) if reported else None
    reported_in = sum(r.prompt_len for r in reported)
    out["cached_token_fraction"] = out["total_cached_tokens"] / reported_in if reported and reported_in else None
    series = [("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)]
    if any(r.conversation is not None for r in results):  # multi-turn: first turns against later turns
        series += [("ttft_first_turn", [r.ttft * 1e3 for r in ok if r.turn == 0]),
                   ("ttft_later_turns", [r.ttft * 1e3 for r in ok if r.turn > 0])]
        out["conversations"] = len({r.conversation for r in results})
    for name, vals in series:
        out[f"mean_{name}_ms"] = float(np.mean(vals)) if vals else 0.0
        out[f"median_{name}_ms"] = _pct(vals, 50)
        out[f"p99_{name}_ms"] = _pct(vals, 99)
    return out


def format_summary(s: dict) -> str:
    rows = [
        ("Successful requests", f"{s['completed']}"),
        ("Failed requests", f"{s['failed']}"),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", f"{s['total_input_tokens']}"),
        ("Total generated tokens", f"{s['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        rows += [(f"Mean {title} (ms)", f"{s[f'mean_{name}_ms']:.2f}"),
                 (f"Median {title} (ms)", f"{s[f'median_{name}_ms']:.2f}"),
                 (f"P99 {title} (ms)", f"{s[f'p99_{name}_ms']:.2f}")]
    if s.get("total_cached_tokens") is not None:
        rows.append(("Total cached prompt tokens", f"{s['total_cached_tokens']}"))
    if "mean_ttft_first_turn_ms" in s:
        rows += [("Conversations", f"{s['conversations']}"),
                 ("Median TTFT, first turns (ms)", f"{s['median_ttft_first_turn_ms']:.2f}"),
                 ("Median TTFT, later turns (ms)", f"{s['median_ttft_later_turns_ms']:.2f}")]
    width = max(len(k) for k, _ in rows) + 4
    lines = ["{:=^{w}}".format(" Serving Benchmark Result ", w=width + 12)]
    lines += [f"{k:<{width}}{v:>12}" for k, v in rows]
    if s.get("errors_by_status"):
        lines.append(f"{'Errors by status':<{width}}{json.dumps(s['errors_by_status']):>12}")
    lines.append("=" * (width + 12))
    return "\n".join(lines)
