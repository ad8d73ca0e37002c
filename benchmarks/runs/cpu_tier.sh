#!/usr/bin/env bash
# The host as an expert tier, Qwen3-30B-A3B shapes (dummy weights) at 48 GiB, where the weights do not fit:
#   cpu_tier.sh host                 the host's read bandwidth and one expert's time by threads, and the decode
#                                    ceilings at 48 and 24 GiB (benchmarks/bench_host_experts.py; ~2 min)
#   cpu_tier.sh serve CONFIG RATE    one elastic configuration at one rate, 100 ShareGPT requests, vLLM's client:
#                                    CONFIG tier (copies, offloaded experts computed on the host where cheaper),
#                                    copy (copies only), direct (the default: the MoE kernel reads host memory);
#                                    RATE a number, or sat (all at once, --max-concurrency 32). A start (~2 min)
#                                    and a point (~3 min at 2 req/s) fit one command.
. "$(dirname "$0")/common.sh"
dir=/tmp/models/qwen3moe
case "${1:-}" in
  host) timeout 560 python3 benchmarks/bench_host_experts.py --model qwen3-30b-a3b --budgets-gib 48 24 \
      --output-json "$OUT/$D-host-experts-qwen3-$C-$G.json" ;;
  serve) config=${2:?CONFIG}; rate=${3:?RATE}
    [ -f $dir/config.json ] || python3 benchmarks/model_folder.py qwen3-30b-a3b $dir || exit 1
    case "$config" in
      tier) flags="--offload-mode elastic --offload-access copy --cpu-expert-compute on" ;;
      copy) flags="--offload-mode elastic --offload-access copy --cpu-expert-compute off" ;;
      direct) flags="--offload-mode elastic" ;;
      *) echo "CONFIG: tier | copy | direct" >&2; exit 2 ;;
    esac
    client=""; r=$rate
    if [ "$rate" = sat ]; then r=inf; client="--max-concurrency 32"; fi
    timeout 580 $SWEEP --model $dir --load-format dummy --gpu-memory-budget 48GiB --client vllm --vllm-site "$VLLM_SITE" \
      --dataset-path "$ANCHOR/sharegpt.json" --num-prompts 100 --rates "$r" ${client:+--client-args "$client"} \
      --define "$config=rimuru:$flags" --configs "$config" --label uniform --time-budget-s 570 \
      --output-json "$OUT/$D-serve-qwen3-48gib-uniform-$config-${rate}rps-$C-$G.json" ;;
  *) echo "usage: cpu_tier.sh host | serve tier|copy|direct RATE|sat" >&2; exit 2 ;;
esac
