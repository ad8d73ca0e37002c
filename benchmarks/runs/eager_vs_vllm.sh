#!/usr/bin/env bash
# Eager mode beside vLLM eager (docs/benchmarks.md section 13): Qwen1.5-MoE shapes at 32 GiB, 10 req/s, 300 ShareGPT
# requests, vLLM's client. Two commands, back to back:
#   eager_vs_vllm.sh rimuru   static and elastic, --enforce-eager, each server on an empty Triton cache (~7.5 min)
#   eager_vs_vllm.sh vllm     vLLM 0.26 --enforce-eager at the same 32 GiB (~5 min)
. "$(dirname "$0")/common.sh"
common="--model $ANCHOR/qwen15moe --load-format dummy --gpu-memory-budget 32GiB --client vllm --vllm-site $VLLM_SITE
  --rates 10 --num-prompts 300 --label uniform"
case "${1:-}" in
  rimuru) export TRITON_CACHE_DIR=$(mktemp -d)
    timeout 560 $SWEEP $common --rimuru-args=--enforce-eager --configs static,elastic --log-dir "$OUT/logs-eager" \
      --output-json "$OUT/$D-serve-qwen1.5-32gib-uniform-eager-rimuru-10rps-$C-$G.json" ;;
  vllm) timeout 560 $SWEEP $common --vllm-args=--enforce-eager --configs vllm \
      --output-json "$OUT/$D-serve-qwen1.5-32gib-uniform-eager-vllm-10rps-beside-$C-$G.json" ;;
  *) echo "usage: eager_vs_vllm.sh rimuru|vllm" >&2; exit 2 ;;
esac
