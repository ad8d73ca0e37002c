#!/usr/bin/env bash
# `rimuru simulate` on the Qwen3.5-35B-A3B cells that qwen35_vs_vllm.sh measures (H100 profile, uniform routing,
# 200 ShareGPT prompts, no prefix cache): static and elastic at 72 GiB (4 and 8 req/s), fixedNN (NN % of each layer's experts
# resident) at 72 GiB (8 req/s) and 60 GiB (4 req/s), elastic at 60 GiB. CPU only; one gzipped JSON per command in $OUT.
. "$(dirname "$0")/common.sh"
sim() {  # NAME ARGS...: one simulation, its table line(s) printed, its JSON gzipped
  local name=$1; shift
  rimuru simulate --model qwen3.5-35b-a3b --num-prompts 200 --hardware h100 "$@" \
    --output-json "$OUT/$D-sim-qwen3.5-35b-$name-$C-h100.json" | grep -E "^(static|fixed|elastic)" | sed "s/^/$name: /"
  gzip -f "$OUT/$D-sim-qwen3.5-35b-$name-$C-h100.json"
}
for r in 4 8; do sim 72gib-static-elastic-${r}rps --gpu-memory-budget 72GiB --modes static,elastic --request-rate $r --sweep-rates $r; done
for p in 98 95 85; do sim 72gib-fixed$p-8rps --gpu-memory-budget 72GiB --modes fixed --resident-experts 0.$p --request-rate 8 --sweep-rates 8; done
for p in 85 80 70; do sim 60gib-fixed$p-4rps --gpu-memory-budget 60GiB --modes fixed --resident-experts 0.$p --request-rate 4 --sweep-rates 4; done
sim 60gib-elastic-4rps --gpu-memory-budget 60GiB --modes elastic --request-rate 4 --sweep-rates 4
