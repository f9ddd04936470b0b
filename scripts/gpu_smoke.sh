#!/usr/bin/env bash
# GPU smoke test of a recipe (envace/gpu_smoke.py; docs/gpu.md, "Checking one GPU node"):
#   scripts/gpu_smoke.sh MODEL [--recipe NAME] [--out DIR]     # one node: the recipe, two steps, resume, memory
#   scripts/gpu_smoke.sh MODEL --nodes N [--recipe NAME] --out SHARED_DIR   # the head of an N-node cluster
# One node trains the recipe (default envace_qwen3_8b_h20_2x8) with its own memory settings, token budgets and
# tensor-parallel size, shrunk only to this node's GPUs, a small batch and 2 steps (+ a resumed third), and names each
# change; it checks the weight sync after an update at the recipe's tensor-parallel size, the run's metrics, vLLM's
# sleep, and the peak memory of one update at the recipe's token budget against the GPU's; one summary table, exit 1
# on any failure, within the bound of its stages' time-outs (gpu_smoke.TIME_BOUND_S). --nodes N starts a
# token-authenticated Ray head (MASTER_ADDR, RAY_PORT, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, as scripts/train.sh
# reads them); the other nodes run the real run's worker command, NNODES=N NODE_RANK=k MASTER_ADDR=...
# scripts/train.sh; it checks token authentication, shared storage and an NCCL all-reduce across the nodes.
# Without a CUDA GPU it stops before the GPU checks with exit status 3.
# The arguments, the recipe's name, the cluster's variables and MODEL's config.json are checked first, with the
# system python3 (the pre-check imports only the standard library), so --help and a usage mistake answer at once
# (one line, exit 2), before bootstrap.sh installs.
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
# the node pre-flight scripts/train.sh runs: a driver too old for the installed torch's CUDA build, or no C compiler or
# Python headers for Triton, stops here with its one-line fix (exit 2) instead of failing a row later
"$PY" -m envace.launch cuda-check
"$PY" -m envace.launch build-check
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m envace.gpu_smoke "$@"
