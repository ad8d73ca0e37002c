"""The memory split (expert pages / KV pages / free) and running / waiting requests over time (simulated or
measured: a section is {"timeline": {"t", "expert_bytes", "kv_bytes", "free_bytes", "running", "waiting"}})."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_timelines(sections: dict[str, dict[str, Any]], path: str | Path, title: str,
                   xlabel: str = "simulated time (s)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(sections)
    fig, axes = plt.subplots(2, len(modes), figsize=(5 * len(modes), 6.5), sharex="col", squeeze=False)
    gib = 2.0**30
    for col, mode in enumerate(modes):
        tl = sections[mode]["timeline"]
        t = tl["t"]
        top, bottom = axes[0][col], axes[1][col]
        top.stackplot(t, [b / gib for b in tl["expert_bytes"]], [b / gib for b in tl["kv_bytes"]],
                      [b / gib for b in tl["free_bytes"]], labels=["expert pages", "KV pages", "free"],
                      colors=["#4c72b0", "#dd8452", "#dddddd"])
        top.set_title(mode)
        top.set_ylabel("pool GiB")
        bottom.plot(t, tl["running"], label="running")
        bottom.plot(t, tl["waiting"], ":", label="waiting")
        bottom.set_xlabel(xlabel)
        bottom.set_ylabel("requests")
        if col == 0:
            top.legend(loc="lower left", fontsize=8)
            bottom.legend(loc="upper left", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
