"""Soak the server with mixed load: valid, invalid and aborted requests, then check page accounting.

usage: python scripts/soak.py [--base-url URL --model NAME] [--num-requests 600] [--concurrency 32]
Without --base-url it builds a tiny MoE checkpoint and serves it in-process on a small page pool.
Exit status 0 only if every valid request succeeded, every invalid one got a 4xx JSON error, and the
server ends with no request running or waiting and no KV page used.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack

import httpx
from tqdm import tqdm

from rimuru.bench.metrics_poll import parse_metrics

INVALID = [
    (b'{"model": "M", "prompt": ', "malformed JSON"),
    (b'{"model": "nope", "prompt": "hi"}', "unknown model"),
    (b'{"model": "M", "prompt": "hi", "max_tokens": 0}', "max_tokens 0"),
    (b'{"model": "M", "prompt": "hi", "max_tokens": 1000000}', "max_tokens too large"),
    (b'{"model": "M", "prompt": "hi", "temperature": 9}', "temperature"),
    (b'{"model": "M", "prompt": "hi", "top_p": 0}', "top_p"),
    (b'{"model": "M", "prompt": ""}', "empty prompt"),
    (b'{"model": "M", "prompt": [' + b"7," * 4000 + b"7]}", "prompt too long"),
]


async def one(client: httpx.AsyncClient, model: str, i: int, rng: random.Random, tally: Counter) -> None:
    kind = rng.choices(["valid", "invalid", "abort"], weights=[6, 2, 2])[0]
    if kind == "invalid":
        body, _ = INVALID[rng.randrange(len(INVALID))]
        r = await client.post("/v1/completions", content=body.replace(b'"M"', f'"{model}"'.encode()),
                              headers={"Content-Type": "application/json"})
        ok = 400 <= r.status_code < 500 and set(r.json().get("error", {})) == {"message", "type", "param", "code"}
        tally[f"invalid->{r.status_code}"] += 1
        tally["invalid_ok" if ok else "invalid_BAD"] += 1
        return
    body = {"model": model, "prompt": f"soak request {i}: " + "words " * rng.randrange(1, 30),
            "max_tokens": rng.randrange(1, 48), "temperature": rng.choice([0.0, 0.7, 1.0]),
            "n": rng.choice([1, 1, 1, 2]), "ignore_eos": rng.random() < 0.5, "seed": i}
    if kind == "valid" and rng.random() < 0.5:
        r = await client.post("/v1/completions", json=body)
        tally[f"valid->{r.status_code}"] += 1
        tally["valid_ok" if r.status_code == 200 and r.json()["choices"] else "valid_BAD"] += 1
        return
    body["stream"] = True
    cut = rng.randrange(0, 4) if kind == "abort" else None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = 0
        async for line in r.aiter_lines():
            if cut is not None and chunks >= cut:
                break  # leaving the block closes the connection mid-stream
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
            if line == "data: [DONE]":
                break
        tally[f"{kind}->{r.status_code}"] += 1
        if kind == "valid":
            tally["valid_ok" if chunks > 0 else "valid_BAD"] += 1


async def soak(url: str, model: str, n: int, concurrency: int, seed: int) -> Counter:
    rng = random.Random(seed)
    tally: Counter = Counter()
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=n, desc="soak")
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def guarded(i: int) -> None:
            async with sem:
                try:
                    await one(client, model, i, rng, tally)
                except Exception as exc:  # a crash or hang would show here
                    tally[f"client_error:{type(exc).__name__}"] += 1
            bar.update(1)

        await asyncio.gather(*(guarded(i) for i in range(n)))
    bar.close()
    return tally


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = parse_metrics(httpx.get(url + "/metrics").text)
        keys = ("rimuru:num_requests_running", "rimuru:num_requests_waiting", "rimuru:kv_pages_used")
        if all(m.get(k, 0) == 0 for k in keys) or time.monotonic() > deadline:
            return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=None)
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with ExitStack() as stack:
        url = args.base_url
        if url is None:
            from rimuru.config import EngineConfig
            from rimuru.engine.llm_engine import LLMEngine
            from rimuru.server.app import ServerConfig
            from rimuru.server.background import BackgroundServer
            from rimuru.testing.tiny_models import make_tiny_checkpoint

            ckpt = make_tiny_checkpoint("qwen2_moe", stack.enter_context(tempfile.TemporaryDirectory()))
            engine = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", max_model_len=256,
                                            gpu_memory_budget="24MiB", max_num_batched_tokens=512, max_num_seqs=64))
            srv = stack.enter_context(BackgroundServer(engine, ServerConfig(served_model_name=args.model)))
            url = srv.url
        t0 = time.perf_counter()
        tally = asyncio.run(soak(url, args.model, args.num_requests, args.concurrency, args.seed))
        elapsed = time.perf_counter() - t0
        m = wait_idle(url)
    served = sum(v for k, v in tally.items() if k.startswith(("valid->200", "abort->200")))
    by_status = {k: v for k, v in sorted(tally.items()) if "->" in k}
    print(f"\nrequests sent: {args.num_requests} in {elapsed:.1f} s (concurrency {args.concurrency})")
    print(f"requests served (HTTP 200): {served}")
    print(f"valid completed: {tally['valid_ok']}  valid failed: {tally['valid_BAD']}")
    print(f"invalid answered with a JSON 4xx: {tally['invalid_ok']}  wrong answers: {tally['invalid_BAD']}")
    print(f"responses by kind->status: {by_status}")
    client_errors = {k: v for k, v in tally.items() if k.startswith("client_error")}
    print(f"client-side errors (crash/hang/reset): {client_errors or 'none'}")
    print("final page accounting: running={:.0f} waiting={:.0f} kv_pages_used={:.0f} server_tracked={:.0f} "
          "forward_steps={:.0f}".format(
              m.get("rimuru:num_requests_running", -1), m.get("rimuru:num_requests_waiting", -1),
              m.get("rimuru:kv_pages_used", -1), m.get("rimuru:server_tracked_requests", -1),
              m.get("rimuru:forward_steps_total", -1)))
    ok = (tally["valid_BAD"] == 0 and tally["invalid_BAD"] == 0 and not client_errors
          and m.get("rimuru:kv_pages_used") == 0 and m.get("rimuru:num_requests_running") == 0
          and m.get("rimuru:num_requests_waiting") == 0)
    print("SOAK PASSED" if ok else "SOAK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
