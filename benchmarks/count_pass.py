"""Where a forward pass spends its launches, allocations, host syncs and host time, per region: a decode pass of B
sequences of any preset (`--model`; non-hybrid MoE models first: Qwen1.5-MoE, Qwen3-MoE, Mixtral, OLMoE), run
eagerly as `--enforce-eager` runs it.

The engine serves a preset-shaped model (its layers, experts, top-k and heads; `--shrink` divides the widths so
the CPU runs it in seconds: the counts do not depend on widths) with dummy weights; `--batch-sizes` requests are
prefilled, and the first step where all of them decode is the pass, run by the model outside the engine loop:

  * counted (rimuru/testing/op_count.py): torch ops that launch work, allocations, views, host syncs and
    host->device copies per region (attention; the MoE block's router, routed experts, shared expert and its
    combine; the layers' norms; embedding + rotary; logits; other), rimuru's kernels as their CUDA path's launches;
  * host time: the pass with rimuru's kernels replaced by stand-ins that only allocate their outputs
    (`stub_kernels`: a CPU runs no Triton, and the kernels' torch references are not what a GPU host runs), the
    median of `--reps`, and cProfile's top functions by own time over `--profile-reps` passes. At shrunk widths
    on the CPU this is mostly Python and the torch dispatcher: a proxy for a GPU host's work per pass, without
    the Triton launcher's own cost (`--us-per-launch` models that in the estimate);
  * on CUDA instead: wall time per pass (synchronised, median of `--reps`), GPU and host ms per region (CUDA
    events at every region change), torch.profiler's launch and sync calls per region, and with `--graphs` the
    same pass replayed from the engine's decode graph.

    PYTHONPATH=. python benchmarks/count_pass.py --model qwen1.5-moe-a2.7b --device cpu --batch-sizes 32,64 \
        --output-json qwen1.5-cpu.json
    PYTHONPATH=. python benchmarks/count_pass.py --model qwen1.5-moe-a2.7b --device cuda --batch-sizes 32,64 \
        --graphs --output-json qwen1.5-h200.json

benchmarks/count_hybrid_pass.py counts a hybrid model's mixed pass with the pieces here.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
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
from rimuru.models.moe import SparseMoE  # noqa: E402
from rimuru.testing.op_count import Counts, OpCounter, box_kernels, stub_kernels  # noqa: E402

# Regions, in table order. attention: a plain (or q/k-normed) attention layer's token mixer; gated_deltanet and
# gated_attention: a hybrid's; deltanet_prefill: the chunk form over a pass's prefill sequences
# (LinearStateCache.prefill_rows), inside gated_deltanet: what a mixed graph runs eagerly between its pieces. The
# MoE block: moe_router (gate GEMM, routing), moe_experts (the expert table, the fused MoE), moe_shared (the shared
# expert and its gate's GEMM), moe (the rest: the shared expert's combine, the all-reduce).
REGIONS = ("attention", "gated_deltanet", "deltanet_prefill", "gated_attention", "moe_router", "moe_experts",
           "moe_shared", "moe", "norm", "embed_rotary", "logits", "other")
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
        for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "head_dim", "linear_key_head_dim", "linear_value_head_dim"):
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
        from rimuru.models.qwen3_5_moe import LinearAttentionDecoderLayer

        model = self.model
        hybrid = model.state_cache is not None
        for layer in model.model.layers:
            assert isinstance(layer, DecoderLayer)
            if isinstance(layer, LinearAttentionDecoderLayer):
                kind = "gated_deltanet"
            else:
                kind = "gated_attention" if hybrid else "attention"
            self._wrap(layer, "mix", kind)
            self._hook_module(layer.mlp, "moe")
            if isinstance(layer.mlp, SparseMoE):
                self._wrap(layer.mlp, "routed", "moe_experts")
                self._wrap(layer.mlp, "route", "moe_router")  # inside moe_experts
                for name in ("shared_expert", "shared_expert_gate"):
                    if isinstance(getattr(layer.mlp, name, None), torch.nn.Module):
                        self._hook_module(getattr(layer.mlp, name), "moe_shared")
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


def gpu_timings(model: MoECausalLM, run: Callable[[], Any], device: torch.device, reps: int) -> dict[str, Any]:
    """A pass on CUDA: its wall time, GPU and host ms per region, and torch.profiler's launches and syncs per region
    (an error in the profiler is recorded, the timings stand without it)."""
    out: dict[str, Any] = {"wall_ms": wall_ms(run, device, reps),
                           "region_ms": region_times_ms(model, run, device, max(1, reps // 2))}
    try:
        out["profiler"] = profiled(model, run)
    except Exception as e:  # noqa: BLE001
        out["profiler"] = {"error": repr(e)}
    return out


def estimate_ms(counts: Counts, us_per_launch: float, us_per_sync: float) -> float:
    return 1e-3 * (counts.launches * us_per_launch + counts.allocs * 0.5 * us_per_launch + counts.syncs * us_per_sync)


def print_table(name: str, regions: dict[str, Counts], args: argparse.Namespace, layers: int | None = None) -> None:
    """The per-region table; with `layers`, each region's launches per layer too."""
    print(f"\n{name}: launches / allocs / syncs / h2d per region (estimated host ms at {args.us_per_launch} us per "
          f"launch, {args.us_per_sync} us per sync)")
    per = f"{'/layer':>8}" if layers else ""
    print(f"  {'region':<16}{'entries':>8}{'launches':>9}{per}{'allocs':>8}{'views':>7}{'syncs':>7}{'h2d':>5}"
          f"{'est ms':>9}  sync sites")
    total = Counts()
    for r in (*REGIONS, *sorted(set(regions) - set(REGIONS))):
        c = regions.get(r)
        if c is None:
            continue
        total.add(c)
        sites = ", ".join(f"{k} x{v}" for k, v in c.sync_sites.most_common(4))
        per = f"{c.launches / layers:>8.2f}" if layers else ""
        print(f"  {r:<16}{c.entries:>8}{c.launches:>9}{per}{c.allocs:>8}{c.views:>7}{c.syncs:>7}{c.h2d:>5}"
              f"{estimate_ms(c, args.us_per_launch, args.us_per_sync):>9.1f}  {sites}")
    per = f"{total.launches / layers:>8.2f}" if layers else ""
    print(f"  {'total':<16}{'':>8}{total.launches:>9}{per}{total.allocs:>8}{total.views:>7}{total.syncs:>7}"
          f"{total.h2d:>5}{estimate_ms(total, args.us_per_launch, args.us_per_sync):>9.1f}")



