"""`rimuru simulate`: would elastic expert offloading help this model, card and traffic? (no GPU needed)

    rimuru simulate --model qwen1.5-moe-a2.7b --gpu-memory-budget 32GiB --dataset sharegpt \\
        --request-rate 10 --num-prompts 500 --modes static,fixed,elastic --resident-experts 50 --seed 0 \
        --output-json sim.json

Per mode it runs the trace once at --request-rate (peak running, forward steps, throughput, TTFT/TPOT,
evictions/grows, PCIe bytes) and then a rate sweep: the largest rate of --sweep-rates such that it and
every lower rate meet TTFT p99 <= --slo-ttft-p99 (the same prompts, new Poisson arrivals per rate).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rimuru.bench.cli import git_commit
from rimuru.config import OFFLOAD_ACCESS, EngineConfig, add_renamed_flags, format_bytes, parse_bytes
from rimuru.experts.adjuster import AdjusterConfig
from rimuru.experts.popularity import ExpertPopularity
from rimuru.experts.runtime_builders import slo_config
from rimuru.model_spec import ModelSpec, load_model_spec
from rimuru.models.dummy_routing import cap_shares
from rimuru.sim.cost_model import HARDWARE
from rimuru.sim.simulator import ADJUSTERS, MODES, SimConfig, SimRequest, Simulation, SimulationError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("simulate", help="capacity simulator: static / fixed / elastic on a cost model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="preset name or a directory with config.json")
    p.add_argument("--gpu-memory-budget", required=True, help="e.g. 32GiB")
    p.add_argument("--dataset", default="sharegpt",
                   help="sharegpt | sharegpt-multiturn (a conversation's turns one after another) | "
                   "fixed:PROMPT_LEN:OUTPUT_LEN")
    p.add_argument("--request-rate", type=float, default=10.0,
                   help="requests/s (Poisson); sharegpt-multiturn: conversations/s, as rimuru bench serve")
    p.add_argument("--turn-think-time-s", type=float, default=0.0,
                   help="sharegpt-multiturn: the pause between a turn's end and the next turn, as rimuru bench serve")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--modes", default="static,elastic", help="static,fixed,elastic (fixed needs --resident-experts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json")
    p.add_argument("--plot", help="PNG of the memory split and running/waiting over time")
    p.add_argument("--resident-experts", type=float,
                   help="fixed mode: resident experts per layer, a count (>= 1) or a fraction (< 1), as rimuru serve")
    p.add_argument("--expert-offload-limit", type=int,
                   help="the most experts one layer may offload (default as rimuru serve: fixed E - resident, "
                        "elastic E / 6)")
    p.add_argument("--offload-access", default=EngineConfig.offload_access, choices=OFFLOAD_ACCESS,
                   help="fixed and elastic: direct (the MoE kernel reads offloaded experts in host memory; default, "
                        "as rimuru serve) | copy (load buffers, piecewise graphs)")
    p.add_argument("--adjuster", default=EngineConfig.adjuster, help="elastic mode's adjuster(s): cost | paper | "
                   "paper,cost (each one runs; sections 'elastic' for paper, 'elastic-cost' for cost)")
    p.add_argument("--slo-ttft-p99-ms", type=float, help="cost adjuster: TTFT target, as rimuru serve")
    p.add_argument("--slo-tpot-p99-ms", type=float, help="cost adjuster: TPOT target, as rimuru serve")
    add_renamed_flags(p)
    p.add_argument("--routing", default="uniform", help="uniform | zipf:S (seeded power-law router)")
    p.add_argument("--ranking", help="ranking JSON from `rimuru profile` (overrides --routing)")
    p.add_argument("--hardware", default="h200", choices=sorted(HARDWARE))
    p.add_argument("--peak-tflops", type=float, help="override the hardware's bf16 TFLOP/s")
    p.add_argument("--hbm-bandwidth", type=float, help="override, GB/s")
    p.add_argument("--pcie-bandwidth", type=float, help="override, GB/s")
    p.add_argument("--flops-efficiency", type=float)
    p.add_argument("--bandwidth-efficiency", type=float)
    p.add_argument("--copy-overlap", type=float, help="share of compute time copies hide behind (0..1)")
    p.add_argument("--step-overhead-ms", type=float)
    p.add_argument("--piecewise-overhead-us", type=float,
                   help="per MoE layer, a pass with experts offloaded (piecewise graphs) over one with all resident")
    p.add_argument("--workspace", help="the workspace the engine measured at start-up (its workspace_bytes stat, "
                   "e.g. 1400MiB); default: the simulator's bound from the batch limits and the hardware's scratch")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="read each pass's tokens before scheduling the next (default: async, as rimuru serve on a GPU)")
    p.add_argument("--admission-max-loss", type=float,
                   help="cost adjuster without a TTFT target: the share of long-run tokens/s admitting a queue may "
                        "give up (default: the engine's, CostAdjusterConfig.admission_max_loss)")
    p.add_argument("--no-kv-compaction", action="store_true",
                   help="grows wait for mid pages to empty by themselves (default: KV compaction, as the engine)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--sweep-rates", default="2,5,10,15,20,30,40,60", help="comma list; empty: no sweep")
    p.add_argument("--slo-ttft-p99", type=float, default=2.0, help="seconds, the sweep's criterion")
    p.set_defaults(func=run)


def load_requests(dataset: str, num_prompts: int, seed: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per request; ShareGPT through the shared loader (Qwen vocabulary).
    `sharegpt-multiturn`: the turns of `rimuru bench serve --dataset sharegpt-multiturn --max-prompt-len 2048
    --max-total-len 3072` (each turn's prompt the history), in the client's order (`conversations` groups them)."""
    return load_workload(dataset, num_prompts, seed)[0]


