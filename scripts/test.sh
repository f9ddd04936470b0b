#!/usr/bin/env bash
# Run the test suite (CPU). Creates/updates the project virtualenv first (scripts/bootstrap.sh).
#   scripts/test.sh                 # everything on CPU but the `extended` tests, trainer runs included (CI)
#   scripts/test.sh -m "not slow"   # skip the end-to-end trainer runs
#   scripts/test.sh tests/envsched  # any pytest arguments
#   scripts/test.sh --extended      # the tests marked `extended` too (second opinions CI leaves out: docs/testing.md)
#   scripts/test.sh --cov [--cov-files] -m "not slow"
#                                   # line coverage of envace, envsched, trace2env and envllm (pytest-cov), then a
#                                   # per-package table (scripts/coverage_table.py; --cov-files: per file too)
# Tests not marked `slow` run on ENVACE_TEST_WORKERS pytest-xdist processes (default: the machine's CPUs, at most
# 4; 1 runs them in this process). The `slow` ones (trainer, server and evaluation runs of minutes, about half of
# their time waiting on start-ups and servers) run after them on ENVACE_SLOW_WORKERS processes (default: 2 where the
# machine has 2 CPUs and 32 GiB of memory, else 1), each trainer rank on ENVACE_TRAINER_THREADS torch threads
# (default: the CPUs over twice the slow workers, at least 1: two torch threads sharing a core with another run
# stall). Two slow workers take a test file each (`--dist loadfile`: a file's runs share its module fixtures). One
# slow worker runs the `heavy` ones (a whole trainer or a vLLM engine: GiBs each, so one at a time) in one pytest
# and, once the warm start is built, the other slow ones beside them in a second pytest, whose output follows. Without `-m`, both sets run, in that
# order; `-m EXPR` runs one pytest over EXPR (on the workers when EXPR is "not slow" or "slow"); `-n` given
# explicitly is passed as it is. Tests marked `extended` are left out of every set unless --extended is given, and the
# command ends with a line counting them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 LITELLM_LOCAL_MODEL_COST_MAP=True
# bytecode caches on: every pytest session (and each xdist worker) rewrites the test modules' asserts and every CLI
# test's subprocess compiles the project's modules, each time again where PYTHONDONTWRITEBYTECODE is set
unset PYTHONDONTWRITEBYTECODE
cpus="$("$PY" -c 'import os; print(len(os.sched_getaffinity(0)))')"
workers="${ENVACE_TEST_WORKERS:-$(( cpus < 4 ? cpus : 4 ))}"
# a slow worker runs a whole trainer with its rollout engine: one with vLLM's CPU engine peaked at 11.5 GiB, and two
# side by side were killed by Ray's out-of-memory monitor on a 24 GiB machine, so a second worker needs 32 GiB
mem_gib="$(awk '/^MemTotal:/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 0)"
slow_workers="${ENVACE_SLOW_WORKERS:-$(( cpus >= 2 && mem_gib >= 32 ? 2 : 1 ))}"
for v in "ENVACE_TEST_WORKERS=$workers" "ENVACE_SLOW_WORKERS=$slow_workers"; do
  [[ "${v#*=}" =~ ^[1-9][0-9]*$ ]] ||
    { echo "envace: ${v%%=*} must be a positive integer (got '${v#*=}')" >&2; exit 2; }
done
args=() cov=0 cov_files="" marker="" has_n=0 extended=0
while (($#)); do
  case "$1" in
    --extended) extended=1 ;;
    --cov) cov=1 ;;
    --cov-files) cov=1 cov_files="--files" ;;
    -m) [[ $# -ge 2 ]] || { echo "envace: -m needs a marker expression" >&2; exit 2; }; marker="$2"; shift ;;
    -m*) marker="${1#-m}" ;;
    -n|--numprocesses|-n*|--numprocesses=*) has_n=1; args+=("$1") ;;
    *) args+=("$1") ;;
  esac
  shift
done
covdir=""
if [[ $cov == 1 ]]; then
  covdir="$(mktemp -d)"
  export COVERAGE_FILE="$covdir/.coverage"