# ---------------------------------------------------------------------------------------------- host time (CPU)

def host_ms(run: Callable[[], Any], reps: int) -> dict[str, float]:
    """Host ms per pass with rimuru's kernels stubbed (their outputs allocated, nothing computed): median of `reps`."""
    times = []
    with torch.inference_mode(), stub_kernels():
        run()  # warm
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            times.append(1e3 * (time.perf_counter() - t0))
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "reps": reps}


def profile_top(run: Callable[[], Any], reps: int, top: int) -> tuple[list[dict[str, Any]], str]:
    """cProfile over `reps` stubbed passes: the `top` functions by own time (ms per pass), and the printed table."""
    prof = cProfile.Profile()
    with torch.inference_mode(), stub_kernels():
        run()  # warm
        prof.enable()
        for _ in range(reps):
            run()
        prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = fn if file == "~" else f"{Path(file).name}:{line}({fn})"
        rows.append({"function": where, "calls_per_pass": ncalls / reps, "own_ms_per_pass": 1e3 * tottime / reps,
                     "cum_ms_per_pass": 1e3 * cumtime / reps})
    rows.sort(key=lambda r: -r["own_ms_per_pass"])
    rows = rows[:top]
    out = io.StringIO()
    out.write(f"  {'own ms':>8}{'cum ms':>8}{'calls':>8}  function (per pass, kernels stubbed)\n")
    for r in rows:
        out.write(f"  {r['own_ms_per_pass']:>8.3f}{r['cum_ms_per_pass']:>8.3f}{r['calls_per_pass']:>8.0f}  "
                  f"{r['function']}\n")
    return rows, out.getvalue()


# ---------------------------------------------------------------------------------------------- the step

def submit_prompts(engine: Any, prefix: str, count: int,
                   prompt_len: int) -> tuple[torch.Generator, SamplingParams]:
    """`count` random prompts of `prompt_len` tokens (seeded), greedy, each outlasting the steps looked for; the
    generator (to draw further prompts from the same stream) and the parameters."""
    g = torch.Generator().manual_seed(0)
    vocab = engine.spec.vocab_size
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(count):
        engine.add_request(f"{prefix}{i}", torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), params)
    return g, params


def capture_decode(llm: LLM, batch: int, prompt_len: int) -> tuple[SchedulerOutput, Any]:
    """Serves `batch` requests of `prompt_len` random tokens until they all decode; returns the schedule and the host
    arrays of the first step where every one of them decodes."""
    engine = llm.engine
    runner = engine.runner
    seen: list[tuple[SchedulerOutput, Any]] = []
    launch = runner.launch

    def spy(sched: SchedulerOutput, trace: Any) -> Any:
        if not seen and len(sched.scheduled) == batch and all(s.num_new_tokens == 1 for s in sched.scheduled):
            seen.append((sched, runner.host_arrays(sched)))
        return launch(sched, trace)

    runner.launch = spy  # type: ignore[method-assign]
    submit_prompts(engine, f"b{batch}-", batch, prompt_len)
    for _ in range(64):
        engine.step()
        if seen:
            break
    runner.launch = launch  # type: ignore[method-assign]
    if not seen:
        raise RuntimeError(f"no step decoded all {batch} sequences")
    return seen[0]