def conversations(dataset: str, num_prompts: int, seed: int) -> list[list[int]]:
    """Indices into `load_requests`' list by conversation, turns in order (a request on its own is one)."""
    return load_workload(dataset, num_prompts, seed)[1]


def load_workload(dataset: str, num_prompts: int, seed: int) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """The requests' (prompt tokens, output tokens) and their conversations, grouped as the bench client groups
    them (`conversation_indices`)."""
    if dataset in ("sharegpt", "sharegpt-multiturn"):
        from rimuru.bench.workload import (
            conversation_indices,
            load_tokenizer,
            sample_sharegpt,
            sample_sharegpt_multiturn,
        )

        try:
            if dataset == "sharegpt":
                sample = sample_sharegpt(load_tokenizer(None), num_prompts, seed)
            else:
                sample = sample_sharegpt_multiturn(load_tokenizer(None), num_prompts, seed, max_prompt_len=2048,
                                                   max_total_len=3072)
        except ModuleNotFoundError as e:  # the packaged data set and the Qwen vocabulary are the bench extra's
            if (e.name or "").startswith("rimuru"):
                raise
            raise SystemExit(f"error: --dataset {dataset} needs {e.name}, which is not installed: "
                             "pip install 'rimuru[bench]' (or use --dataset fixed:PROMPT_LEN:OUTPUT_LEN)") from None
        return [(r.prompt_len, r.output_len) for r in sample], conversation_indices(sample)
    kind, _, rest = dataset.partition(":")
    if kind == "fixed":
        try:
            prompt, output = (int(x) for x in rest.split(":"))
        except ValueError:
            raise SystemExit(f"bad --dataset {dataset!r}: use fixed:PROMPT_LEN:OUTPUT_LEN") from None
        return [(prompt, output)] * num_prompts, [[i] for i in range(num_prompts)]
    raise SystemExit(f"unknown --dataset {dataset!r}: use sharegpt, sharegpt-multiturn or fixed:PROMPT_LEN:OUTPUT_LEN")


def with_arrivals(pairs: list[tuple[int, int]], rate: float, seed: int,
                  convs: list[list[int]] | None = None, think_s: float = 0.0) -> list[SimRequest]:
    """Poisson arrivals at `rate`: of each request, or with `convs` of each conversation's first turn, every later
    turn sent `think_s` after the one before it ended (the bench client's multi-turn loop: its rate counts
    conversations)."""
    from rimuru.bench.workload import poisson_arrivals

    if convs is None:
        return [SimRequest(p, o, t) for (p, o), t in zip(pairs, poisson_arrivals(len(pairs), rate, seed),
                                                          strict=True)]
    out: list[SimRequest | None] = [None] * len(pairs)
    for turns, t in zip(convs, poisson_arrivals(len(convs), rate, seed), strict=True):
        for n, i in enumerate(turns):
            p, o = pairs[i]
            out[i] = SimRequest(p, o, t, after=turns[n - 1] if n else None, think_s=think_s if n else 0.0)
    if any(r is None for r in out):
        raise ValueError("the conversations do not cover every request")
    return [r for r in out if r is not None]


