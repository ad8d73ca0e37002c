"""Incremental detokenisation per token: the tokenizers library's DecodeStream against the window path.

engine/detokenizer.py takes DecodeStream for fast tokenizers and a window of two `tokenizer.decode` calls otherwise;
a serving step detokenises every running request, so the per-token cost multiplies by the batch. Both paths run
over the same ShareGPT replies (token by token, one request state each) and must produce the same text.

    PYTHONPATH=. python benchmarks/bench_detokenize.py --tokenizer DIR --output-json out.json

DIR: a Hugging Face tokenizer folder, e.g. the Qwen vocabulary built by
`../shared/tools/vllm-anchor/make_qwen_tokenizer.py DIR`; without it, the tiny test tokenizer (rimuru.testing).
CPU timings, median of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import metadata  # noqa: E402
from rimuru.bench.workload import iter_sharegpt  # noqa: E402
from rimuru.engine.detokenizer import _rust_backend, detokenize_incrementally  # noqa: E402


class WindowOnly:
    """The tokenizer without its Rust backend: detokenize_incrementally takes the window path."""

    def __init__(self, tok: Any) -> None:
        self.decode = tok.decode


def replies(tok: Any, num_tokens: int) -> list[list[int]]:
    out, total = [], 0
    for rec in iter_sharegpt():
        for turn in rec.get("conversations", []):
            if turn.get("from") == "gpt" and turn.get("value"):
                ids = tok.encode(turn["value"], add_special_tokens=False)[:512]
                out.append(ids)
                total += len(ids)
                if total >= num_tokens:
                    return out
    return out


def run(tok: Any, seqs: list[list[int]]) -> tuple[float, str]:
    text = []
    t0 = time.perf_counter()
    for ids in seqs:
        req = SimpleNamespace(output_token_ids=[], prefix_offset=0, read_offset=0, decode_stream=None)
        for t in ids:
            req.output_token_ids.append(t)
            text.append(detokenize_incrementally(tok, req, skip_special_tokens=True))
    return time.perf_counter() - t0, "".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--num-tokens", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from rimuru.testing.tiny_models import make_tokenizer

        tok = make_tokenizer()
    if _rust_backend(tok) is None:
        raise SystemExit("this tokenizer has no usable Rust backend: both paths would be the window path")
    seqs = replies(tok, args.num_tokens)
    n = sum(len(s) for s in seqs)
    rows = []
    texts = {}
    for name, view in (("decode_stream", tok), ("window", WindowOnly(tok))):
        times = []
        for _ in range(args.repeats):
            elapsed, texts[name] = run(view, seqs)
            times.append(elapsed)
        rows.append({"path": name, "us_per_token": round(statistics.median(times) / n * 1e6, 2), "tokens": n})
    same = texts["decode_stream"] == texts["window"]
    for r in rows:
        print(f"{r['path']:14} {r['us_per_token']:8.2f} us/token over {n} tokens")
    print(f"same text from both paths: {same}")
    if args.output_json:
        meta = metadata("detokenize", config=vars(args), tokenizer_vocab=len(tok))
        Path(args.output_json).write_text(json.dumps({**meta, "rows": rows, "same_text": same}, indent=1))
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
