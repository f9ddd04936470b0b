#!/usr/bin/env bash
# Evaluate a model on τ²-bench: a thin wrapper around `python -m envace.eval tau2`.
# All arguments pass through; see `scripts/eval_tau2.sh --help`. Examples:
#   scripts/eval_tau2.sh --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B --out runs/q8b-tau2
#   scripts/eval_tau2.sh --checkpoint ckpt/step_470 --server vllm --concurrency 32
#   scripts/eval_tau2.sh --base-url ... --model ... --tts parallel --rehearsals 2   # test-time rehearsal (--tts none|parallel|sequential)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"   # the project's virtualenv (created on first use); exports PY
exec "$PY" -m envace.eval tau2 "$@"