def dummy_router_popularity(model: str, routing: str, spec: ModelSpec, seed: int) -> ExpertPopularity:
    """The routing shares `uniform` or `zipf:S` give the engine's dummy router: no expert above 1/top_k of the picks
    (models/dummy_routing.py caps them the same way)."""
    pop = ExpertPopularity.from_routing(model, routing, spec.num_moe_layers, spec.num_experts, seed=seed)
    return ExpertPopularity(pop.model, cap_shares(pop.probabilities, spec.num_experts_per_tok))


def hardware_from(args: argparse.Namespace):
    hw = HARDWARE[args.hardware]
    over: dict[str, float] = {}
    for flag, field_name, scale in (("peak_tflops", "peak_flops", 1e12), ("hbm_bandwidth", "hbm_bandwidth", 1e9),
                                    ("pcie_bandwidth", "pcie_bandwidth", 1e9),
                                    ("flops_efficiency", "flops_efficiency", 1.0),
                                    ("bandwidth_efficiency", "bandwidth_efficiency", 1.0),
                                    ("copy_overlap", "copy_overlap", 1.0),
                                    ("step_overhead_ms", "step_overhead_s", 1e-3),
                                    ("piecewise_overhead_us", "piecewise_overhead_per_layer_s", 1e-6)):
        value = getattr(args, flag)
        if value is not None:
            over[field_name] = value * scale
    try:
        return replace(hw, **over)
    except ValueError as e:  # a bad --copy-overlap, --piecewise-overhead-us, ...: say which, no traceback
        raise SystemExit(f"rimuru simulate: bad hardware setting: {e}") from None


def sustained_rate(run_at, rates: list[float], slo: float) -> tuple[float | None, list[dict[str, float]]]:
    """Largest rate r such that r and every lower rate of `rates` meet TTFT p99 <= slo."""
    best, points = None, []
    for rate in sorted(rates):
        s = run_at(rate).summary()
        ok = s["ttft_p99_s"] <= slo
        points.append({"rate": rate, "ttft_p99_s": s["ttft_p99_s"], "output_throughput_tok_s":
                       s["output_throughput_tok_s"], "peak_running": s["peak_running"], "meets_slo": ok})
        if not ok:
            break
        best = rate
    return best, points


