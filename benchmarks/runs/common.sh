# Sourced by every run script: where results go and what they are stamped with.
#   OUT            results folder (default ./gpu-out)
#   RIMURU_COMMIT  the commit of the tree that runs (default: git's HEAD); file names carry its first 7 digits
#   file names also carry the card (G: h100, h200, ...), read from nvidia-smi
#   VLLM_SITE      where vLLM 0.26 is installed (a PYTHONPATH entry; default /tmp/site)
#   ANCHOR         the Qwen1.5-MoE model folder and ShareGPT JSON vLLM's client reads (default /tmp/anchor)
set -u
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
RIMURU_COMMIT=${RIMURU_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}; export RIMURU_COMMIT
C=${RIMURU_COMMIT:0:7}
D=$(date -u +%F)
# The card, as file names carry it (h100, h200): the same run on another card is another result, never a repeat.
G=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h100|h200|a100|l40s' | head -1 \
  | tr 'A-Z' 'a-z'); G=${G:-gpu}
VLLM_SITE=${VLLM_SITE:-/tmp/site}
ANCHOR=${ANCHOR:-/tmp/anchor}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SWEEP=${SWEEP:-python3 benchmarks/serve_sweep.py}  # (echo: print the commands only)
