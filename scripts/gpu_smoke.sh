#!/usr/bin/env bash
# GPU smoke test on one GPU (about 10 minutes) with a small local Qwen3 checkpoint (0.6B-1.7B):
#   scripts/gpu_smoke.sh /models/Qwen3-1.7B [--out outputs/gpu_smoke]
# Imports, verl's CUDA platform (driver and Ray actor), the paper recipe shrunk to 1 GPU for 2 steps with a
# checkpoint, a resume to step 3, rollout/trainer agreement, turns, tool calls, rewards, finite losses, vLLM
# sleep and decode speed, peak memory of a 24k-token update; one summary table (envace/gpu_smoke.py).
# Without a CUDA GPU it checks the checkpoint and the recipe, then stops with exit status 3.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m envace.gpu_smoke "$@"
