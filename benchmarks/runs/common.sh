# Sourced by every run script: where results go and what they are stamped with.
#   OUT            results folder (default ./gpu-out)
#   RIMURU_COMMIT  the commit of the tree that runs (default: git's HEAD); file names carry its first 7 digits
#   VLLM_SITE      where vLLM 0.26 is installed (a PYTHONPATH entry; default /tmp/site)
#   ANCHOR         the Qwen1.5-MoE model folder and ShareGPT JSON vLLM's client reads (default /tmp/anchor)
set -u
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
RIMURU_COMMIT=${RIMURU_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}; export RIMURU_COMMIT
C=${RIMURU_COMMIT:0:7}
D=$(date -u +%F)
VLLM_SITE=${VLLM_SITE:-/tmp/site}
ANCHOR=${ANCHOR:-/tmp/anchor}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SWEEP=${SWEEP:-python3 benchmarks/serve_sweep.py}  # (echo: print the commands only)
