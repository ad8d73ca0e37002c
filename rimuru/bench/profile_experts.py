"""`rimuru profile`: measure each MoE layer's expert popularity on real prompts and write a ranking file.

    rimuru profile MODEL [engine flags] --dataset sharegpt --num-prompts N --output ranking.json \
        [--max-tokens M] [--seed S]

The engine runs N ShareGPT requests (prompt token ids; output length = the reply's, capped by
--max-tokens; EOS ignored) while a `RoutingCounter` attached to the engine's expert provider counts,
on the device, every (token, expert) assignment of every MoE layer: prefill and decode tokens alike,
as the router made them. Layer l's probabilities are its counts divided by its total; they are saved
with `ExpertPopularity.save` and a short summary (top experts, skew) is printed.

The profile runs eagerly (`enforce_eager=True`): a captured CUDA graph replays the tensors that were
attached when it was captured, which happens inside `LLMEngine.__init__` before a counter can be
attached, and padded rows of a graph's batch would be counted as if they were tokens.
`profile_routing` refuses an engine that has decode graphs.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rimuru.experts.popularity import ExpertPopularity

logger = logging.getLogger("rimuru")

SUMMARY_TOP = 5  # experts listed per layer in the summary
SKEW_FRACTION = 0.25  # the summary's skew: the share of routing that the top 25 % of experts take


class ProfileRequest(Protocol):  # rimuru.bench.workload.SampleRequest has this shape
    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_len(self) -> int: ...


def count_routing(llm: Any, requests: Sequence[ProfileRequest], *, max_tokens: int | None = None,
                  temperature: float = 1.0, seed: int = 0, use_tqdm: bool = False) -> np.ndarray:
    """Runs `requests` through `llm` (an `LLM`) and returns the routing counts [L_moe, E] int64:
    `counts[l, e]` = (token, expert) assignments MoE layer l made to expert e, over every forward token.

    Output lengths are each request's `output_len`, capped by `max_tokens`; EOS is ignored. Sampling is
    seeded per request (`seed + i`), so a run is reproducible. The engine must be idle and have no
    CUDA graphs (build it with enforce_eager=True). The providers' previous counters are restored.
    """
    from tqdm import tqdm

    from rimuru.engine.sampling_params import SamplingParams
    from rimuru.experts.routing_counter import EXACT_LIMIT, RoutingCounter

    engine = llm.engine
    if engine.runner.graphs is not None:
        raise ValueError("profiling needs an engine without CUDA graphs (graphs replay the counters attached when "
                         "they were captured, and count padded rows): build the LLM with enforce_eager=True")
    if engine.has_unfinished_requests():
        raise ValueError("the engine has unfinished requests; profile an idle engine")
    if not requests:
        raise ValueError("no requests to profile")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    spec = engine.spec
    counter = RoutingCounter(spec.num_moe_layers, spec.num_experts, engine.device)
    # a float32 count is exact below 2**24: move the counts to the host before any entry could pass it
    per_step = engine.config.max_num_batched_tokens * spec.num_experts_per_tok
    flush_every = max(1, EXACT_LIMIT // per_step)
    total = np.zeros((spec.num_moe_layers, spec.num_experts), dtype=np.int64)

    def flush() -> None:
        total[...] += counter.snapshot_and_reset().numpy().astype(np.int64)

    # a run counts what it forwards: blocks cached by earlier runs would skip their prompt tokens
    engine.reset_prefix_cache()
    previous = engine.runtime.swap_routing_counter(counter)
    submitted: list[str] = []
    try:
        for i, r in enumerate(requests):
            out_len = r.output_len if max_tokens is None else min(r.output_len, max_tokens)
            params = SamplingParams(max_tokens=out_len, temperature=temperature, ignore_eos=True,
                                    seed=seed + i if temperature > 0 else None)
            rid = f"profile-{i}"
            engine.add_request(rid, list(r.prompt_token_ids), params)
            submitted.append(rid)
        bar = tqdm(total=len(submitted), desc="profile", disable=not use_tqdm)
        steps = 0
        while engine.has_unfinished_requests():
            finished = sum(1 for out in engine.step() if out.finished)
            bar.update(finished)
            steps += 1
            if steps % flush_every == 0:
                flush()
        bar.close()
        flush()
    except BaseException:
        for rid in submitted:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        raise
    finally:
        engine.runtime.swap_routing_counter(previous)
    return total


def popularity_from_counts(counts: np.ndarray, model: str, num_prompts: int) -> ExpertPopularity:
    """Each layer's counts divided by its total (the ranking file's probabilities)."""
    return ExpertPopularity.from_counts(model, counts, num_prompts)


def profile_routing(llm: Any, requests: Sequence[ProfileRequest], *, model_name: str | None = None,
                    max_tokens: int | None = None, temperature: float = 1.0, seed: int = 0,
                    use_tqdm: bool = False) -> ExpertPopularity:
    """Per-layer routing probabilities of `llm` on `requests` (see `count_routing`), named `model_name`
    (default: the engine's model name or directory name)."""
    counts = count_routing(llm, requests, max_tokens=max_tokens, temperature=temperature, seed=seed,
                           use_tqdm=use_tqdm)
    name = model_name if model_name is not None else Path(str(llm.engine.config.model)).name
    return popularity_from_counts(counts, name, num_prompts=len(requests))


def top_share(pop: ExpertPopularity, fraction: float = SKEW_FRACTION) -> tuple[int, np.ndarray]:
    """(k, share[L]): k = ceil(fraction * E) experts, and per layer the probability mass of its top k."""
    k = max(1, math.ceil(fraction * pop.num_experts))
    top = np.take_along_axis(pop.probabilities, pop.rankings[:, :k], axis=1)
    return k, top.sum(axis=1)


def format_summary(pop: ExpertPopularity, top: int = SUMMARY_TOP) -> str:
    L, E = pop.num_layers, pop.num_experts
    k, shares = top_share(pop)
    lines = [f"expert routing of {pop.model}: {pop.num_prompts} prompts, {L} MoE layers x {E} experts "
             f"(uniform share {100 / E:.2f} %)"]
    for layer in range(L):
        best = pop.rankings[layer, :top].tolist()
        listed = "  ".join(f"{e}:{100 * pop.probabilities[layer, e]:.2f}%" for e in best)
        lines.append(f"  layer {layer:3d}  top-{len(best)} {listed}  | top {k}: {100 * shares[layer]:.1f} %")
    lo, hi = int(np.argmin(shares)), int(np.argmax(shares))
    lines.append(f"skew: the top {k} of {E} experts ({100 * k / E:.0f} %) take {100 * shares.mean():.1f} % of the "
                 f"routing on average (min {100 * shares[lo]:.1f} % layer {lo}, max {100 * shares[hi]:.1f} % "
                 f"layer {hi}); uniform routing would give {100 * k / E:.1f} %")
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line


def register(sub: argparse._SubParsersAction) -> None:
    from rimuru.config import add_engine_args

    p = sub.add_parser("profile", help="measure expert popularity on ShareGPT prompts; write a ranking file")
    add_engine_args(p)  # includes --seed (engine and request sampling) and --tokenizer
    p.add_argument("--dataset", "--dataset-name", dest="dataset", default="sharegpt", choices=["sharegpt"])
    p.add_argument("--dataset-path", default=None, help="a ShareGPT JSON file (default: the bundled one)")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--output", required=True, help="ranking JSON to write (read by --expert-ranking)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on each request's output length")
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--max-total-len", type=int, default=2048, help="drop pairs longer (also capped by the context)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (seeded per request)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rimuru.bench.workload import load_tokenizer, sample_sharegpt
    from rimuru.config import EngineConfig
    from rimuru.engine.llm import LLM
    from rimuru.engine.setup import start_or_exit

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.num_prompts < 1:
        raise SystemExit(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise SystemExit(f"--max-tokens must be at least 1, got {args.max_tokens}")
    config = EngineConfig.from_cli_args(args)
    if not config.enforce_eager:
        logger.info("profile runs eagerly (enforce_eager=True): routing is counted outside CUDA graphs")
        config = config.with_(enforce_eager=True)
    if config.enable_prefix_caching:
        # a ranking counts every prompt token's routing; cached prefixes would skip theirs
        config = config.with_(enable_prefix_caching=False)
    llm = start_or_exit(lambda: LLM(**vars(config)))
    engine = llm.engine
    # the engine's own tokenizer (--tokenizer or the model directory's); else the Qwen vocabulary
    tok_path = (config.tokenizer or config.model) if engine.tokenizer is not None else None
    if tok_path is None:
        logger.info("no tokenizer given or found with the model: counting ShareGPT with the Qwen vocabulary")
    max_total = min(args.max_total_len, engine.max_model_len)
    requests = sample_sharegpt(load_tokenizer(tok_path), args.num_prompts, args.seed, path=args.dataset_path,
                               max_prompt_len=min(args.max_prompt_len, max_total - 1), max_total_len=max_total,
                               max_output_len=args.max_tokens)
    if not requests:
        raise SystemExit("no ShareGPT pair fits this model's context; lower --max-tokens or raise --max-model-len")
    if len(requests) < args.num_prompts:
        logger.warning("only %d of %d ShareGPT pairs fit the limits", len(requests), args.num_prompts)
    vocab = engine.spec.vocab_size
    if any(t >= vocab for r in requests for t in r.prompt_token_ids):
        raise SystemExit(f"the prompts' token ids exceed the model's vocabulary ({vocab}): pass --tokenizer DIR")
    counts = count_routing(llm, requests, temperature=args.temperature, seed=args.seed,
                           use_tqdm=not args.no_progress)
    pop = popularity_from_counts(counts, Path(str(config.model)).name, num_prompts=len(requests))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    pop.save(out)
    tokens = int(counts[0].sum()) // engine.spec.num_experts_per_tok  # every token passes every MoE layer once
    print(format_summary(pop))
    print(f"{len(requests)} requests, {tokens} tokens routed per layer, {engine.forward_steps} forward steps; "
          f"wrote {out}")
    return 0
