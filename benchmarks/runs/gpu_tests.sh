#!/usr/bin/env bash
# The GPU tests in groups that each end inside one 10-minute command:
#   gpu_tests.sh kernels   the kernel files, 14 xdist workers (~1.5 min)
#   gpu_tests.sh engines K/N   the K-th of N shares of every other file with GPU tests, one engine at a time
#                              (the whole of them takes ~10 min: N = 3 leaves each share room)
#   gpu_tests.sh FILE...   the GPU tests of these files
# Log: $OUT/<date>-gpu-tests-<group>-<commit>-<card>.log, the commit and the command on its first lines.
# fla-core (FLA_SITE, default /tmp/hsite: where the device call installed it) goes on the path only for the files
# that need it (FLA_FILES). The others must run without it: with fla importable, transformers swaps fla's GPU-only
# kernels into the CPU reference models the tests compare against, which then fail on CPU tensors.
. "$(dirname "$0")/common.sh"
FLA_SITE=${FLA_SITE:-/tmp/hsite}
FLA_FILES="tests/test_fla_prefill.py tests/test_kernel_warmup.py"
KERNELS="tests/test_fused_moe.py tests/test_gated_delta_kernels.py tests/test_fused_small_kernels.py
  tests/test_paged_attention.py tests/test_fla_prefill.py tests/test_pass_fence.py tests/test_pool.py"
case "${1:-}" in
  kernels) group=kernels; files=$KERNELS; workers="-n 14" ;;
  engines) share=${2:-1/1}; k=${share%/*}; n=${share#*/}; group=engines-$k-of-$n; workers=""
    files=$(grep -l "mark.gpu" tests/*.py | grep -v -F "$(echo $KERNELS | tr ' ' '\n')" \
      | awk -v k="$k" -v n="$n" '(NR - 1) % n == k - 1' | tr '\n' ' ') ;;
  "") echo "usage: gpu_tests.sh kernels | engines K/N | FILE..." >&2; exit 2 ;;
  *) group=$(basename "${1%.py}" | sed 's/^test_//'); files="$*"; workers="" ;;
esac
log=$OUT/$D-gpu-tests-$group-$C-$G.log
with_fla=""; without_fla=""
for f in $files; do
  case " $FLA_FILES " in *" $f "*) with_fla="$with_fla $f" ;; *) without_fla="$without_fla $f" ;; esac
done
echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $D, commit $RIMURU_COMMIT" > "$log"
start=$(date +%s)
if [ -n "$without_fla" ]; then
  cmd="python3 -m pytest -p no:cacheprovider -m gpu -rs $workers $without_fla"
  echo "# $cmd" >> "$log"
  timeout 560 $cmd 2>&1 | tee -a "$log" | tail -25
fi
if [ -n "$with_fla" ]; then
  cmd="python3 -m pytest -p no:cacheprovider -m gpu -rs $workers $with_fla"
  echo "# PYTHONPATH=\$PYTHONPATH:$FLA_SITE $cmd" >> "$log"
  left=$((570 - $(date +%s) + start)); [ $left -gt 30 ] || left=30
  PYTHONPATH=$PYTHONPATH:$FLA_SITE timeout $left $cmd 2>&1 | tee -a "$log" | tail -25
fi
