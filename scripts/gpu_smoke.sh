#!/usr/bin/env bash
# GPU smoke test on one GPU or more with a small local Qwen3 checkpoint (0.6B-1.7B):
#   scripts/gpu_smoke.sh /models/Qwen3-1.7B [--out outputs/gpu_smoke]
# Imports, verl's CUDA platform (driver and Ray actor), the paper recipe shrunk to 1 GPU for 2 steps at lr 1e-5 with
# a validation pass and a checkpoint, a resume to step 3 (with 2+ GPUs also one step at tensor-parallel 2), the
# weight sync after every update (rollout/trainer probability difference and correlation), turns, tool calls,
# rewards, finite losses, verl's peak memory against the GPU's, vLLM sleep and decode speed, peak memory of a
# 24k-token update; one summary table (envace/gpu_smoke.py), exit 1 on any failure. Never run here on a GPU: the
# thresholds are set from CPU runs and the reasoning in envace/gpu_smoke.py, not from a GPU measurement.
# Without a CUDA GPU it checks the checkpoint and the recipe, then stops with exit status 3.
# The arguments and MODEL's config.json are checked first, with the system python3 (the pre-check imports only the
# standard library), so --help and a usage mistake answer at once (one line, exit 2), before bootstrap.sh installs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SYS_PY="${ENVACE_PYTHON:-python3}"
command -v "$SYS_PY" >/dev/null ||
  { echo "scripts/gpu_smoke.sh: error: ENVACE_PYTHON=$SYS_PY is not a Python interpreter on PATH" >&2; exit 2; }
for arg in "$@"; do
  case "$arg" in -h|--help) exec "$SYS_PY" -m envace.gpu_smoke --help ;; esac
done
"$SYS_PY" -m envace.gpu_smoke --preflight "$@"
# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m envace.gpu_smoke "$@"
