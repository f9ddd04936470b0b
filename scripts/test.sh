#!/usr/bin/env bash
# Run the test suite (CPU). Creates/updates the project virtualenv first (scripts/bootstrap.sh).
#   scripts/test.sh                 # everything that runs on CPU, end-to-end training included
#   scripts/test.sh -m "not slow"   # skip the end-to-end trainer runs
#   scripts/test.sh tests/envsched  # any pytest arguments
#   scripts/test.sh --cov [--cov-files] -m "not slow"
#                                   # line coverage of envace, envsched and trace2env (pytest-cov), then a
#                                   # per-package table (scripts/coverage_table.py; --cov-files: per file too)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 LITELLM_LOCAL_MODEL_COST_MAP=True
args=() cov=0 cov_files=""
for a in "$@"; do
  case "$a" in
    --cov) cov=1 ;;
    --cov-files) cov=1 cov_files="--files" ;;
    *) args+=("$a") ;;
  esac
done
[[ $cov == 1 ]] || exec "$PY" -m pytest "${args[@]}"
covdir="$(mktemp -d)"
trap 'rm -rf "$covdir"' EXIT
rc=0
COVERAGE_FILE="$covdir/.coverage" "$PY" -m pytest --cov=envace --cov=envsched --cov=trace2env --cov-report= "${args[@]}" || rc=$?
"$PY" "$ROOT/scripts/coverage_table.py" "$covdir/.coverage" $cov_files
exit $rc
