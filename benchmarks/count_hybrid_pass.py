"""Where a hybrid model's mixed pass (a prefill chunk plus decodes) spends its launches and host syncs, per layer
kind, against a pure-decode pass of the same sequences.

The engine serves a Qwen3.5-35B-A3B-shaped model (the preset's 40 layers, 30 gated DeltaNet + 10 gated attention,
256 experts top-8; `--shrink` divides the widths so the CPU runs it in seconds: the counts do not depend on
widths) with dummy weights. `--decodes` requests decode while one more request's prompt arrives; the step with its
second `--chunk`-token chunk (the chunk continues a state) is the mixed pass, a later step with every sequence
decoding the decode pass. The regions, counting and timing are benchmarks/count_pass.py's (decode passes of any
model). Each pass is run by the model outside the engine loop:

  * counted (rimuru/testing/op_count.py): torch ops that launch work, allocations, views, host syncs and
    host->device copies per region (gated DeltaNet token mixer with its state reads and writes, gated attention,
    MoE, the layers' norms, embedding + rotary, logits, other), rimuru's kernels as their CUDA path's launches,
    fla-core's chunk kernel modelled where it would run (CUDA, bf16/fp16; `--emulate-fla` on the CPU);
  * on CUDA also: wall time (synchronised, median of `--reps`), GPU time per region (CUDA events at every region
    change, so launch gaps count where the host is slower than the device), host time per region, and
    torch.profiler's kernel launches and synchronisations per region (what the model above predicts).

With `--graphs` (CUDA) the engine captures its graphs and each pass is also replayed as the engine would (a decode
graph; a mixed graph cut at every gated DeltaNet layer, its prefill sequences run eagerly between the pieces, with
a new StepLayout per replay as every step): then the counts are what runs outside the graphs (graph launches
apart), and the wall time is the step's. On the CPU the `deltanet_prefill` row of the eager pass is what a mixed
graph runs outside its pieces (one replay per piece: gated DeltaNet layers + 1).

The estimate: `--us-per-launch` of host time per eager launch (dispatch, Python, the launch itself) and a sync drains
the queue (the device then waits for the host's next launches: `--us-per-sync` each).

    PYTHONPATH=. python benchmarks/count_hybrid_pass.py --device cpu --shrink 8 --emulate-fla \
        --output-json benchmarks/results/hybrid-pass-counts-cpu.json
    PYTHONPATH=. python benchmarks/count_hybrid_pass.py --device cuda --gpu-memory-budget 72GiB \
        --output-json hybrid-pass-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import metadata  # noqa: E402
from benchmarks.count_pass import (  # noqa: E402  (re-exported: tests import them from here)
    add_estimate_args,
    add_model_args,
    count_pass,
    estimate_ms,
    forward,
    gpu_timings,
    graph_runs,
    print_table,
    resolve_model_args,
    shrunk_config,
    submit_prompts,
)
from rimuru import LLM  # noqa: E402
from rimuru.engine.scheduler import SchedulerOutput  # noqa: E402
from rimuru.models.forward_batch import ForwardBatch  # noqa: E402
from rimuru.testing.op_count import Counts  # noqa: E402

__all__ = ["capture_passes", "count_pass", "forward", "graph_runs", "shrunk_config"]

# deltanet_prefill: the chunk form over a pass's prefill sequences (LinearStateCache.prefill_rows), inside
# ---------------------------------------------------------------------------------------------- the steps

def capture_passes(llm: LLM, decodes: int, chunk: int, prompt_len: int) -> dict[str, tuple[SchedulerOutput, Any]]:
    """Serves `decodes` requests until they decode, then one prompt of 2 * chunk tokens; returns, by name, the
    schedules of the mixed step (its second chunk beside the decodes) and of the first step where all decode."""
    engine = llm.engine
    runner = engine.runner
    seen: dict[str, tuple[SchedulerOutput, Any]] = {}
    launch = runner.launch

    def spy(sched: SchedulerOutput, trace: Any) -> Any:
        n = [s.num_new_tokens for s in sched.scheduled]
        if len(n) == decodes + 1:
            if "mixed" not in seen and sorted(n)[-1] == chunk and sorted(n)[:-1] == [1] * decodes and \
                    max(sched.scheduled, key=lambda s: s.num_new_tokens).start > 0:
                seen["mixed"] = (sched, runner.host_arrays(sched))
            elif "decode" not in seen and n == [1] * (decodes + 1):
                seen["decode"] = (sched, runner.host_arrays(sched))
        return launch(sched, trace)

    runner.launch = spy  # type: ignore[method-assign]
    g, params = submit_prompts(engine, "d", decodes, prompt_len)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) or \
            engine.scheduler.waiting or not engine.scheduler.running:
        engine.step()
    engine.add_request("chunked", torch.randint(3, engine.spec.vocab_size, (2 * chunk,), generator=g).tolist(), params)
    for _ in range(16):
        engine.step()
        if len(seen) == 2:
            break
    runner.launch = launch  # type: ignore[method-assign]
    if len(seen) != 2:
        raise RuntimeError(f"the steps did not come as planned (got {sorted(seen)})")
    return seen



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, "qwen3.5-35b-a3b", "a hybrid preset", "2GiB")
    ap.add_argument("--decodes", type=int, default=43, help="decoding sequences beside the chunk")
    ap.add_argument("--chunk", type=int, default=180, help="prefill chunk tokens")
    ap.add_argument("--prompt-len", type=int, default=16, help="prompt tokens of the decoding requests")
    ap.add_argument("--emulate-fla", action="store_true", help="count the fla-core prefill path on the CPU")
    ap.add_argument("--graphs", action="store_true", help="CUDA: capture the engine's graphs and replay them")
    ap.add_argument("--reps", type=int, default=10)
    add_estimate_args(ap)
    args = ap.parse_args()
    device, dtype, shrink, vocab, budget = resolve_model_args(args, "2GiB")
    cuda = device.type == "cuda"
    meta = metadata("count_hybrid_pass", model=args.model, shrink=shrink, vocab=vocab, dtype=dtype,
                    decodes=args.decodes, chunk=args.chunk, emulate_fla=args.emulate_fla, graphs=args.graphs)
    print(f"{meta['device']}  commit {meta['git_commit'][:10]}  {meta['date']}")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(shrunk_config(args.model, shrink, vocab)))
        llm = LLM(tmp, load_format="dummy", device=args.device, dtype=dtype, gpu_memory_budget=budget,
                  offload_mode="static", max_num_seqs=max(64, args.decodes + 1),
                  max_num_batched_tokens=args.decodes + args.chunk, enforce_eager=not args.graphs,
                  async_scheduling=False, enable_prefix_caching=False)
    engine = llm.engine
    model, runner = engine.model, engine.runner
    cache = model.state_cache
    assert cache is not None, "not a hybrid model"
    if not cuda:
        cache.in_place_decode = True  # the GPU's paged decode (the kernels' torch references here)
    passes = capture_passes(llm, args.decodes, args.chunk, args.prompt_len)
    out: dict[str, Any] = {}
    for name, (sched, h) in passes.items():
        batch = runner.device_batch(h)

        def eager(batch: ForwardBatch = batch) -> torch.Tensor:
            return forward(model, batch)

        runs: list[tuple[str, Callable[[], Any], int]] = [(name, eager, 0)]
        if args.graphs and runner.graphs is not None:
            run, pieces = graph_runs(runner, sched, mixed=name == "mixed")
            runs.append((f"{name}-graph", run, pieces))
        for label, run, pieces in runs:
            regions = count_pass(model, run, emulate_fla=args.emulate_fla)
            kind = f"graph, {pieces} pieces" if pieces else "eager"
            print_table(f"{label} pass ({h.input_ids.shape[0]} tokens, {len(sched.scheduled)} sequences, {kind})",
                        regions, args)
            row: dict[str, Any] = {"tokens": int(h.input_ids.shape[0]), "seqs": len(sched.scheduled),
                                   "eager": not pieces, "graph_pieces": pieces,
                                   "regions": {r: c.as_dict() for r, c in regions.items()}}
            total = Counts()
            for c in regions.values():
                total.add(c)
            row["total"] = total.as_dict()
            row["estimate_ms"] = estimate_ms(total, args.us_per_launch, args.us_per_sync)
            prefill = regions.get("deltanet_prefill")
            if not pieces and prefill is not None:  # what a mixed graph would run outside its pieces
                n_lin = len(engine.spec.linear_layer_ids)
                row["graph_estimate"] = {"pieces": n_lin + 1, "eager_launches": prefill.launches,
                                         "eager_syncs": prefill.syncs,
                                         "estimate_ms": estimate_ms(prefill, args.us_per_launch, args.us_per_sync)}
                print(f"  as a mixed graph: {n_lin + 1} pieces; outside them {prefill.launches} launches, "
                      f"{prefill.syncs} syncs, ~{row['graph_estimate']['estimate_ms']:.1f} ms of host time")
            if cuda:
                row.update(gpu_timings(model, run, device, args.reps))
                print(f"  wall {row['wall_ms']['median']:.1f} ms; gpu ms by region "
                      + ", ".join(f"{k} {v:.1f}" for k, v in row["region_ms"]["gpu_ms"].items() if v))
            out[label] = row
    meta["passes"] = out
    meta["us_per_launch"], meta["us_per_sync"] = args.us_per_launch, args.us_per_sync
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(meta, indent=1) + "\n")
        print(f"\nwrote {args.output_json}")
    llm.shutdown()


if __name__ == "__main__":
    main()
