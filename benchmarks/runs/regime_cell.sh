#!/usr/bin/env bash
# One cell of the regime map (docs/benchmarks.md section 10): configurations at rates, 400 ShareGPT requests a point
# (NP to change), our client, dummy weights.
#   regime_cell.sh CELL CONFIGS RATES
#   CELL     qwen3-59gib-zipf | qwen3-59gib-uniform | qwen3-62gib-zipf | qwen3-48gib-zipf | qwen1.5-32gib-uniform
#   CONFIGS  comma separated: static, elastic (the defaults), elastic-slo (TTFT p99 2 s, TPOT p99 50 ms), fixedN (N
#            experts of each layer resident: in a zipf cell the N most popular, by the router's ranking), vllm
#            (vLLM 0.26 at the same budget, uniform cells only: it has no skewed router; installed under VLLM_SITE)
#   RATES    comma separated req/s
# e.g. regime_cell.sh qwen3-62gib-zipf static,elastic-slo 8,10,12
#      RANKING=profile regime_cell.sh qwen3-59gib-zipf fixed126 8,12,16   (fixed ranked by a measured profile)
#      RANKING=profile PROFILE=ranking.json regime_cell.sh ...             (by a profile measured before)
# SWEEP_ARGS adds serve_sweep flags: a point longer than one command (the 48 GiB cell at 1 req/s: 400 s of arrivals
# after a start of minutes) takes two calls, one configuration each: SWEEP_ARGS=--detach (starts the server, measures
# nothing), then the same command with SWEEP_ARGS=--attach (measures on it and stops it).
. "$(dirname "$0")/common.sh"
cell=${1:?CELL}; configs=${2:?CONFIGS}; rates=${3:?RATES}
case "$cell" in
  qwen3-*) model=qwen3-30b-a3b ;;
  qwen1.5-*) model=qwen1.5-moe-a2.7b ;;
  *) echo "unknown cell $cell" >&2; exit 2 ;;
esac
budget=$(echo "$cell" | sed -E 's/^[^-]+-([0-9]+)gib-.*/\1/')GiB
routing=${cell##*-}
vllm=()
if [[ ",$configs," == *,vllm,* ]]; then
  if [ "$routing" != uniform ]; then echo "vLLM has no skewed router: its rows are uniform only ($cell)" >&2; exit 2; fi
  # vLLM reads a model folder (config and tokenizer; weights made up at start), which Rimuru's rows read too
  dir=/tmp/models/$model
  [ -f $dir/config.json ] || python3 benchmarks/model_folder.py $model $dir || exit 1
  model=$dir; vllm=(--vllm-site "$VLLM_SITE")
fi
args=(); label=uniform
if [ "$routing" = zipf ]; then args=(--rimuru-args="--dummy-routing zipf:1.0"); label=zipf1.0; fi
# fixed splits keep the first N of each layer's ranking resident: under the skewed dummy router, by default the
# router's promised shares (benchmarks/dummy_ranking.py, no GPU time); RANKING=profile measures the ranking as a
# user of fixed mode would, `rimuru profile` on this cell's model and budget (static, eager, NP_PROFILE ShareGPT
# requests, greedy as the sweep's client): the shares the router realises, which differ from the promised ones
# expert by expert (docs/benchmarks.md section 10). The profile (~2 min for Qwen3 at 59 GiB, at most PROFILE_S)
# comes out of the sweep's TIMEOUT_S; it is kept in /tmp/regime-profiles, so a later call on the warm machine
# reuses it (an --attach call must: a second engine would not fit beside the detached server)
ranking=()
profile_s=0
if [ "$routing" = zipf ] && [[ ",$configs," == *,fixed[0-9]* ]]; then
  if [ "${RANKING:-promised}" = profile ]; then
    name="$D-profile-ranking-$model-$budget-zipf1.0-$C-$G.json"
    kept=/tmp/regime-profiles/$name
    # PROFILE=FILE: a ranking `rimuru profile` wrote earlier for this model, budget and routing (one a run committed
    # or carried), used instead of measuring one
    if [ -n "${PROFILE:-}" ]; then mkdir -p /tmp/regime-profiles && cp "$PROFILE" "$kept" || exit; fi
    if [ ! -s "$kept" ]; then
      if [[ " ${SWEEP_ARGS:-} " == *" --attach "* ]]; then
        echo "no profile $kept to attach with: run the --detach call first on this machine" >&2; exit 2
      fi
      mkdir -p /tmp/regime-profiles
      start=$SECONDS
      timeout "${PROFILE_S:-240}" python3 -m rimuru.cli profile $model --load-format dummy --dummy-routing zipf:1.0 \
        --gpu-memory-budget "$budget" --num-prompts "${NP_PROFILE:-200}" --max-tokens 128 --temperature 0 \
        --no-progress --output "$kept.tmp" && mv "$kept.tmp" "$kept" || exit
      profile_s=$((SECONDS - start))
    fi
    file="$OUT/$name"
    cp "$kept" "$file" || exit
  else
    file="$OUT/$D-ranking-$model-zipf1.0.json"
    python3 benchmarks/dummy_ranking.py --model $model --routing zipf:1.0 --output "$file" || exit
  fi
  ranking=(--expert-ranking "$file")
fi
defines=()
for c in ${configs//,/ }; do
  case "$c" in
    fixed[0-9]*) defines+=(--define "$c=rimuru:--offload-mode fixed --resident-experts ${c#fixed} ${ranking[*]}") ;;
  esac
done
# TIMEOUT_S (default 580) bounds the sweep, so that two cells can share one device command
t=$(( ${TIMEOUT_S:-580} - profile_s ))
timeout "$t" $SWEEP --model $model --gpu-memory-budget "$budget" "${args[@]}" "${vllm[@]}" "${defines[@]}" --configs "$configs" \
  --rates "$rates" --num-prompts "${NP:-400}" --label "$label" --time-budget-s $((t - 10)) ${SWEEP_ARGS:-} \
  --output-json "$OUT/$D-serve-$cell-${configs//,/-}-${rates//,/-}rps-$C-$G.json"