fi
# EXPR restricted to the tier: "(EXPR) and not extended" unless --extended (EXPR empty: "not extended")
tier() {
  if [[ $extended == 1 ]]; then echo "$1"; else echo "${1:+($1) and }not extended"; fi
}
# one pytest over MARKER; the first run of a coverage session starts the data file, later ones append to it
cov_started=0
run() {
  local expr="$1" extra=()
  if [[ $has_n == 0 && "$expr" == "not slow" && $workers -gt 1 ]]; then extra+=(-n "$workers"); fi
  if [[ $has_n == 0 && "$expr" == "slow" && $slow_workers -gt 1 ]]; then
    extra+=(-n "$slow_workers" --dist loadfile)
    local threads=$(( cpus / (2 * slow_workers) ))
    export ENVACE_TRAINER_THREADS="${ENVACE_TRAINER_THREADS:-$(( threads > 0 ? threads : 1 ))}"
  fi
  if [[ $cov == 1 ]]; then
    extra+=(--cov=envace --cov=envsched --cov=trace2env --cov=envllm --cov-report=)
    [[ $cov_started == 0 ]] || extra+=(--cov-append)
    cov_started=1
  fi
  if [[ $has_n == 0 && "$expr" == "slow" && $slow_workers == 1 && $cov == 0 ]]; then
    run_beside "${extra[@]}"
    return
  fi
  local sel
  sel="$(tier "$expr")"
  [[ -z "$sel" ]] || extra+=(-m "$sel")
  "$PY" -m pytest "${extra[@]}" "${args[@]}"
}
# the slow tests on one worker: the heavy ones one after another, the light ones in a second pytest beside them
# (their output after the heavy ones'); the exit status of the pair as of one pytest (5 only when neither selected
# anything). The light ones start when the heavy session touches $ENVACE_TEST_GATE (tests/envace/conftest.py: once
# the warm start is built, whose two torch threads stall beside any other process) or ends, whichever comes first.
light_pid="" heavy_pid=""
trap 'for p in $light_pid $heavy_pid; do kill "$p" 2>/dev/null || true; done; [[ -z "$covdir" ]] || rm -rf "$covdir"' EXIT
run_beside() {
  local log gate heavy=0 light=0
  log="$(mktemp)" gate="$(mktemp -u)"
  ENVACE_TEST_GATE="$gate" "$PY" -m pytest "$@" -m "$(tier "slow and heavy")" "${args[@]}" &
  heavy_pid=$!
  while [[ ! -e "$gate" ]] && kill -0 "$heavy_pid" 2>/dev/null; do sleep 1; done
  "$PY" -m pytest "$@" -m "$(tier "slow and not heavy")" "${args[@]}" >"$log" 2>&1 &
  light_pid=$!
  wait "$heavy_pid" || heavy=$?
  heavy_pid=""
  wait "$light_pid" || light=$?
  light_pid=""
  rm -f "$gate"
  echo "===== the slow tests not marked heavy, run beside the heavy ones ====="
  cat "$log"
  rm -f "$log"
  if [[ $heavy == 5 && $light == 5 ]]; then return 5
  elif [[ $heavy != 0 && $heavy != 5 ]]; then return $heavy
  elif [[ $light != 0 && $light != 5 ]]; then return $light
  fi
  return 0
}
rc=0
if [[ -n "$marker" ]]; then
  run "$marker" || rc=$?
else
  # pytest's exit code 5 = nothing selected (e.g. paths with no slow tests): not a failure when the other set ran
  fast=0 slow=0
  run "not slow" || fast=$?
  run "slow" || slow=$?
  if [[ $fast == 5 && $slow == 5 ]]; then rc=5
  elif [[ $fast != 0 && $fast != 5 ]]; then rc=$fast
  elif [[ $slow != 0 && $slow != 5 ]]; then rc=$slow
  fi
fi
[[ $cov == 0 ]] || "$PY" "$ROOT/scripts/coverage_table.py" "$COVERAGE_FILE" $cov_files
# nothing left out silently: the selection's tests marked `extended`, counted (pytest's "[N/]M tests collected")
if [[ $extended == 0 ]]; then
  left="$("$PY" -m pytest --collect-only -m "${marker:+($marker) and }extended" "${args[@]}" -n 0 --verbosity=-1 \
          2>/dev/null |
          sed -n 's#^\([0-9][0-9]*\)\(/[0-9]*\)\{0,1\} tests\{0,1\} collected.*#\1#p' | tail -1 || true)"
  [[ -z "$left" ]] || echo "envace: $left test$([[ $left == 1 ]] || echo s) marked extended not run" \
    "(scripts/test.sh --extended runs them; docs/testing.md)"
fi
exit $rc
