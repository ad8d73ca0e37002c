#!/usr/bin/env bash
# The two-GPU runs (one host, two H200s), in the order a short lease wants them; each step one command:
#   two_gpus.sh allreduce    whether captured NCCL all-reduces replay and shut down (benchmarks/
#                            check_captured_allreduce.py), over the GPUs' own link and with NCCL_P2P_DISABLE=1
#                            (closer to two consumer cards on PCIe); `nvidia-smi topo -m` beside the results.
#                            First: a tensor-parallel engine captures its collectives in CUDA graphs by default
#   two_gpus.sh deadpeer     whether a rank blocked in an NCCL collective on a dead peer gets out (the engine's peer
#                            watch: benchmarks/check_nccl_dead_peer.py), with the watch and without it
#   two_gpus.sh tests        the tensor-parallel GPU tests (NCCL, float32 tiny models: TP=2 tokens equal TP=1 and
#                            transformers, with graphs and eager)
#   two_gpus.sh rimuru CONFIGS RATES   Qwen3-30B-A3B shapes at 2 x 32 GiB, --tensor-parallel-size 2, uniform
#                            routing (ROUTING=zipf for zipf 1.0), 400 ShareGPT requests a point, vLLM's client
#   two_gpus.sh vllm RATES   vLLM 0.26 --tensor-parallel-size 2 at 32 GiB a GPU, the same client
# e.g. two_gpus.sh rimuru static,elastic,elastic-slo 2,4,8,12 ; two_gpus.sh vllm 2,4,8,12
. "$(dirname "$0")/common.sh"
dir=/tmp/models/qwen3moe
case "${1:-}" in
  tests) bash "$(dirname "$0")/gpu_tests.sh" tests/test_tensor_parallel.py ;;
  deadpeer) timeout 280 python3 benchmarks/check_nccl_dead_peer.py --output-json "$OUT/$D-nccl-dead-peer-$C-${G}x2.json" ;;
  allreduce) nvidia-smi topo -m > "$OUT/$D-gpu-topology-${G}x2.txt"
    timeout 280 python3 benchmarks/check_captured_allreduce.py --world-size 2 \
      --output-json "$OUT/$D-captured-allreduce-$C-${G}x2.json"
    NCCL_P2P_DISABLE=1 timeout 280 python3 benchmarks/check_captured_allreduce.py --world-size 2 \
      --output-json "$OUT/$D-captured-allreduce-p2p-off-$C-${G}x2.json" ;;
  rimuru|vllm)
    [ -f $dir/config.json ] || python3 benchmarks/model_folder.py qwen3-30b-a3b $dir || exit 1
    common=(--model $dir --load-format dummy --client vllm --vllm-site "$VLLM_SITE" --dataset-path "$ANCHOR/sharegpt.json"
      --num-prompts 400 --time-budget-s 570)
    if [ "$1" = rimuru ]; then
      configs=${2:?CONFIGS}; rates=${3:?RATES}; label=uniform; extra="--tensor-parallel-size 2"
      if [ "${ROUTING:-uniform}" = zipf ]; then label=zipf1.0; extra="$extra --dummy-routing zipf:1.0"; fi
      timeout 580 $SWEEP "${common[@]}" --gpu-memory-budget 32GiB --rimuru-args="$extra" --configs "$configs" \
        --rates "$rates" --label "$label" \
        --output-json "$OUT/$D-serve-qwen3-2x32gib-tp2-$label-${configs//,/-}-${rates//,/-}rps-$C-${G}x2.json"
    else
      rates=${2:?RATES}
      timeout 580 $SWEEP "${common[@]}" --gpu-memory-budget 32GiB --define "vllm-tp2=vllm:--tensor-parallel-size 2" \
        --configs vllm-tp2 --rates "$rates" --label uniform \
        --output-json "$OUT/$D-serve-qwen3-2x32gib-tp2-uniform-vllm-${rates//,/-}rps-${G}x2.json"
    fi ;;
  *) echo "usage: two_gpus.sh tests | allreduce | deadpeer | rimuru CONFIGS RATES | vllm RATES" >&2; exit 2 ;;
esac
