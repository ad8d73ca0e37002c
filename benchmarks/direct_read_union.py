"""How many offloaded experts a pass routes to, on the engine's dummy-weight router, against the simulator's formula.

The simulator (rimuru/sim/cost_model.py) counts an expert as read by a pass of T tokens with probability
1 - (1 - q)^T, q = min(1, top_k p): every token routes independently. The engine's direct-access count
(experts/direct_runtime.py) is the experts with routing count > 0 in the pass. This runs a Qwen3-30B-A3B-shaped
dummy model (its hidden size, 128 experts, top-8; fewer layers and a small vocabulary so it runs on the CPU) with
`dummy_routing="zipf:S"` on a batch of decoding requests, greedy (the serving client's temperature 0) and sampled
(temperature 1), and per decode pass counts how many of each layer's `--coldest` least popular experts (by the
promised shares, the ones elastic mode offloads first) were routed, next to the formula with the promised shares
and with the shares the run realised; and how often the `--coldest` experts
that the prefill passes' counts rank lowest (as the engine's online popularity ranks them) are routed in decode.
Also: the distinct tokens a decode batch holds.

    PYTHONPATH=. .venv/bin/python benchmarks/direct_read_union.py \
        --output-json benchmarks/results/2026-12-01-direct-read-union-qwen3-shape-cpu.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import metadata, print_header, write_json  # noqa: E402

from rimuru import LLM  # noqa: E402
from rimuru.engine.sampling_params import SamplingParams  # noqa: E402
from rimuru.experts.popularity import ExpertPopularity  # noqa: E402
from rimuru.experts.routing_counter import RoutingCounter  # noqa: E402
from rimuru.models.dummy_routing import cap_shares  # noqa: E402
from rimuru.testing.tiny_models import make_tiny_checkpoint  # noqa: E402


def run(llm: LLM, batch: int, prompt_len: int, output_len: int, temperature: float, seed: int):
    engine = llm.engine
    spec = engine.spec
    counter = RoutingCounter(spec.num_moe_layers, spec.num_experts, engine.device)
    engine.reset_prefix_cache()
    previous = engine.runtime.swap_routing_counter(counter)
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(batch):
        ids = torch.randint(3, 300, (prompt_len,), generator=g).tolist()
        params = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True,
                                seed=seed + i if temperature > 0 else None)
        engine.add_request(f"r{i}", ids, params)
        reqs.append(f"r{i}")
    passes, tokens, distinct = [], [], []
    total = np.zeros((spec.num_moe_layers, spec.num_experts))
    try:
        while engine.has_unfinished_requests():
            running = list(engine.scheduler.running)
            last = [r.output_token_ids[-1] for r in running if r.output_token_ids]
            decode = bool(running) and len(last) == len(running) and not engine.scheduler.waiting
            engine.step()
            counts = counter.snapshot_and_reset().numpy().astype(np.float64)
            total += counts
            if decode:
                passes.append(counts)
                tokens.append(len(running))
                distinct.append(len(set(last)))
    finally:
        engine.runtime.swap_routing_counter(previous)
    return np.array(passes), np.array(tokens), np.array(distinct), total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exponent", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=24, help="decoding requests (the served runs had ~10-40)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--coldest", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args()

    E, k, hidden = 128, 8, 2048  # Qwen3-30B-A3B's router shape
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint("qwen3_moe", Path(tmp) / "ckpt", num_hidden_layers=args.layers,
                                    num_experts=E, num_experts_per_tok=k, hidden_size=hidden,
                                    moe_intermediate_size=64, intermediate_size=256, num_attention_heads=16,
                                    num_key_value_heads=4, head_dim=128)
        llm = LLM(str(path), load_format="dummy", device="cpu", gpu_memory_budget="12GiB", dtype="float32",
                  dummy_routing=f"zipf:{args.exponent}", enforce_eager=True, seed=args.seed,
                  max_num_seqs=args.batch)
        promised = cap_shares(ExpertPopularity.zipf(str(path), args.layers, E, args.exponent,
                                                    seed=args.seed).probabilities, k)  # [L, E]
        meta = metadata("direct_read_union", exponent=args.exponent, layers=args.layers, hidden_size=hidden,
                        num_experts=E, top_k=k, batch=args.batch, prompt_len=args.prompt_len,
                        output_len=args.output_len, coldest=args.coldest,
                        note="dummy weights on the CPU, Qwen3-30B-A3B router shape; not an engine serving run")
        print_header(meta)
        rows = []
        cold = np.argsort(promised, axis=1)[:, :args.coldest]  # [L, c] least popular first
        for temperature in (0.0, 1.0):
            passes, tokens, distinct, total = run(llm, args.batch, args.prompt_len, args.output_len, temperature,
                                                  args.seed)
            realised = total / total.sum(axis=1, keepdims=True)
            routed = np.take_along_axis(passes > 0, np.broadcast_to(cold, (len(passes), *cold.shape)), axis=2)
            # the coldest as an online estimate would find them: by the prefill passes' counts, measured on decode
            learned = np.argsort(total - passes.sum(axis=0), axis=1, kind="stable")[:, :args.coldest]
            routed_learned = np.take_along_axis(passes > 0, np.broadcast_to(learned, (len(passes), *cold.shape)),
                                                axis=2)
            measured = routed.sum(axis=(1, 2)).mean() / args.layers  # per layer and pass

            def formula(shares: np.ndarray, tokens: np.ndarray = tokens) -> float:
                q = np.minimum(1.0, k * np.take_along_axis(shares, cold, axis=1))  # [L, c]
                act = 1.0 - (1.0 - q[None]) ** tokens[:, None, None]
                return float(act.sum(axis=(1, 2)).mean() / args.layers)

            row = {"temperature": temperature, "decode_passes": len(passes), "mean_tokens": float(tokens.mean()),
                   "mean_distinct_last_tokens": float(distinct.mean()),
                   "coldest_routed_per_layer_pass": float(measured),
                   "learned_coldest_routed_per_layer_pass": float(routed_learned.sum(axis=(1, 2)).mean()
                                                                  / args.layers),
                   "formula_promised_shares": formula(promised), "formula_realised_shares": formula(realised),
                   "coldest_share_promised": float(np.take_along_axis(promised, cold, axis=1).sum(axis=1).mean()),
                   "coldest_share_realised": float(np.take_along_axis(realised, cold, axis=1).sum(axis=1).mean()),
                   "distinct_experts_per_layer_pass": float((passes > 0).sum(axis=2).mean()),
                   "distinct_experts_formula": float((1.0 - (1.0 - np.minimum(1.0, k * promised))[None]
                                                      ** tokens[:, None, None]).sum(axis=2).mean()),
                   "distinct_experts_per_pass_by_layer": [round(float(x), 2) for x in (passes > 0).sum(axis=2).mean(
                       axis=0)],
                   "coldest_routed_per_pass_by_layer": [round(float(x), 3) for x in routed.sum(axis=2).mean(axis=0)]}
            rows.append(row)
            print(", ".join(f"{key} {value:.4g}" if isinstance(value, float | int) else f"{key} {value}"
                            for key, value in row.items()), flush=True)
    write_json(args.output_json, meta, rows)


if __name__ == "__main__":
    main()