def add_model_args(ap: argparse.ArgumentParser, model: str, model_help: str, cpu_budget: str) -> None:
    """The flags every pass count takes: the preset, the device and the widths (defaults: `resolve_model_args`)."""
    ap.add_argument("--model", default=model, help=model_help)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--shrink", type=int, default=None, help="divide the widths (default: 16 on the CPU, 1 on CUDA)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: 4096 on the CPU)")
    ap.add_argument("--gpu-memory-budget", default=None, help=f"default: 72GiB on CUDA, {cpu_budget} on the CPU")


def add_estimate_args(ap: argparse.ArgumentParser) -> None:
    """The host-time model of the counts and the output file."""
    ap.add_argument("--us-per-launch", type=float, default=8.0)
    ap.add_argument("--us-per-sync", type=float, default=60.0)
    ap.add_argument("--output-json", default=None)


def resolve_model_args(args: argparse.Namespace, cpu_budget: str) -> tuple[torch.device, str, int, int | None, str]:
    """(device, dtype, shrink, vocab, budget) with the defaults of the device: full widths and bf16 on CUDA, shrunk
    widths, fp32 and one intra-op thread on the CPU (tiny tensors: more threads only spin)."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    shrink = args.shrink if args.shrink is not None else (1 if cuda else 16)
    vocab = args.vocab if args.vocab is not None else (None if cuda else 4096)
    return device, dtype, shrink, vocab, args.gpu_memory_budget or ("72GiB" if cuda else cpu_budget)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, "qwen1.5-moe-a2.7b", "a preset (rimuru/presets)", "8GiB")
    ap.add_argument("--batch-sizes", default="32,64", help="decoding sequences per pass, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=300, help="prompt tokens of each request (its context)")
    ap.add_argument("--graphs", action="store_true", help="CUDA: also replay the pass from the engine's decode graph")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile-reps", type=int, default=5, help="CPU: passes under cProfile")
    ap.add_argument("--top", type=int, default=25, help="CPU: cProfile's top functions printed and kept")
    add_estimate_args(ap)
    args = ap.parse_args()
    device, dtype, shrink, vocab, budget = resolve_model_args(args, "8GiB")
    cuda = device.type == "cuda"
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    meta = metadata("count_pass", model=args.model, shrink=shrink, vocab=vocab, dtype=dtype, batch_sizes=sizes,
                    prompt_len=args.prompt_len, graphs=args.graphs)
    print(f"{meta['device']}  commit {meta['git_commit'][:10]}  {meta['date']}")
    cfg = shrunk_config(args.model, shrink, vocab)
    out: dict[str, Any] = {}
    for B in sizes:  # a fresh engine per batch size: nothing of the last batch holds pages or sequence slots
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(cfg))
            llm = LLM(tmp, load_format="dummy", device=args.device, dtype=dtype, gpu_memory_budget=budget,
                      offload_mode="static", max_num_seqs=B, max_num_batched_tokens=max(2048, args.prompt_len),
                      max_model_len=args.prompt_len + 128, enforce_eager=not args.graphs, async_scheduling=False,
                      enable_prefix_caching=False)
        engine = llm.engine
        model, runner = engine.model, engine.runner
        layers = engine.spec.num_hidden_layers
        sched, h = capture_decode(llm, B, args.prompt_len)
        batch = runner.device_batch(h)

        def eager(batch: ForwardBatch = batch, model: MoECausalLM = model) -> torch.Tensor:
            return forward(model, batch)

        runs: list[tuple[str, Callable[[], Any]]] = [("eager", eager)]
        if args.graphs and runner.graphs is not None:
            runs.append(("graph", graph_runs(runner, sched, mixed=False)[0]))
        for kind, run in runs:
            regions = count_pass(model, run, emulate_fla=False)
            print_table(f"decode pass, {B} sequences, {kind}", regions, args, layers=layers)
            total = Counts()
            for c in regions.values():
                total.add(c)
            row: dict[str, Any] = {"seqs": B, "kind": kind, "layers": layers,
                                   "regions": {r: c.as_dict() for r, c in regions.items()}, "total": total.as_dict(),
                                   "launches_per_layer": {r: c.launches / layers for r, c in regions.items()},
                                   "estimate_ms": estimate_ms(total, args.us_per_launch, args.us_per_sync)}
            if cuda:
                row.update(gpu_timings(model, run, device, args.reps))
                print(f"  wall {row['wall_ms']['median']:.2f} ms per pass; gpu ms by region "
                      + ", ".join(f"{k} {v:.2f}" for k, v in row["region_ms"]["gpu_ms"].items() if v))
            else:
                row["host_ms"] = host_ms(run, args.reps)
                row["profile_top"], table = profile_top(run, args.profile_reps, args.top)
                print(f"  host {row['host_ms']['median']:.2f} ms per pass (CPU, kernels stubbed, widths / {shrink}); "
                      f"cProfile's top functions by own time:")
                print(table, end="")
            out[f"{kind}-{B}"] = row
        llm.shutdown()
    meta["passes"] = out
    meta["us_per_launch"], meta["us_per_sync"] = args.us_per_launch, args.us_per_sync
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(meta, indent=1) + "\n")
        print(f"\nwrote {args.output_json}")


if __name__ == "__main__":
    main()
