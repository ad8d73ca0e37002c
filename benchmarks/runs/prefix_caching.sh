#!/usr/bin/env bash
# Prefix caching on and off, and beside vLLM's (on by default), Qwen1.5-MoE shapes at 32 GiB, our client for both
# engines on the same token-id requests (docs/benchmarks.md, "Prefix caching workloads"):
#   prefix_caching.sh shared rimuru | shared vllm | multiturn rimuru | multiturn vllm   (each ~9 min)
#   RATES (default 20,40 shared, 4,8 multiturn); CONFIGS for rimuru (default pc-on,pc-off: elastic with prefix
#   caching on and off; static-pc-on: static mode with it on)
# The vLLM runs keep the server's raw /metrics after each point (the reference of vLLM's metric names).
. "$(dirname "$0")/common.sh"
case "${1:-}" in
  shared) rates=${RATES:-20,40}; label=shared-prefix-1024
    client="--dataset shared-prefix --shared-prefix-len 1024 --prompt-format token-ids" ;;
  multiturn) rates=${RATES:-4,8}; label=multiturn
    client="--dataset sharegpt-multiturn --max-prompt-len 2048 --max-total-len 3072 --prompt-format token-ids" ;;
  *) echo "usage: prefix_caching.sh shared|multiturn rimuru|vllm" >&2; exit 2 ;;
esac
common=(--load-format dummy --tokenizer "$ANCHOR/qwen15moe" --dataset-path "$ANCHOR/sharegpt.json" --client rimuru
  --rates "$rates" --num-prompts 400 --warmup-prompts 32 --client-args "$client" --label "$label"
  --time-budget-s 540)
case "${2:-}" in
  rimuru) timeout 560 $SWEEP --model qwen1.5-moe-a2.7b --gpu-memory-budget 32GiB "${common[@]}" \
      --define "pc-on=rimuru:--offload-mode elastic --enable-prompt-tokens-details" \
      --define "pc-off=rimuru:--offload-mode elastic --no-enable-prefix-caching --enable-prompt-tokens-details" \
      --define "static-pc-on=rimuru:--offload-mode static --enable-prompt-tokens-details" \
      --configs "${CONFIGS:-pc-on,pc-off}" --output-json "$OUT/$D-prefix-$label-qwen1.5-32gib-rimuru-$(echo "${CONFIGS:-pc-on,pc-off}" | tr , -)-$C-$G.json" ;;
  vllm) timeout 560 $SWEEP --model "$ANCHOR/qwen15moe" --vllm-site "$VLLM_SITE" "${common[@]}" \
      --define "vllm-pc=vllm:--enable-prefix-caching --enable-prompt-tokens-details" \
      --configs vllm-pc --save-metrics-text "$OUT" \
      --output-json "$OUT/$D-prefix-$label-qwen1.5-32gib-vllm-beside-$C-$G.json" ;;
  *) echo "usage: prefix_caching.sh shared|multiturn rimuru|vllm" >&2; exit 2 ;;
esac
