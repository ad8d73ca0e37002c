"""benchmarks/calibrate_simulator.py: which measured passes become fitting samples."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.calibrate_simulator import samples_of  # noqa: E402


def group(seqs: float, context: int, steps: int, gpu_ms: float, offloaded: bool = False) -> dict:
    return {"seqs_from": int(seqs), "seqs_to": int(seqs) + 7, "offloaded": offloaded, "steps": steps,
            "seqs_mean": seqs, "context_tokens_mean": context, "gpu_forward_ms": gpu_ms, "wall_ms": gpu_ms + 0.5}


def doc(profile: dict) -> dict:
    row = {"status": "ok", "config": "static", "rate": 20.0, "step_profile": profile,
           "timeline": {"running": [0, 10, 20], "kv_pages_used": [0, 480, 960]}}
    return {"model": "qwen1.5-moe-a2.7b", "seed": 0, "rows": [row], "servers": {
        "static": {"command": "python -m rimuru.cli serve qwen1.5-moe-a2.7b --offload-mode static"}}}


KINDS = {"decode-graph": {"steps": 900, "tokens_mean": 30.0, "seqs_mean": 30.0, "gpu_forward_ms": 9.0},
         "mixed-graph": {"steps": 100, "tokens_mean": 300.0, "seqs_mean": 31.0, "gpu_forward_ms": 16.0}}


def test_each_resident_decode_group_is_a_sample_in_place_of_the_kinds_mean() -> None:
    groups = [group(4.0, 4_000, 300, 4.5), group(36.0, 11_520, 500, 11.0), group(60.0, 18_000, 5, 12.5),
              group(40.0, 12_000, 200, 14.0, offloaded=True)]
    samples = samples_of(doc({"kinds": KINDS, "decode_by_batch": groups}), "f.json", {}, min_steps=20)
    decodes = [s for s in samples if all(n == 1 for _, n in s.chunks)]
    # the groups with enough steps and every expert resident, each at its own batch and context per sequence
    assert [(len(s.chunks), s.chunks[0][0], s.measured_s) for s in decodes] == [(4, 1_000, 4.5e-3),
                                                                                 (36, 320, 11.0e-3)]
    mixed = [s for s in samples if s not in decodes]
    assert len(mixed) == 1 and mixed[0].measured_s == 16.0e-3 and sum(n for _, n in mixed[0].chunks) == 300


def test_a_row_without_groups_keeps_the_decode_kinds_mean() -> None:
    samples = samples_of(doc({"kinds": KINDS}), "f.json", {}, min_steps=20)
    assert sorted(s.measured_s for s in samples) == [9.0e-3, 16.0e-3]
    decode = next(s for s in samples if s.measured_s == 9.0e-3)
    # context from the timeline: 48 pages per running request over 24 attention layers x 16 tokens a block
    assert len(decode.chunks) == 30 and decode.chunks[0] == (32, 1)
