#!/usr/bin/env bash
# A user's first install, checked end to end: a new virtual env in a temporary directory, the CPU build of torch,
# `pip install .` with no extras (so no Triton, no server, no benchmark packages), then the API import,
# `rimuru make-tiny-model`, `rimuru generate` and `LLM.chat` on it, and the one-line message of a subcommand whose
# extra is missing. About 80 s on a 2-core machine with pip's cache warm, most of it pip.
# The source is copied out first, so the build writes nothing into this working tree.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
py="${PY:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

mkdir "$work/src"
# what git would commit (tracked files that exist, untracked ones that are not ignored): no venv, no build output
(cd "$repo" && git ls-files -co --exclude-standard | while IFS= read -r f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
    | tar -cf - --null -T -) | tar -xf - -C "$work/src"

"$py" -m venv "$work/venv"
bin="$work/venv/bin"
# torch first and pinned: the CPU build lies on local disk; left to `torch>=2.11`, pip would pull a CUDA build
"$bin/pip" install -q torch==2.13.0
"$bin/pip" install -q "$work/src"

cd "$work"  # away from the source: what imports is the installed package
"$bin/python" - <<'PY'
import importlib.util

assert importlib.util.find_spec("triton") is None, "triton came with a plain install"
from rimuru import LLM, SamplingParams  # noqa: F401

print("fresh install: `from rimuru import LLM` works without triton")
PY
"$bin/rimuru" make-tiny-model "$work/tiny"
"$bin/rimuru" generate "$work/tiny" --prompt "Hello" --max-tokens 8 > "$work/generate.out" 2> "$work/generate.err" \
    || { cat "$work/generate.out" "$work/generate.err"; exit 1; }
grep -q "\[length, 8 tokens\]" "$work/generate.out" || { cat "$work/generate.out"; exit 1; }
echo "fresh install: rimuru generate produced 8 tokens"
"$bin/python" - "$work/tiny" <<'PY'
import sys

from rimuru import LLM, SamplingParams

llm = LLM(sys.argv[1])
[out] = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4, temperature=0.0))
assert out.prompt.endswith("<|im_start|>assistant\n") and out.outputs[0].token_ids, out
llm.shutdown()
print("fresh install: LLM.chat renders the chat template")
PY

# without the bench extra, a ShareGPT simulation ends with one line naming the extra, not a traceback
if "$bin/rimuru" simulate --model qwen1.5-moe-a2.7b --gpu-memory-budget 32GiB --dataset sharegpt \
        --num-prompts 10 --sweep-rates "" > "$work/sim.out" 2>&1; then
    echo "rimuru simulate --dataset sharegpt ran without the bench extra"; exit 1
fi
if grep -q Traceback "$work/sim.out" || ! grep -q "pip install 'rimuru\[bench\]'" "$work/sim.out"; then
    cat "$work/sim.out"; exit 1
fi
echo "fresh install: rimuru simulate --dataset sharegpt names the missing extra"