def run(args: argparse.Namespace) -> int:
    spec = load_model_spec(args.model)
    L, E = spec.num_moe_layers, spec.num_experts
    if args.ranking:
        pop = ExpertPopularity.load(args.ranking, L, E)
        routing = f"ranking file {args.ranking}"
    else:
        pop = dummy_router_popularity(str(args.model), args.routing, spec, args.seed)
        routing = args.routing
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown modes {bad}; choose from {', '.join(MODES)}")
    if "fixed" in modes and args.resident_experts is None:
        raise SystemExit("--modes fixed needs --resident-experts (experts per layer, or a fraction), as rimuru serve")
    adjusters = [a.strip() for a in args.adjuster.split(",") if a.strip()]
    if not adjusters or any(a not in ADJUSTERS for a in adjusters):
        raise SystemExit(f"bad --adjuster {args.adjuster!r}; choose from {', '.join(ADJUSTERS)} (comma list)")
    runs = [(m, a) for m in modes for a in (adjusters if m == "elastic" else ["paper"])]
    # the cost adjuster reckons with the hardware's copy bandwidth, as the engine does with its start-up measurement
    extra = {} if args.admission_max_loss is None else {"admission_max_loss": args.admission_max_loss}
    try:
        cost_cfg = slo_config(args.slo_ttft_p99_ms, args.slo_tpot_p99_ms, args.offload_access, **extra)
    except ValueError as e:
        raise SystemExit(f"rimuru simulate: {e}") from None
    hw = hardware_from(args)
    pairs, grouped = load_workload(args.dataset, args.num_prompts, args.seed)
    # multi-turn: conversations arrive at the rate, each turn once the last one ended (the bench client's loop)
    convs = grouped if args.dataset == "sharegpt-multiturn" else None
    base = SimConfig(mode=modes[0], budget_bytes=parse_bytes(args.gpu_memory_budget), hardware=hw,
                     adjuster=AdjusterConfig(), cost=cost_cfg, resident_experts=args.resident_experts,
                     expert_offload_limit=args.expert_offload_limit, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens, offload_access=args.offload_access,
                     workspace_bytes=parse_bytes(args.workspace) if args.workspace else None,
                     async_scheduling=not args.no_async_scheduling, kv_compaction=not args.no_kv_compaction)
    rates = [float(r) for r in args.sweep_rates.split(",") if r.strip()]
    sections: dict[str, dict[str, Any]] = {}
    print(f"{args.model}: {len(pairs)} requests at {args.request_rate} req/s, budget "
          f"{format_bytes(base.budget_bytes)}, hardware {hw.name}, routing {routing}")
    for mode, kind in runs:
        cfg = replace(base, mode=mode, adjuster_kind=kind)
        label = mode if kind == "paper" else f"{mode}-{kind}"

        def run_at(rate: float, cfg: SimConfig = cfg):
            return Simulation(spec, pop, cfg).run(with_arrivals(pairs, rate, args.seed, convs,
                                                                args.turn_think_time_s))

        t0 = time.perf_counter()
        try:
            result = run_at(args.request_rate)
        except SimulationError as e:
            print(f"{label:12s} cannot run: {e}")
            sections[label] = {"error": str(e)}
            continue
        section = result.summary()
        section["mode"] = label
        section["adjuster"] = kind if mode == "elastic" else None
        section["timeline"] = result.timeline
        if rates:
            best, points = sustained_rate(run_at, rates, args.slo_ttft_p99)
            section["max_sustained_rate"] = best
            section["sweep"] = points
        section["wall_s"] = time.perf_counter() - t0
        sections[label] = section
        print_section(label, section)
    report = {
        "config": {"model": args.model, "budget_bytes": base.budget_bytes, "dataset": args.dataset,
                   "num_prompts": len(pairs), "request_rate": args.request_rate, "seed": args.seed,
                   "routing": routing, "hardware": vars(hw), "adjuster": vars(base.adjuster),
                   "adjusters": adjusters, "cost_adjuster": vars(cost_cfg),
                   "resident_experts": args.resident_experts, "expert_offload_limit": args.expert_offload_limit,
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "workspace_bytes": base.workspace_bytes, "async_scheduling": base.async_scheduling,
                   "sweep_rates": rates, "sweep_criterion": f"ttft_p99_s <= {args.slo_ttft_p99}"},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": "rimuru simulate " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["simulate"] else sys.argv[1:]),
        "modes": sections,
    }
    if args.output_json:
        Path(args.output_json).write_text(compact_json(report) + "\n")
        print(f"json: {args.output_json}")
    if args.plot:
        from rimuru.sim.plot import plot_timelines

        ok = {m: s for m, s in sections.items() if "timeline" in s}
        plot_timelines(ok, args.plot, f"{args.model}, {format_bytes(base.budget_bytes)}, {args.request_rate} req/s, "
                                      f"{hw.name}, routing {routing}")
        print(f"plot: {args.plot}")
    return 0


def compact_json(report: dict[str, Any]) -> str:
    """Indented JSON whose per-step timelines sit on one line each (they are long lists of numbers)."""
    timelines = {}
    body = json.loads(json.dumps(report))
    for name, section in body.get("modes", {}).items():
        if "timeline" in section:
            timelines[name] = section["timeline"]
            section["timeline"] = f"@@timeline:{name}@@"
    text = json.dumps(body, indent=1)
    for name, timeline in timelines.items():
        rounded = {k: [float(f"{v:.6g}") for v in vs] for k, vs in timeline.items()}
        text = text.replace(json.dumps(f"@@timeline:{name}@@"), json.dumps(rounded, separators=(",", ":")))
    return text


def print_section(mode: str, s: dict[str, Any]) -> None:
    rate = s.get("max_sustained_rate", "-")
    print(f"{mode:12s} peak running {s['peak_running']:4d}  steps {s['forward_steps']:6d}  "
          f"{s['output_throughput_tok_s']:8.1f} tok/s  TTFT p50/p99 {s['ttft_p50_s']:.3f}/{s['ttft_p99_s']:.3f} s  "
          f"TPOT p50/p99 {1e3 * s['tpot_p50_s']:.1f}/{1e3 * s['tpot_p99_s']:.1f} ms  evict/grow "
          f"{s['evictions']}/{s['grows']}  KV moved {s.get('kv_pages_moved', 0)}  PCIe {s['pcie_bytes'] / 1e9:.1f} GB  "
          f"max rate {rate}")

