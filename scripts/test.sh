#!/usr/bin/env bash
# Run the test suite (CPU). Creates/updates the project virtualenv first (scripts/bootstrap.sh).
#   scripts/test.sh                 # everything that runs on CPU, end-to-end training included
#   scripts/test.sh -m "not slow"   # skip the end-to-end trainer runs
#   scripts/test.sh tests/envsched  # any pytest arguments
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 LITELLM_LOCAL_MODEL_COST_MAP=True
exec "$PY" -m pytest "$@"
