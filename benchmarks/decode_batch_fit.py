"""What an offloaded decode pass costs beyond an all-resident one at the same batch, from serve_sweep files whose
rows carry the step profiler's `decode_by_batch` groups (`--profile-steps`).

Fits GPU forward time = a + b x sequences + c x context tokens over the all-resident groups of every row given (each
group weighted by its steps), then prints each offloaded group beside that prediction: the GPU time offloading adds
(`extra`), the nominal time of the group's reads from host memory (reads x expert bytes / --pcie-gbps), and the
host gap (wall - GPU forward: time the GPU waited for the host).

    PYTHONPATH=. python benchmarks/decode_batch_fit.py --expert-mb 17.3 \\
        benchmarks/results/2026-12-07-prefix-multiturn-qwen1.5-32gib-rimuru-static-pc-on-pc-on-e5a9cbe-h100.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def groups(paths: list[str]) -> list[tuple[str, dict]]:
    out = []
    for path in paths:
        try:
            with open(path) as f:
                rows = json.load(f)["rows"]
        except (OSError, ValueError, KeyError) as err:
            sys.exit(f"{path}: not a readable serve_sweep result ({err!r})")
        for row in rows:
            for g in (row.get("step_profile") or {}).get("decode_by_batch", []):
                if g["gpu_forward_ms"] is not None:
                    out.append((f"{row['config']}@{row['rate']:g}", g))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--expert-mb", type=float, required=True, help="one routed expert's bytes, MB (1e6)")
    ap.add_argument("--pcie-gbps", type=float, default=55.0, help="nominal host->device bandwidth, GB/s")
    ap.add_argument("--min-steps", type=int, default=20, help="groups with fewer steps are left out")
    a = ap.parse_args()
    found = [(name, g) for name, g in groups(a.files) if g["steps"] >= a.min_steps]
    resident = [g for _, g in found if not g["offloaded"]]
    if len(resident) < 3:
        sys.exit(f"need >= 3 all-resident decode groups of >= {a.min_steps} steps to fit, found {len(resident)}")
    x = np.array([[1.0, g["seqs_mean"], g["context_tokens_mean"] / 1e3] for g in resident])
    y = np.array([g["gpu_forward_ms"] for g in resident])
    w = np.sqrt([g["steps"] for g in resident])
    coef = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)[0]
    print(f"all-resident decode GPU forward = {coef[0]:.2f} ms + {coef[1]:.3f} ms/sequence + {coef[2]:.3f} ms per 1k "
          f"context tokens ({len(resident)} groups)")
    print(f"{'row':<18} {'seqs':>5} {'steps':>6} {'out':>6} {'context':>8} {'reads':>6} {'gpu ms':>7} {'pred':>6} "
          f"{'extra':>6} {'reads ms':>8} {'host gap':>8}")
    for name, g in found:
        if not g["offloaded"]:
            continue
        pred = float(coef @ [1.0, g["seqs_mean"], g["context_tokens_mean"] / 1e3])
        nominal = g["host_reads_mean"] * a.expert_mb / a.pcie_gbps
        gpu = g["gpu_forward_ms"]
        print(f"{name:<18} {g['seqs_from']:>5} {g['steps']:>6} {g['offloaded_mean']:>6.0f} "
              f"{g['context_tokens_mean']:>8} {g['host_reads_mean']:>6.1f} {gpu:>7.2f} {pred:>6.2f} {gpu - pred:>6.2f} "
              f"{nominal:>8.2f} {g['wall_ms'] - gpu:>8.2f}")


if __name__ == "__main__":
    main()
