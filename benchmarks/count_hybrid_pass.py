"""Where a hybrid model's mixed pass (a prefill chunk plus decodes) spends its launches and host syncs, per layer
kind, against a pure-decode pass of the same sequences.

The engine serves a Qwen3.5-35B-A3B-shaped model (the preset's 40 layers, 30 gated DeltaNet + 10 gated attention,
256 experts top-8; `--shrink` divides the widths so the CPU runs it in seconds: the counts do not depend on
widths) with dummy weights. `--decodes` requests decode while one more request's prompt arrives; the step with its
second `--chunk`-token chunk (the chunk continues a state) is the mixed pass, a later step with every sequence
decoding the decode pass. Each pass is run by the model outside the engine loop:

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
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import metadata  # noqa: E402
from rimuru import LLM, SamplingParams  # noqa: E402
from rimuru.engine.scheduler import SchedulerOutput  # noqa: E402
from rimuru.model_spec import PRESETS_DIR  # noqa: E402
from rimuru.models.causal_lm import DecoderLayer, MoECausalLM  # noqa: E402
from rimuru.models.forward_batch import ForwardBatch  # noqa: E402
from rimuru.models.qwen3_5_moe import LinearAttentionDecoderLayer  # noqa: E402
from rimuru.testing.op_count import Counts, OpCounter, box_kernels  # noqa: E402

# deltanet_prefill: the chunk form over a pass's prefill sequences (LinearStateCache.prefill_rows), inside
# gated_deltanet: what a mixed graph runs eagerly between its pieces
REGIONS = ("gated_deltanet", "deltanet_prefill", "gated_attention", "moe", "norm", "embed_rotary", "logits", "other")
_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                "cuStreamSynchronize", "cuCtxSynchronize", "cuMemcpyDtoH")
_LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                  "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch")


def shrunk_config(preset: str, shrink: int, vocab: int | None) -> dict[str, Any]:
    """The preset's config with every width divided by `shrink` (layers, experts, top-k, heads and the layer pattern
    kept), and the vocabulary cut to `vocab`."""
    cfg = json.loads((PRESETS_DIR / f"{preset}.json").read_text())
    text = cfg.get("text_config", cfg)
    if shrink > 1:
        for key in ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size", "head_dim",
                    "linear_key_head_dim", "linear_value_head_dim"):
            if key in text:
                text[key] = max(16, text[key] // shrink)
    if vocab:
        text["vocab_size"] = vocab
    return cfg


# ---------------------------------------------------------------------------------------------- regions

class Regions:
    """Names every part of a forward pass after its layer kind, for a counter and for CUDA-event timing."""

    def __init__(self, model: MoECausalLM) -> None:
        self.model = model
        self.hooks: list[Any] = []
        self.listeners: list[Callable[[str, bool], None]] = []  # (region, entering)
        self._saved: list[tuple[Any, str]] = []

    def _enter(self, name: str) -> None:
        for f in self.listeners:
            f(name, True)

    def _exit(self, name: str) -> None:
        for f in self.listeners:
            f(name, False)

    def _hook_module(self, module: torch.nn.Module, name: str) -> None:
        self.hooks.append(module.register_forward_pre_hook(lambda *_: self._enter(name)))
        self.hooks.append(module.register_forward_hook(lambda *_: self._exit(name)))

    def _wrap(self, obj: Any, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self._enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self._exit(name)

        self._saved.append((obj, attr))
        setattr(obj, attr, wrapped)

    @contextmanager
    def installed(self) -> Iterator[None]:
        model = self.model
        for layer in model.model.layers:
            assert isinstance(layer, DecoderLayer)
            kind = "gated_deltanet" if isinstance(layer, LinearAttentionDecoderLayer) else "gated_attention"
            self._wrap(layer, "mix", kind)
            self._hook_module(layer.mlp, "moe")
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                self._hook_module(norm, "norm")
                self._wrap(norm, "add_norm", "norm")
        self._hook_module(model.model.norm, "norm")
        self._wrap(model.model.norm, "add_norm", "norm")
        if model.state_cache is not None:
            self._wrap(model.state_cache, "prefill_rows", "deltanet_prefill")
        self._hook_module(model.model.embed_tokens, "embed_rotary")
        self._wrap(model.rotary, "cos_sin", "embed_rotary")
        self._wrap(model, "compute_logits", "logits")
        try:
            yield
        finally:
            for h in self.hooks:
                h.remove()
            self.hooks.clear()
            for obj, attr in reversed(self._saved):
                delattr(obj, attr)  # the instance attribute: the class's method shows through again
            self._saved.clear()


# ---------------------------------------------------------------------------------------------- passes

def forward(model: MoECausalLM, batch: ForwardBatch) -> torch.Tensor:
    hidden = model(batch)
    return model.compute_logits(hidden[batch.logits_indices])


def count_pass(model: MoECausalLM, run: Callable[[], Any], emulate_fla: bool) -> dict[str, Counts]:
    counter = OpCounter()
    regions = Regions(model)
    regions.listeners.append(lambda name, entering: counter._push(name) if entering else counter._pop())
    with torch.inference_mode(), box_kernels(counter, emulate_fla=emulate_fla), regions.installed(), \
            counter.counting():
        run()
    return counter.regions


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(run: Callable[[], Any], device: torch.device, reps: int) -> dict[str, float]:
    times = []
    with torch.inference_mode():
        run()  # warm
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            run()
            sync(device)
            times.append(1e3 * (time.perf_counter() - t0))
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "reps": reps}


def region_times_ms(model: MoECausalLM, run: Callable[[], Any], device: torch.device, reps: int) -> dict[str, Any]:
    """GPU ms per region from CUDA events at every region change (launch gaps included), host ms per region."""
    marks: list[tuple[str, Any, float]] = []  # (region now running, event, host time)
    stack = ["other"]

    def mark() -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((stack[-1], ev, time.perf_counter()))

    def listener(name: str, entering: bool) -> None:
        if entering:
            stack.append(name)
        else:
            stack.pop()
        mark()

    regions = Regions(model)
    regions.listeners.append(listener)
    gpu: dict[str, float] = dict.fromkeys(REGIONS, 0.0)
    host: dict[str, float] = dict.fromkeys(REGIONS, 0.0)
    with torch.inference_mode(), regions.installed():
        run()  # warm
        for _ in range(reps):
            marks.clear()
            sync(device)
            mark()
            run()
            stack[:] = ["other"]
            mark()
            sync(device)
            for (name, e0, h0), (_, e1, h1) in zip(marks, marks[1:], strict=False):
                gpu[name] = gpu.get(name, 0.0) + e0.elapsed_time(e1) / reps
                host[name] = host.get(name, 0.0) + 1e3 * (h1 - h0) / reps
    return {"gpu_ms": gpu, "host_ms": host}


def profiled(model: MoECausalLM, run: Callable[[], Any]) -> dict[str, Any]:
    """torch.profiler over one pass: device launches and syncs (runtime API calls), per region by host time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    regions = Regions(model)
    opened: list[Any] = []

    def listener(name: str, entering: bool) -> None:
        if entering:
            rf = record_function(f"region:{name}")
            rf.__enter__()
            opened.append(rf)
        else:
            opened.pop().__exit__(None, None, None)

    regions.listeners.append(listener)
    with torch.inference_mode(), regions.installed():
        run()  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    spans = []
    for e in prof.events():
        if e.name.startswith("region:"):
            spans.append((e.time_range.start, e.time_range.end, e.name[len("region:"):]))
    spans.sort(key=lambda s: s[1] - s[0])  # innermost first

    def region_of(t: float) -> str:
        for start, end, name in spans:
            if start <= t <= end:
                return name
        return "other"

    launches: dict[str, int] = dict.fromkeys(REGIONS, 0)
    syncs: dict[str, int] = dict.fromkeys(REGIONS, 0)
    kernels = 0
    for e in prof.events():
        if e.name in _LAUNCH_EVENTS:
            launches[region_of(e.time_range.start)] = launches.get(region_of(e.time_range.start), 0) + 1
        elif e.name in _SYNC_EVENTS:
            syncs[region_of(e.time_range.start)] = syncs.get(region_of(e.time_range.start), 0) + 1
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            kernels += 1
    return {"launch_calls": launches, "sync_calls": syncs, "device_events": kernels}


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
    g = torch.Generator().manual_seed(0)
    vocab = engine.spec.vocab_size
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)  # outlasts the steps looked for
    for i in range(decodes):
        engine.add_request(f"d{i}", torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) or \
            engine.scheduler.waiting or not engine.scheduler.running:
        engine.step()
    engine.add_request("chunked", torch.randint(3, vocab, (2 * chunk,), generator=g).tolist(), params)
    for _ in range(16):
        engine.step()
        if len(seen) == 2:
            break
    runner.launch = launch  # type: ignore[method-assign]
    if len(seen) != 2:
        raise RuntimeError(f"the steps did not come as planned (got {sorted(seen)})")
    return seen


