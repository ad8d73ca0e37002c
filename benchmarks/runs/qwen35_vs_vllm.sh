#!/usr/bin/env bash
# Qwen3.5-35B-A3B shapes (dummy weights, uniform routing) beside vLLM 0.26, text only, the same model folder, client
# and data (vLLM's client, ShareGPT), at a budget where the weights just fit (72 GiB; vLLM the same 72 GiB as its
# share of the card, --language-model-only so its vision tower takes nothing) and below it (60 GiB: static cannot
# start). vLLM refuses to start with its default --max-num-seqs (1024) where the budget holds fewer requests'
# recurrent state (119 at 72 GiB on an H100): it runs with 96, more requests than these rates keep in flight. On
# Hopper (SM90) vLLM picks FlashInfer's GDN prefill kernel, whose SM90 build is missing from the installed wheels
# ("SM90 GDN prefill DSL kernel is unavailable"): its engine dies on the first prefill. It runs with its Triton/FLA
# prefill kernels (--gdn-prefill-backend triton), its own copy of fla's, the same family Rimuru's prefill uses.
#   qwen35_vs_vllm.sh rimuru72   static, fixed98, elastic at 72 GiB   (fla-core must be importable)
#   qwen35_vs_vllm.sh rimuru60   fixed80, elastic at 60 GiB
# fixedNN keeps NN % of each layer's experts resident: the splits `rimuru simulate` finds best at these budgets
# (benchmarks/runs/sim_qwen35.sh; docs/benchmarks.md section 11).
#   qwen35_vs_vllm.sh vllm72     vLLM at 72 GiB
# RATES (default 4,8) and NP (default 200) set the points, CONFIGS a subset of a Rimuru run's configurations (a
# Qwen3.5-35B start takes ~2-3 min: one configuration at two rates fills a command), TIME_BUDGET_S (default 540) the
# seconds the sweep may take.
. "$(dirname "$0")/common.sh"
dir=/tmp/models/qwen35moe
[ -f $dir/config.json ] || python3 benchmarks/model_folder.py qwen3.5-35b-a3b $dir || exit 1
common=(--model $dir --load-format dummy --client vllm --vllm-site "$VLLM_SITE" --dataset-path "$ANCHOR/sharegpt.json"
  --rates "${RATES:-4,8}" --num-prompts "${NP:-200}" --label uniform --time-budget-s "${TIME_BUDGET_S:-540}")
limit=$((${TIME_BUDGET_S:-540} + 20))
fixed=(--define "fixed98=rimuru:--offload-mode fixed --resident-experts 0.98"
  --define "fixed80=rimuru:--offload-mode fixed --resident-experts 0.8")
case "${1:-}" in
  rimuru72) timeout $limit $SWEEP "${common[@]}" --gpu-memory-budget 72GiB --configs "${CONFIGS:-static,fixed98,elastic}" "${fixed[@]}" \
      --output-json "$OUT/$D-serve-qwen3.5-35b-72gib-uniform-rimuru${CONFIGS:+-${CONFIGS//,/-}}-$C-$G.json" ;;
  rimuru60) timeout $limit $SWEEP "${common[@]}" --gpu-memory-budget 60GiB --configs "${CONFIGS:-fixed80,elastic}" "${fixed[@]}" \
      --output-json "$OUT/$D-serve-qwen3.5-35b-60gib-uniform-rimuru${CONFIGS:+-${CONFIGS//,/-}}-$C-$G.json" ;;
  vllm72) timeout $limit $SWEEP "${common[@]}" --gpu-memory-budget 72GiB --vllm-max-model-len 4096 \
      --define "vllm72=vllm:--language-model-only --max-num-seqs 96 --gdn-prefill-backend triton" --configs vllm72 \
      --output-json "$OUT/$D-serve-qwen3.5-35b-72gib-uniform-vllm-beside-$C-$G.json" ;;
  *) echo "usage: qwen35_vs_vllm.sh rimuru72|rimuru60|vllm72" >&2; exit 2 ;;
esac
