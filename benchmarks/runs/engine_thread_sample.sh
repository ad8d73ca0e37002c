#!/usr/bin/env bash
# Runs a benchmark command and samples the engine thread of every Rimuru server it starts with py-spy
# (https://github.com/benfred/py-spy): once a server answers /health, SAMPLE_AFTER_S later (default 20: past the
# warm-up prompts), SAMPLE_S seconds (default 60) at SAMPLE_HZ (default 200) of every thread's stack, native frames
# included (GIL and CUDA waits show as libpython / libcuda frames). Each server's samples go to
#   $OUT/$D-pyspy-<n>-<offload mode>-$C-$G.txt      (py-spy's raw format: one collapsed stack a line)
# and benchmarks/engine_thread_profile.py summarises them. py-spy must be on PATH (its wheel installs a binary).
#   engine_thread_sample.sh bash benchmarks/runs/prefix_caching.sh multiturn rimuru
. "$(dirname "$0")/common.sh"
[ $# -ge 1 ] || { echo "usage: engine_thread_sample.sh COMMAND..." >&2; exit 2; }
command -v py-spy >/dev/null || { echo "py-spy is not on PATH" >&2; exit 2; }
after=${SAMPLE_AFTER_S:-20}; seconds=${SAMPLE_S:-60}; hz=${SAMPLE_HZ:-200}

watch_servers() {
  local seen=" " n=0 pid args port mode
  while true; do
    for pid in $(pgrep -f "rimuru.cli serve" || true); do
      case "$seen" in *" $pid "*) continue ;; esac
      seen="$seen$pid "
      args=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null) || continue
      port=$(sed -n 's/.*--port \([0-9]*\).*/\1/p' <<< "$args")
      mode=$(sed -n 's/.*--offload-mode \([a-z]*\).*/\1/p' <<< "$args")
      n=$((n + 1))
      (
        until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
            >/dev/null 2>&1; do
          kill -0 "$pid" 2>/dev/null || exit 0; sleep 1
        done
        sleep "$after"
        py-spy record --pid "$pid" --rate "$hz" --duration "$seconds" --threads --idle --native --format raw \
          --output "$OUT/$D-pyspy-$n-${mode:-static}-$C-$G.txt" > "$OUT/$D-pyspy-$n-${mode:-static}-$C-$G.log" 2>&1
      ) &
    done
    sleep 1
  done
}

watch_servers &
watcher=$!
"$@"
rc=$?
kill "$watcher" 2>/dev/null
wait 2>/dev/null
exit $rc