def graph_runs(runner: Any, sched: SchedulerOutput, mixed: bool) -> tuple[Callable[[], Any], int]:
    """A function replaying this step's graph as the engine does (its inputs staged once; a mixed replay gets a new
    layout each time, as every step does), and the graph's pieces (1 for a whole graph)."""
    import dataclasses

    from rimuru.engine.piecewise_graphs import PiecewiseGraph

    graphs = runner.graphs
    if mixed:
        if not graphs.can_run_mixed(sched):
            raise RuntimeError("the mixed step fits no mixed graph")
        h = runner.host_arrays(sched, pad_tokens=graphs.padded_tokens(sched.num_tokens), pad_seqs=graphs.max_seqs)
        ids, pos, qsl, seq_lens, bt, slots, li, qts, *state = runner.to_device(h)
        graph = graphs.mixed_graphs[ids.shape[0]]

        def run() -> Any:
            layout = dataclasses.replace(h.layout) if h.layout is not None else None
            return graphs.run_mixed(h.num_sampled, ids, pos, qsl, seq_lens, bt, slots, li, qts, *state, layout)
    else:
        if not graphs.can_run(sched):
            raise RuntimeError("the decode step fits no decode graph")
        B = len(sched.scheduled)
        h = runner.host_arrays(sched, pad_to=graphs.padded_size(B))
        ids, pos, _, seq_lens, bt, slots, _, *state = runner.to_device(h)
        graph = graphs.graphs[ids.shape[0]]

        def run() -> Any:
            return graphs.run(B, ids, pos, seq_lens, bt, slots, *state)
    return run, len(graph.pieces) if isinstance(graph, PiecewiseGraph) else 1


