#!/usr/bin/env bash
# The GPU tests in groups that each end inside one 10-minute command:
#   gpu_tests.sh kernels   the kernel files, 14 xdist workers (~1.5 min)
#   gpu_tests.sh engines K/N   the K-th of N shares of every other file with GPU tests, one engine at a time
#                              (the whole of them takes ~10 min: N = 3 leaves each share room)
#   gpu_tests.sh FILE...   the GPU tests of these files
# Log: $OUT/<date>-gpu-tests-<group>-<commit>-h200.log, the commit and the command on its first lines.
. "$(dirname "$0")/common.sh"
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
log=$OUT/$D-gpu-tests-$group-$C-h200.log
cmd="python3 -m pytest -p no:cacheprovider -m gpu -rs $workers $files"
{ echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $D, commit $RIMURU_COMMIT"; echo "# $cmd"; } > "$log"
timeout 560 $cmd 2>&1 | tee -a "$log" | tail -25
