"""The sweep's plots (serve_sweep.py --plot / --plot-memory / --plot-from): throughput and TTFT p50 against rate,
and the memory split over time at one rate."""

from __future__ import annotations

import json
from pathlib import Path

from result_files import run_of


def plot_series(json_paths: list[Path]) -> dict[str, list[tuple[float, float, float]]]:
    """Line name -> (rate, output tok/s, TTFT p50 ms) of the ok rows. One line per configuration and label;
    where files of several runs (commits, result_files.py) hold the same one, one line per run, named by its
    commit, so rows measured by different code never join into one line."""
    by_run: dict[str, dict[str | None, list[tuple[float, float, float]]]] = {}
    for path in json_paths:
        doc = json.loads(Path(path).read_text())
        for row in doc["rows"]:
            if row.get("status") != "ok":
                continue
            key = row["config"] + (f" ({row['label']})" if row.get("label") else "")
            by_run.setdefault(key, {}).setdefault(run_of(doc), []).append(
                (row["rate"], row["output_throughput"], row["median_ttft_ms"]))
    return {(f"{key}, code {run}" if len(runs) > 1 and run else key): sorted(pts)
            for key, runs in by_run.items() for run, pts in runs.items()}


def plot(json_paths: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = plot_series(json_paths)
    if not series:
        raise SystemExit("no ok rows to plot")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, pts in sorted(series.items()):
        pts.sort()
        rates = [p[0] for p in pts]
        ax1.plot(rates, [p[1] for p in pts], marker="o", label=key)
        ax2.plot(rates, [p[2] / 1e3 for p in pts], marker="o", label=key)
    ax1.set(xlabel="request rate (req/s)", ylabel="output tokens/s", title="Output throughput")
    ax2.set(xlabel="request rate (req/s)", ylabel="TTFT p50 (s)", title="TTFT p50", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def plot_memory(json_paths: list[Path], rate: float, out: Path) -> None:
    """The memory split over time at one rate, one panel per configuration. Rimuru: the pool's bytes held by
    experts (resident and load buffers), by KV pages, by a hybrid model's state pages, and free (stacked), with
    running and waiting requests;
    vLLM: its KV-cache usage with running and waiting (it exposes no byte split)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for path in json_paths:
        doc = json.loads(Path(path).read_text())
        run = run_of(doc)
        for row in doc["rows"]:
            tl = row.get("timeline") or {}
            if row.get("status") == "ok" and float(row["rate"]) == float(rate) and tl.get("t"):
                rows.append({**row, "run": run, "budget": doc.get("gpu_memory_budget")})
    if not rows:
        raise SystemExit(f"no ok rows with a timeline at {rate} req/s")
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 2.8 * len(rows)), squeeze=False)
    gib = 2**30
    for ax, row in zip(axes[:, 0], rows, strict=True):
        tl = row["timeline"]
        t = tl["t"]
        name = row["config"] + (f" ({row['label']})" if row.get("label") else "")
        if tl.get("expert_bytes_used") and tl.get("kv_bytes_used"):
            parts = [("experts", tl["expert_bytes_used"]), ("KV cache", tl["kv_bytes_used"])]
            if any(tl.get("state_bytes_used") or []):  # a hybrid model's ssm and conv pages
                parts.append(("recurrent state", tl["state_bytes_used"]))
            parts.append(("free", tl.get("pool_free_bytes") or [0] * len(t)))
            ax.stackplot(t, *[[(v or 0) / gib for v in vals] for _, vals in parts], labels=[p[0] for p in parts],
                         alpha=0.7)
            ax.set_ylabel("pool (GiB)")
            # where the experts hold most of the pool throughout (weights that just fit), the axis starts below their
            # least, so that the KV cache, the state and the free pages stay readable
            experts = [(v or 0) / gib for v in tl["expert_bytes_used"]]
            pool = max(sum((vals[i] or 0) for _, vals in parts) for i in range(len(t))) / gib
            if pool and min(experts) > 0.8 * pool:
                ax.set_ylim(max(0.0, min(experts) - 0.25 * (pool - min(experts))), pool * 1.01)
                ax.set_ylabel("pool (GiB; axis cut below)")
        elif tl.get("kv_cache_usage"):
            ax.plot(t, [100 * (v or 0) for v in tl["kv_cache_usage"]], color="tab:orange", label="KV cache used")
            ax.set_ylabel("KV cache (%)")
        twin = ax.twinx()
        for key, style in (("running", "-"), ("waiting", "--")):
            if tl.get(key):
                twin.plot(t, [v or 0 for v in tl[key]], style, color="black", linewidth=1, label=key)
        twin.set_ylabel("requests")
        ax.set_title(f"{name}" + (f", {row['budget']}" if row["budget"] else "") + f" at {rate:g} req/s"
                     + (f", code {row['run']}" if row["run"] else ""))
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        labels = ax.get_legend_handles_labels()[1] + twin.get_legend_handles_labels()[1]
        ax.legend(handles, labels, fontsize=7, loc="upper right")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time in the point (s)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
