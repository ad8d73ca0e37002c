"""Measures the activation workspace a served engine really uses, against the bound the budget reserves.

The budget is split as non-expert weights + activation workspace + page pool, the workspace measured at start-up
before the pool exists (`engine/workspace_profile.py`). Whatever it reserves beyond the real peak is KV cache the
engine could have held; a real peak above it is memory beyond the budget.
This script builds one engine (CUDA graphs on, as served), then drives its worst cases:

1. a prefill step of `max_num_batched_tokens` tokens (the largest mixed/prefill graph bucket);
2. decode steps of `max_num_seqs` sequences, every row sampled with temperature, top-k and top-p (the
   sampler's largest working set);

and reports torch's peak reserved memory beyond the weights and the pool (graph pool, eager
temporaries, sampler copies) next to the bound, plus memory held outside torch's allocator
(cuBLAS workspaces, module images). GPU only.

    PYTHONPATH=. python benchmarks/probe_workspace.py --output-json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import metadata  # noqa: E402
from rimuru import LLM, SamplingParams  # noqa: E402


def _where(frames: list[dict]) -> str:
    """The innermost frame in our code (rimuru/ or benchmarks/), else the innermost Python frame."""
    for f in frames:
        name = str(f.get("filename", ""))
        if "/rimuru/" in name or "/benchmarks/" in name:
            return f"{name.split('/')[-2]}/{name.split('/')[-1]}:{f.get('line')} {f.get('name')}"
    py = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    return f"{py[0].get('filename')}:{py[0].get('line')}" if py else "?"


def memory_breakdown(engine: object) -> dict:
    """Where torch's reserved memory is after the start: segments and live bytes per memory pool (CUDA-graph
    pools have their own ids), the model's parameter and buffer bytes, and the largest live allocations
    with the line that made them (memory history must be recording)."""
    model = engine.model  # type: ignore[attr-defined]
    pool_storage = engine.pool.buffer.untyped_storage().data_ptr()  # type: ignore[attr-defined]
    seen: set[int] = set()
    model_bytes = 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if t.device.type == "cuda" and ptr != pool_storage and ptr not in seen:  # views of the pool: experts, KV
            seen.add(ptr)
            model_bytes += t.untyped_storage().nbytes()
    pools: dict[str, dict[str, int]] = {}
    blocks = []
    for seg in torch.cuda.memory._snapshot().get("segments", []):
        pool = str(tuple(seg.get("segment_pool_id", (0, 0))))
        entry = pools.setdefault(pool, {"segments_bytes": 0, "active_bytes": 0})
        entry["segments_bytes"] += int(seg.get("total_size", 0))
        entry["active_bytes"] += int(seg.get("active_size", 0))
        for blk in seg.get("blocks", []):
            if blk.get("state") == "active_allocated":
                blocks.append({"bytes": int(blk.get("size", 0)), "pool": pool, "where": _where(blk.get("frames", []))})
    blocks.sort(key=lambda b: -b["bytes"])
    return {"model_bytes": model_bytes, "pools": pools, "largest_active": blocks[:40]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen1.5-moe-a2.7b", help="preset name or model directory")
    ap.add_argument("--gpu-memory-budget", default="32GiB")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                    help="the largest step replayed from a CUDA graph (default: max-num-batched-tokens)")
    ap.add_argument("--offload-mode", default="static", choices=["static", "elastic"],
                    help="elastic also captures the whole-graph ladder beside the piecewise one")
    ap.add_argument("--output-json", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_workspace measures GPU memory: no CUDA device")

    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    torch.cuda.memory._record_memory_history(max_entries=200_000)  # stack traces for the breakdown below
    llm = LLM(args.model, gpu_memory_budget=args.gpu_memory_budget, load_format="dummy", offload_mode=args.offload_mode,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_cudagraph_capture_size=args.max_cudagraph_capture_size)
    engine = llm.engine
    split = engine.budget_split
    held = split["non_expert_weights"] + split["pool"]  # allocated for the engine's life
    after_start = torch.cuda.memory_reserved()
    start_peak = torch.cuda.max_memory_reserved()  # includes transients of the start (weights, graph warm-ups)
    try:
        breakdown = memory_breakdown(engine)
    except Exception as exc:  # a diagnostic: never lose the measurement to it
        breakdown = {"error": repr(exc), "model_bytes": 0, "pools": {}, "largest_active": []}
    torch.cuda.memory._record_memory_history(enabled=None)
    torch.cuda.reset_peak_memory_stats()

    g = torch.Generator().manual_seed(0)
    V = engine.spec.vocab_size
    T, S = args.max_num_batched_tokens, args.max_num_seqs
    rows = []
    # 1. one prompt as long as a whole step's token budget: the first step prefills T tokens at once
    long_prompt = {"prompt_token_ids": torch.randint(10, V - 10, (T,), generator=g).tolist()}
    llm.generate([long_prompt], SamplingParams(max_tokens=2, ignore_eos=True, temperature=1.0, top_p=0.9))
    rows.append({"phase": "prefill T tokens", "peak_reserved_beyond_held": torch.cuda.max_memory_reserved() - held})
    # 2. S sequences decoding together, each sampled with every cut on
    short = [{"prompt_token_ids": torch.randint(10, V - 10, (8,), generator=g).tolist()} for _ in range(S)]
    llm.generate(short, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_k=50, top_p=0.9))
    peak_decode = torch.cuda.max_memory_reserved() - held
    rows.append({"phase": f"decode {S} sampled rows", "peak_reserved_beyond_held": peak_decode})
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    device_used = free0 - free1  # everything this process put on the device since the CUDA context
    outside_torch = device_used - torch.cuda.memory_reserved()
    peak = torch.cuda.max_memory_reserved() - held
    result = {
        **metadata(" ".join(sys.argv)),
        "model": args.model, "gpu_memory_budget": args.gpu_memory_budget, "offload_mode": args.offload_mode,
        "max_num_seqs": S, "max_num_batched_tokens": T, "max_cudagraph_capture_size": args.max_cudagraph_capture_size,
        "budget_split": split,
        "workspace_bound": split["workspace"],
        "workspace_profile": dataclasses.asdict(engine.workspace_profile) if engine.workspace_profile else None,
        "reserved_after_start_beyond_held": after_start - held,
        "start_peak_reserved_beyond_held": start_peak - held,
        "breakdown_after_start": breakdown,
        "peak_reserved_beyond_held": peak,
        "outside_torch_allocator": outside_torch,
        "measured_workspace": peak + max(0, outside_torch),
        "kv_tokens": engine.max_kv_pages() // max(1, engine.runner.num_layers) * engine.config.block_size,
        "phases": rows,
    }
    mib = 2**20
    print(f"workspace bound {split['workspace'] / mib:,.0f} MiB; after start "
          f"{result['reserved_after_start_beyond_held'] / mib:,.0f} MiB beyond weights+pool; "
          f"peak {peak / mib:,.0f} MiB; "
          f"outside torch {outside_torch / mib:,.0f} MiB; "
          f"measured workspace {result['measured_workspace'] / mib:,.0f} MiB; KV {result['kv_tokens']:,} tokens")
    for r in rows:
        print(f"  {r['phase']:>28}: peak beyond weights+pool {r['peak_reserved_beyond_held'] / mib:,.0f} MiB")
    print(f"  start-up peak beyond weights+pool {result['start_peak_reserved_beyond_held'] / mib:,.0f} MiB; "
          f"parameters+buffers {breakdown['model_bytes'] / mib:,.0f} MiB "
          f"(budgeted {split['non_expert_weights'] / mib:,.0f})")
    for pool, b in breakdown["pools"].items():
        print(f"  pool {pool}: {b['segments_bytes'] / mib:,.0f} MiB in segments, "
              f"{b['active_bytes'] / mib:,.0f} MiB active")
    for blk in breakdown["largest_active"][:12]:
        print(f"    {blk['bytes'] / mib:8.1f} MiB  pool {blk['pool']}  {blk['where']}")
    Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