def estimate_ms(counts: Counts, us_per_launch: float, us_per_sync: float) -> float:
    return 1e-3 * (counts.launches * us_per_launch + counts.allocs * 0.5 * us_per_launch + counts.syncs * us_per_sync)


def print_table(name: str, regions: dict[str, Counts], args: argparse.Namespace) -> None:
    print(f"\n{name}: launches / allocs / syncs / h2d per region (estimated host ms at {args.us_per_launch} us per "
          f"launch, {args.us_per_sync} us per sync)")
    print(f"  {'region':<16}{'entries':>8}{'launches':>9}{'allocs':>8}{'views':>7}{'syncs':>7}{'h2d':>5}{'est ms':>9}"
          "  sync sites")
    total = Counts()
    for r in (*REGIONS, *sorted(set(regions) - set(REGIONS))):
        c = regions.get(r)
        if c is None:
            continue
        total.add(c)
        sites = ", ".join(f"{k} x{v}" for k, v in c.sync_sites.most_common(4))
        print(f"  {r:<16}{c.entries:>8}{c.launches:>9}{c.allocs:>8}{c.views:>7}{c.syncs:>7}{c.h2d:>5}"
              f"{estimate_ms(c, args.us_per_launch, args.us_per_sync):>9.1f}  {sites}")
    print(f"  {'total':<16}{'':>8}{total.launches:>9}{total.allocs:>8}{total.views:>7}{total.syncs:>7}{total.h2d:>5}"
          f"{estimate_ms(total, args.us_per_launch, args.us_per_sync):>9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-35b-a3b", help="a hybrid preset")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--shrink", type=int, default=None, help="divide the widths (default: 16 on the CPU, 1 on CUDA)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: 4096 on the CPU)")
    ap.add_argument("--gpu-memory-budget", default=None, help="default: 72GiB on CUDA, 2GiB on the CPU")
    ap.add_argument("--decodes", type=int, default=43, help="decoding sequences beside the chunk")
    ap.add_argument("--chunk", type=int, default=180, help="prefill chunk tokens")
    ap.add_argument("--prompt-len", type=int, default=16, help="prompt tokens of the decoding requests")
    ap.add_argument("--emulate-fla", action="store_true", help="count the fla-core prefill path on the CPU")
    ap.add_argument("--graphs", action="store_true", help="CUDA: capture the engine's graphs and replay them")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--us-per-launch", type=float, default=8.0)
    ap.add_argument("--us-per-sync", type=float, default=60.0)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # tiny tensors: more threads only spin
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    shrink = args.shrink if args.shrink is not None else (1 if cuda else 16)
    vocab = args.vocab if args.vocab is not None else (None if cuda else 4096)
    budget = args.gpu_memory_budget or ("72GiB" if cuda else "2GiB")
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
                row["wall_ms"] = wall_ms(run, device, args.reps)
                row["region_ms"] = region_times_ms(model, run, device, max(1, args.reps // 2))
                try:
                    row["profiler"] = profiled(model, run)
                except Exception as e:  # noqa: BLE001 - the counts above stand without it
                    row["profiler"] = {"error": repr(e)}
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
