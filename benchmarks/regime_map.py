"""The regime map: which offload mode serves a model best on a budget and a traffic, by the rate it sustains
under a latency SLO, with the simulator's prediction beside every measured point.

A cell is (model, budget, routing). serve_sweep.py measures each mode (a sweep configuration: static, a fixed split,
elastic with its defaults, elastic with an SLO, vLLM) at several request rates; this script reads those files and:

    build   one row per measured point (the fields below), each with `rimuru simulate`'s prediction for the same
            configuration, requests and rate on the profile of the GPU the files were measured on (one GPU a
            map); per cell and mode the SLO capacity, measured and predicted: the highest measured rate such
            that it and every lower measured rate hold TTFT p99 <= 2 s and TPOT p99 <= 50 ms (None when the
            lowest misses); a plot of throughput and TTFT p99 against rate
    plan    before any GPU time: the simulator's capacity of each mode on a grid of rates, and the rates to
            measure around each predicted knee (10 % steps), as serve_sweep.py arguments

    PYTHONPATH=. python benchmarks/regime_map.py build benchmarks/results/*-serve-*-h200.json \\
        --output-json benchmarks/results/DATE-regime-map-h200.json --plot docs/regime_map_h200.png
    PYTHONPATH=. python benchmarks/regime_map.py plan --model qwen3-30b-a3b --gpu-memory-budget 59GiB \\
        --routing zipf:1.0 --define 'static=rimuru:--offload-mode static' \\
        --define 'elastic=rimuru:--offload-mode elastic' --num-prompts 400

vLLM has no skewed router: its rows are uniform only, and the simulator predicts no vLLM configuration.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import metadata, write_json  # noqa: E402
from benchmarks.result_files import run_of  # noqa: E402
from benchmarks.serve_sweep import BUILTIN_CONFIGS  # noqa: E402
from benchmarks.slo import TPOT_P99_SLO_MS, TTFT_P99_SLO_MS  # noqa: E402
from rimuru.config import parse_bytes  # noqa: E402

# measured beside the predicted ones (the simulator predicts these too): where a prediction misses, these say why
EXPLAINING_FIELDS = ("peak_waiting", "preemptions", "forward_steps", "expert_evictions", "kv_pages_moved")
ROW_FIELDS = ("model", "budget_gib", "routing", "mode", "rate", "num_prompts", "output_throughput", "median_ttft_ms",
              "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "peak_running", "expert_bytes_pcie")


def meets_slo(point: dict[str, Any]) -> bool:
    ttft, tpot = point.get("p99_ttft_ms"), point.get("p99_tpot_ms")
    return ttft is not None and tpot is not None and ttft <= TTFT_P99_SLO_MS and tpot <= TPOT_P99_SLO_MS


def slo_capacity(points: dict[float, dict[str, Any]]) -> float | None:
    """The highest rate of `points` such that it and every lower one meet both SLOs."""
    best = None
    for rate in sorted(points):
        if not meets_slo(points[rate]):
            break
        best = rate
    return best


def routing_of(flags: list[str]) -> str:
    """`--dummy-routing zipf:S` among a Rimuru server's flags, else uniform (vLLM's dummy weights route uniformly)."""
    for i, flag in enumerate(flags):
        if flag == "--dummy-routing" and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith("--dummy-routing="):
            return flag.split("=", 1)[1]
    return "uniform"


def server_flags(doc: dict[str, Any], config: str) -> list[str]:
    command = (doc.get("servers") or {}).get(config, {}).get("command", "")
    return shlex.split(command)


# The cards whose passes a simulator profile was fitted to (rimuru/sim/cost_model.HARDWARE), by the name CUDA gives
# them. Others (an H100 PCIe, a GH200, an RTX 5090 with CUDA graphs) have no profile: a map of their files names one.
FITTED_CARDS = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100"}


def hardware_of(device: str | None, file_name: str = "") -> str | None:
    """The simulator profile fitted to a result file's `device`, e.g. "NVIDIA H100 80GB HBM3" -> "h100"; for a file
    that records no device, the card its name carries (the run scripts end names in -h100 / -h200); None for a card
    without a fitted profile."""
    if device:
        return FITTED_CARDS.get(device.strip())
    card = [h for h in FITTED_CARDS.values() if f"-{h}." in file_name or f"-{h}-" in file_name]
    return card[0] if len(card) == 1 else None


def hardware_of_files(docs: dict[str, dict[str, Any]], override: str | None) -> str:
    """The one profile that predicts every file's rows: `override` when given, else the files' devices, which must
    all be one card with a fitted profile (rows of two cards in one map would compare different machines)."""
    if override:
        return override
    by = {name: hardware_of(doc.get("device"), Path(name).name) for name, doc in docs.items()}
    if None in by.values():
        unknown = ", ".join(f"{n} ({docs[n].get('device')!r})" for n, h in by.items() if h is None)
        raise SystemExit(f"regime_map: no simulator profile for the device of {unknown}; pass --hardware")
    if len(set(by.values())) > 1:
        raise SystemExit("regime_map: the files were measured on different GPUs (" +
                         ", ".join(f"{n}: {h}" for n, h in sorted(by.items())) + "); build one map per GPU")
    return next(iter(by.values()))


def rows_from_sweep(doc: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """The regime rows of one serve_sweep file: its ok rows, with the cell they measure."""
    budget = doc.get("gpu_memory_budget")
    rows = []
    for row in doc.get("rows", []):
        if row.get("status") != "ok":
            continue
        flags = server_flags(doc, row["config"])
        rows.append({
            "model": Path(str(doc.get("model", ""))).name or str(doc.get("model")),
            "budget_gib": round(parse_bytes(budget) / 2**30, 2) if budget else None,
            "routing": "uniform" if row.get("server") == "vllm" else routing_of(flags),
            "mode": row["config"], **{k: row.get(k) for k in (*ROW_FIELDS[4:], *EXPLAINING_FIELDS)},
            "server": row.get("server"), "server_flags": flags, "run": run_of(doc), "file": source,
            "workspace_bytes": row.get("workspace_bytes"), "start_pool_bytes": start_pool_bytes(row)})
    return rows


def start_pool_bytes(row: dict[str, Any]) -> int | None:
    """The page pool of a Rimuru server as its timeline's first sample shows it (free + expert + KV bytes), for rows
    of servers that did not report their workspace yet; None without a timeline."""
    tl = row.get("timeline") or {}
    parts = [tl.get(k) for k in ("pool_free_bytes", "expert_bytes_used", "kv_bytes_used")]
    if not all(parts):
        return None
    return int(sum(p[0] for p in parts))


def capacities(rows: list[dict[str, Any]], key: str = "") -> list[dict[str, Any]]:
    """Per (cell, mode): the measured rates and the SLO capacity; `key` = 'predicted_' reads the predictions."""
    by: dict[tuple, dict[float, dict[str, Any]]] = {}
    for r in rows:
        if key and r.get("predicted") is None:
            continue
        point = r["predicted"] if key else r
        by.setdefault((r["model"], r["budget_gib"], r["routing"], r["mode"]), {})[float(r["rate"])] = point
    return [{"model": m, "budget_gib": b, "routing": rt, "mode": mode, "rates": sorted(pts),
             f"{key}slo_capacity": slo_capacity(pts)} for (m, b, rt, mode), pts in sorted(by.items(), key=str)]


# ---------------------------------------------------------------------------------------------- predictions

def sim_config_of(flags: list[str], budget_bytes: int, hardware: str = "h200",
                  workspace_bytes: int | None = None) -> Any:
    """The SimConfig of a Rimuru server's flags (the settings the simulator models; others keep its defaults) on the
    `hardware` profile, with the workspace the server measured at start-up when given (else the simulator's bound). A
    flag the row does not name takes the current default, also for a row measured when that default was another (a
    result file's commit says which code it measured)."""
    from rimuru.config import EngineConfig
    from rimuru.experts.runtime_builders import slo_config
    from rimuru.sim.cost_model import HARDWARE
    from rimuru.sim.simulator import SimConfig

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--offload-mode", default="static")
    ap.add_argument("--adjuster", default=EngineConfig.adjuster)
    ap.add_argument("--offload-access", default=EngineConfig.offload_access)
    ap.add_argument("--expert-offload-limit", type=int)
    ap.add_argument("--resident-experts", type=float)
    ap.add_argument("--slo-ttft-p99-ms", type=float)
    ap.add_argument("--slo-tpot-p99-ms", type=float)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    known, _ = ap.parse_known_args(flags)
    return SimConfig(mode=known.offload_mode, budget_bytes=budget_bytes, hardware=HARDWARE[hardware],
                     workspace_bytes=workspace_bytes, adjuster_kind=known.adjuster,
                     cost=slo_config(known.slo_ttft_p99_ms, known.slo_tpot_p99_ms, known.offload_access),
                     resident_experts=known.resident_experts,
                     expert_offload_limit=known.expert_offload_limit, max_num_seqs=known.max_num_seqs,
                     max_num_batched_tokens=known.max_num_batched_tokens, offload_access=known.offload_access)


def measured_workspace(row: dict[str, Any], spec: Any, budget_bytes: int) -> int | None:
    """The workspace a row's server measured at start-up: as it reported it, else what its first timeline sample's
    pool leaves of the budget beside the non-expert weights; None when neither is known."""
    if row.get("workspace_bytes"):
        return int(row["workspace_bytes"])
    if row.get("start_pool_bytes"):
        return budget_bytes - spec.non_expert_bytes() - int(row["start_pool_bytes"])
    return None


def simulate(model: str, routing: str, flags: list[str], budget_bytes: int, rate: float, num_prompts: int,
             seed: int = 0, workspace_bytes: int | None = None, hardware: str = "h200",
             routing_file: str | None = None) -> dict[str, Any]:
    """`rimuru simulate`'s prediction of one point (the H200 profile by default): the row fields it predicts, in ms.
    `workspace_bytes`: what the server measured at start-up (None: the simulator's bound). `routing_file`: a
    `rimuru profile` ranking of the served router, whose measured shares the simulation routes with instead of
    those `routing` promises (the dummy router does not realise its promised shares expert by expert)."""
    from rimuru.experts.popularity import ExpertPopularity
    from rimuru.model_spec import load_model_spec
    from rimuru.sim.cli import dummy_router_popularity, load_requests, with_arrivals
    from rimuru.sim.simulator import Simulation

    spec = load_model_spec(model)
    pop = ExpertPopularity.load(routing_file, spec.num_moe_layers, spec.num_experts) if routing_file \
        else dummy_router_popularity(model, routing, spec, seed)
    s = Simulation(spec, pop, sim_config_of(flags, budget_bytes, hardware, workspace_bytes)).run(
        with_arrivals(load_requests("sharegpt", num_prompts, seed), rate, seed)).summary()
    return {"output_throughput": s["output_throughput_tok_s"], "median_ttft_ms": 1e3 * s["ttft_p50_s"],
            "p99_ttft_ms": 1e3 * s["ttft_p99_s"], "median_tpot_ms": 1e3 * s["tpot_p50_s"],
            "p99_tpot_ms": 1e3 * s["tpot_p99_s"], "peak_running": s["peak_running"],
            "expert_bytes_pcie": s["pcie_bytes"],
            # EXPLAINING_FIELDS, beside the row's measured ones
            "peak_waiting": s["peak_waiting"], "preemptions": s["preemptions"], "forward_steps": s["forward_steps"],
            "expert_evictions": s["evictions"], "kv_pages_moved": s["kv_pages_moved"]}


def with_predictions(rows: list[dict[str, Any]], model_of: dict[str, str], hardware: str = "h200",
                     routing_files: dict[tuple[str, str], str] | None = None) -> list[dict[str, Any]]:
    """Each Rimuru row gets `predicted` (the simulator on the same configuration, requests, rate and start-up
    workspace, on the `hardware` profile); `model_of` maps a row's model name to what load_model_spec reads (a preset
    name or a model directory); `routing_files` maps (model, routing) to a measured routing profile to simulate
    those rows with (`simulate`'s routing_file; the prediction names it)."""
    from rimuru.model_spec import load_model_spec

    out = []
    for r in rows:
        predicted = None
        if r["server"] == "rimuru" and r["budget_gib"] is not None:
            try:
                model = model_of.get(r["model"], r["model"])
                budget = int(r["budget_gib"] * 2**30)
                workspace = measured_workspace(r, load_model_spec(model), budget)
                routing_file = (routing_files or {}).get((r["model"], r["routing"]))
                predicted = simulate(model, r["routing"], r["server_flags"], budget, float(r["rate"]),
                                     int(r["num_prompts"]), workspace_bytes=workspace, hardware=hardware,
                                     routing_file=routing_file)
                if routing_file:
                    predicted["routing_file"] = Path(routing_file).name
            except (ValueError, RuntimeError) as e:  # a configuration the simulator refuses: say so in the row
                predicted = {"error": str(e)[:300]}
        out.append({**r, "predicted": predicted})
    return out


def routing_profiles(specs: list[str]) -> dict[tuple[str, str], str]:
    """`--routing-profile MODEL:ROUTING=FILE` arguments as {(model, routing): file}; a missing file or a malformed
    argument stops with its name."""
    out = {}
    for spec in specs:
        key, sep, path = spec.partition("=")
        model, sep2, routing = key.partition(":")
        if not sep or not sep2 or not model or not routing or not path:
            raise SystemExit(f"regime_map: bad --routing-profile {spec!r}: use MODEL:ROUTING=FILE, e.g. "
                             "qwen3-30b-a3b:zipf:1.0=ranking.json")
        if not Path(path).is_file():
            raise SystemExit(f"regime_map: --routing-profile {spec!r}: no file {path}")
        out[(model, routing)] = path
    return out


# ---------------------------------------------------------------------------------------------- commands

def build(args: argparse.Namespace) -> None:
    docs = {path: json.loads(Path(path).read_text()) for path in args.files}
    rows = [row for path, doc in docs.items() for row in rows_from_sweep(doc, Path(path).name)]
    hardware, routing_files = None, routing_profiles(args.routing_profile)
    if not args.no_predictions:
        hardware = hardware_of_files(docs, args.hardware)
        rows = with_predictions(rows, dict(m.split("=", 1) for m in args.model_path), hardware, routing_files)
    measured = capacities(rows)
    predicted = {tuple(c[k] for k in ("model", "budget_gib", "routing", "mode")): c["predicted_slo_capacity"]
                 for c in capacities([r for r in rows if isinstance(r.get("predicted"), dict)
                                      and "error" not in r["predicted"]], key="predicted_")}
    for c in measured:
        c["predicted_slo_capacity"] = predicted.get(tuple(c[k] for k in ("model", "budget_gib", "routing", "mode")))
    meta = metadata("regime_map", slo={"p99_ttft_ms": TTFT_P99_SLO_MS, "p99_tpot_ms": TPOT_P99_SLO_MS},
                    simulator_hardware=hardware, routing_profiles={f"{m}:{r}": Path(f).name
                                                                   for (m, r), f in routing_files.items()},
                    capacities=measured)
    for c in measured:
        print(f"{c['model']:>20} {c['budget_gib']:>6} GiB {c['routing']:>9} {c['mode']:>18}  capacity "
              f"{c['slo_capacity']} req/s (predicted {c['predicted_slo_capacity']}), rates {c['rates']}")
    write_json(Path(args.output_json) if args.output_json else None, meta, rows)
    if args.plot:
        plot(rows, Path(args.plot))


# what `plan` predicts without --define: the sweep's own configurations of static and elastic mode
DEFAULT_PLAN_CONFIGS = ("static", "elastic", "elastic-slo")


def plan(args: argparse.Namespace) -> None:
    """Predicted capacity per configuration on a grid, then the rates around each knee to measure."""
    budget = parse_bytes(args.gpu_memory_budget)
    workspace = parse_bytes(args.workspace) if args.workspace else None
    grid = [float(r) for r in args.grid.split(",")]
    defines = args.define or [f"{name}=rimuru:{shlex.join(BUILTIN_CONFIGS[name][1])}" for name in DEFAULT_PLAN_CONFIGS]
    for define in defines:
        name, _, spec = define.partition("=")
        server, _, flags = spec.partition(":")
        if server != "rimuru":
            print(f"{name}: {server} is not simulated")
            continue
        points = {}
        for rate in grid:
            points[rate] = simulate(args.model, args.routing, shlex.split(flags), budget, rate, args.num_prompts,
                                    workspace_bytes=workspace, hardware=args.hardware)
            if not meets_slo(points[rate]):
                break
        knee = slo_capacity(points)
        base = knee if knee is not None else grid[0]
        rates = sorted({round(base * f, 2) for f in (0.8, 0.9, 1.0, 1.1, 1.2)})
        print(f"{name}: predicted SLO capacity {knee} req/s on {sorted(points)}; measure "
              f"--configs {name} --rates {','.join(f'{r:g}' for r in rates)} --num-prompts {args.num_prompts}")


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["model"], r["budget_gib"], r["routing"]) for r in rows}, key=str)
    fig, axes = plt.subplots(3, len(cells), figsize=(5 * len(cells), 10), squeeze=False)
    modes = sorted({r["mode"] for r in rows})
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(modes)}  # one colour per mode in every panel
    for j, cell in enumerate(cells):
        for mode in sorted({r["mode"] for r in rows if (r["model"], r["budget_gib"], r["routing"]) == cell}):
            # one point per rate: the last file's row where several runs measured it (as `capacities` reads them)
            by_rate = {float(r["rate"]): r for r in rows
                       if (r["model"], r["budget_gib"], r["routing"]) == cell and r["mode"] == mode}
            pts = sorted(by_rate.items(), key=lambda p: p[0])
            xs = [x for x, _ in pts]
            axes[0][j].plot(xs, [r["output_throughput"] for _, r in pts], "o-", label=mode, color=colors[mode])
            axes[1][j].plot(xs, [r["p99_ttft_ms"] / 1e3 for _, r in pts], "o-", label=mode, color=colors[mode])
            axes[2][j].plot(xs, [r["p99_tpot_ms"] for _, r in pts], "o-", label=mode, color=colors[mode])
        axes[0][j].set_title(f"{cell[0]}, {cell[1]} GiB, {cell[2]}")
        axes[0][j].set_ylabel("output tok/s")
        axes[1][j].set_ylabel("TTFT p99 (s)")
        axes[1][j].axhline(TTFT_P99_SLO_MS / 1e3, color="grey", linestyle=":")
        axes[2][j].set_ylabel("TPOT p99 (ms)")
        axes[2][j].axhline(TPOT_P99_SLO_MS, color="grey", linestyle=":")
        axes[2][j].set_xlabel("request rate (req/s)")
        axes[0][j].legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    from rimuru.sim.cost_model import HARDWARE

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="regime rows and SLO capacities from serve_sweep files")
    b.add_argument("files", nargs="+")
    b.add_argument("--output-json")
    b.add_argument("--plot")
    b.add_argument("--no-predictions", action="store_true", help="skip the simulator (no predicted fields)")
    b.add_argument("--model-path", action="append", default=[], metavar="NAME=PATH",
                   help="what the simulator loads for a row's model name (default: the name, a preset)")
    b.add_argument("--routing-profile", action="append", default=[], metavar="MODEL:ROUTING=FILE",
                   help="simulate the rows of MODEL served with --dummy-routing ROUTING with the shares a `rimuru "
                        "profile` of that server measured, or those an elastic point realised (serve_sweep.py writes "
                        "them beside its result file: RESULT-routing-CONFIG-RATErps.json), e.g. "
                        "qwen3-30b-a3b:zipf:1.0=ranking.json")
    b.add_argument("--hardware", choices=sorted(HARDWARE),
                   help="the simulator's GPU profile (default: the one of the files' device; all files one GPU)")
    p = sub.add_parser("plan", help="the simulator's capacity per configuration, and the rates to measure")
    p.add_argument("--model", required=True)
    p.add_argument("--gpu-memory-budget", required=True)
    p.add_argument("--routing", default="uniform")
    p.add_argument("--define", action="append", default=[], metavar="NAME=SERVER:FLAGS",
                   help=f"a configuration to predict (default: serve_sweep's {', '.join(DEFAULT_PLAN_CONFIGS)})")
    p.add_argument("--num-prompts", type=int, default=400)
    p.add_argument("--grid", default="1,2,4,6,8,10,12,16,20,24,32,40,48,64")
    p.add_argument("--hardware", default="h200", choices=sorted(HARDWARE), help="the simulator's GPU profile")
    p.add_argument("--workspace", help="the workspace the engine measured at start-up for this model and budget, "
                                       "e.g. 1468MB (a served row's workspace_bytes; default: the simulator's bound)")
    args = ap.parse_args(argv)
    if args.command == "build":
        build(args)
    else:
        plan(args)


if __name__ == "__main__":
    main()
