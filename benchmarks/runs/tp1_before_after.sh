#!/usr/bin/env bash
# One GPU before and after a change (docs/benchmarks.md section 12): Qwen1.5-MoE shapes, static, 32 GiB, uniform,
# 300 requests at 40 req/s, our client; the before tree (a `git archive` of BEFORE_COMMIT unpacked in BEFORE_ROOT)
# and this tree alternately, ROUNDS times (default 2), so two runs of one code show their spread (~2.5 min a round).
#   BEFORE_ROOT=/tmp/before BEFORE_COMMIT=<hash> tp1_before_after.sh
. "$(dirname "$0")/common.sh"
B=${BEFORE_COMMIT:?name the before commit}; root=${BEFORE_ROOT:?name the before tree}
common="--model qwen1.5-moe-a2.7b --gpu-memory-budget 32GiB --label uniform --num-prompts 300 --configs static --rates 40"
for r in $(seq 1 "${ROUNDS:-2}"); do
  timeout 150 $SWEEP $common --server-root "$root" --server-commit "$B" \
    --output-json "$OUT/$D-tp-before-qwen1.5-32gib-static-40rps-${B:0:7}-r$r-$G.json" 2>&1 | tail -3
  timeout 150 $SWEEP $common --output-json "$OUT/$D-tp-after-qwen1.5-32gib-static-40rps-$C-r$r-$G.json" 2>&1 | tail -3
done
