#!/usr/bin/env bash
# Trace2Env evaluation tables on held-out BFCL multi-turn and τ²-bench traces (issue 9, "one evaluation table").
# Per benchmark (bfcl, airline, retail, telecom):
#   1. record gold replays, train and test split   python -m envace.data record-traces ...   (skipped when present)
#   2. build a worldbook from the train split      python -m trace2env build ...      (skipped when present)
#   3. model-free systems on ALL held-out traces   python -m trace2env eval ... --systems evidence,rules
#   4. with an endpoint: every system (+ the judge) on the first --subset held-out traces
#      python -m trace2env eval ... --systems evidence,rules,direct,trace_rag,worldbook_prompt,harness_only
# Usage:
#   scripts/eval_trace2env_table.sh --out DIR [--benchmarks bfcl,airline,retail,telecom] [--bfcl-max-tasks 30]
#       [--serve MODEL_DIR | --base-url URL --model NAME] [--judge-base-url URL --judge-model NAME]
#       [--subset 5 | --subset-lines 3,7] [--max-tokens N] [--repair-rounds N] [--max-payload-chars N] [--no-det] [--n-boot 10000]
# --serve starts `transformers serve MODEL_DIR` (envace.eval.tfserve) on 127.0.0.1, niced, and stops it on exit; it is
# then both the systems' model and the judge unless --judge-* is given. --subset-lines picks the held-out traces of
# step 4 by line number of the test JSONL (1-based) instead of the first --subset. --max-tokens caps every completion (no doubling
# on truncation), --repair-rounds N sets the provider's repair rounds (default 2) and --max-payload-chars N the
# characters of JSON payload sent (default 60000; the middle is cut) (`python -m trace2env eval`'s flags of the same names). --no-det skips step 3. Output: DIR/<bench>/{traces,book}, DIR/tables/
# <bench>.{det,llm}.{txt,json}, and all tables on stdout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ME="eval_trace2env_table.sh"
die() { echo "$ME: $*" >&2; exit 2; }

# Arguments are checked before anything is installed or written (the project's CLI convention, docs/cli.md).
OUT="" BENCH="bfcl,airline,retail,telecom" BFCL_MAX=30 SERVE="" BASE="" MODEL="" JBASE="" JMODEL="" SUBSET=5
MAXTOK="" REPAIR="" PAYLOAD="" LINES="" NBOOT=10000 DET=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --no-det) DET=0; shift; continue ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    --out|--benchmarks|--bfcl-max-tasks|--serve|--base-url|--model|--judge-base-url|--judge-model|--subset|\
    --subset-lines|--max-tokens|--repair-rounds|--max-payload-chars|--n-boot)
      [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || die "$1 needs a value (see --help)" ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  case "$1" in
    --out) OUT="$2" ;;
    --benchmarks) BENCH="$2" ;;
    --bfcl-max-tasks) BFCL_MAX="$2" ;;
    --serve) SERVE="$2" ;;
    --base-url) BASE="$2" ;;
    --model) MODEL="$2" ;;
    --judge-base-url) JBASE="$2" ;;
    --judge-model) JMODEL="$2" ;;
    --subset) SUBSET="$2" ;;
    --subset-lines) LINES="$2" ;;
    --max-tokens) MAXTOK="$2" ;;
    --repair-rounds) REPAIR="$2" ;;
    --max-payload-chars) PAYLOAD="$2" ;;
    --n-boot) NBOOT="$2" ;;
  esac
  shift 2
done
for v in "--bfcl-max-tasks=$BFCL_MAX" "--subset=$SUBSET" "--n-boot=$NBOOT" "--max-tokens=$MAXTOK" \
    "--max-payload-chars=$PAYLOAD"; do
  [[ -z "${v#*=}" || "${v#*=}" =~ ^[1-9][0-9]*$ ]] || die "${v%%=*}: expected an integer >= 1, got '${v#*=}'"
done
[[ -z "$REPAIR" || "$REPAIR" =~ ^[0-9]+$ ]] || die "--repair-rounds: expected an integer >= 0, got '$REPAIR'"
[[ -z "$LINES" || "$LINES" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] ||
  die "--subset-lines: expected line numbers separated by commas, got '$LINES'"
for b in ${BENCH//,/ }; do
  case "$b" in bfcl|airline|retail|telecom) ;; *) die "--benchmarks: unknown benchmark $b (bfcl, airline, retail, telecom)" ;; esac
done
[[ -n "$OUT" ]] || die "--out is required (see --help)"
[[ ! -e "$OUT" || -d "$OUT" ]] || die "--out $OUT is not a directory"
[[ -z "$SERVE" || -z "$BASE" ]] || die "--serve or --base-url, not both"
[[ -z "$BASE$MODEL" || ( -n "$BASE" && -n "$MODEL" ) ]] || die "--base-url and --model go together"
[[ -z "$SERVE" || -d "$SERVE" ]] || die "--serve $SERVE is not a directory"

# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"   # the project's virtualenv (created on first use); exports PY
mkdir -p "$OUT/tables"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

SERVER_PID=""
stop_server() { [[ -z "$SERVER_PID" ]] || { kill -TERM -- "-$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; }; }
trap stop_server EXIT
if [[ -n "$SERVE" ]]; then
  port="$("$PY" -c 'from envace.eval.server import free_port; print(free_port())')"
  # transformers serve answers /v1/models from the HF hub cache and fails without one: give it an empty one
  hub="${HF_HUB_CACHE:-$HOME/.cache/huggingface/hub}"; [[ -d "$hub" ]] || hub="$(mktemp -d "$OUT/hf-hub.XXXX")"
  HF_HUB_CACHE="$hub" setsid nice -n 19 "$PY" -m envace.eval.tfserve serve "$SERVE" --host 127.0.0.1 --port "$port" \
    --log-level warning > "$OUT/server.log" 2>&1 &
  SERVER_PID=$!
  BASE="http://127.0.0.1:$port/v1" MODEL="$SERVE"
  "$PY" -c 'import sys; from envace.eval.server import wait_for_models; wait_for_models(sys.argv[1], timeout=900)' "$BASE" \
    || { echo "server did not start; log:" >&2; tail -20 "$OUT/server.log" >&2; exit 1; }
  echo "server ready at $BASE (pid $SERVER_PID, $SERVE)" >&2
fi
if [[ -n "$BASE" && -z "$JBASE" ]]; then JBASE="$BASE" JMODEL="$MODEL"; fi

CFG=()  # provider limits, passed to python -m trace2env eval
[[ -z "$MAXTOK" ]] || CFG+=(--max-tokens "$MAXTOK")
[[ -z "$REPAIR" ]] || CFG+=(--repair-rounds "$REPAIR")
[[ -z "$PAYLOAD" ]] || CFG+=(--max-payload-chars "$PAYLOAD")

IFS=, read -r -a BENCHES <<< "$BENCH"
for b in "${BENCHES[@]}"; do
  case "$b" in
    bfcl) KW=() POOL=(--pool bfcl_multi_turn --max-tasks "$BFCL_MAX") ;;
    airline|retail|telecom) KW=(--pool-kwargs "{\"tau2\": {\"domains\": [\"$b\"]}}") POOL=(--pool tau2) ;;
    *) echo "eval_trace2env_table.sh: unknown benchmark $b (bfcl, airline, retail, telecom)" >&2; exit 2 ;;
  esac
  d="$OUT/$b"; mkdir -p "$d/traces"
  for split in train test; do
    [[ -s "$d/traces/$split.jsonl" ]] || "$PY" -m envace.data ${KW[@]+"${KW[@]}"} record-traces "${POOL[@]}" \
      --split "$split" --out "$d/traces/$split.jsonl"
  done
  [[ -d "$d/book" ]] || "$PY" -m trace2env build "$d/traces/train.jsonl" --out "$d/book" --environment-id "$b" >&2
  n_test="$(wc -l < "$d/traces/test.jsonl")"
  if [[ "$DET" == 1 ]]; then
  echo "== $b: model-free systems, every held-out trace ($n_test recorded; identical traces count once), worldbook from $(wc -l < "$d/traces/train.jsonl") recorded train traces"
  "$PY" -m trace2env eval "$d/book" "$d/traces/test.jsonl" --systems evidence,rules --n-boot "$NBOOT" \
    --out "$OUT/tables/$b.det.json" | tee "$OUT/tables/$b.det.txt"
  fi
  if [[ -n "$BASE" ]]; then
    if [[ -n "$LINES" ]]; then
      awk -v L="$LINES" 'BEGIN { n = split(L, a, ","); for (i = 1; i <= n; i++) keep[a[i]] = 1 } (NR in keep)' \
        "$d/traces/test.jsonl" > "$d/traces/test_subset.jsonl"
      which="held-out trace line(s) $LINES"
    else
      head -n "$SUBSET" "$d/traces/test.jsonl" > "$d/traces/test_subset.jsonl"
      which="first $SUBSET held-out trace(s)"
    fi
    echo "== $b: every system + judge, $which; model $MODEL at $BASE, judge $JMODEL at $JBASE${CFG[*]+${CFG[*]:+; provider limits: ${CFG[*]}}}"
    "$PY" -m trace2env eval "$d/book" "$d/traces/test_subset.jsonl" \
      --systems evidence,rules,direct,trace_rag,worldbook_prompt,harness_only ${CFG[@]+"${CFG[@]}"} \
      --base-url "$BASE" --model "$MODEL" --judge-base-url "$JBASE" --judge-model "$JMODEL" --n-boot "$NBOOT" \
      --out "$OUT/tables/$b.llm.json" 2> "$OUT/tables/$b.llm.usage.txt" | tee "$OUT/tables/$b.llm.txt"
    grep -h usage "$OUT/tables/$b.llm.usage.txt" | sed 's/^/  /' || true
  fi
done
