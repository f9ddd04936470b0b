#!/usr/bin/env bash
# Train with envace on verl.
#
#   scripts/train.sh                                   # embedded CPU default (tiny Qwen3, BFCL, GRPO)
#   scripts/train.sh experiment=NAME key=value ...     # Hydra overrides (configs/experiment/NAME.yaml)
#
# Multi-node (one command per node; the head launches the job once all nodes have joined):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/train.sh experiment=...   # head
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 scripts/train.sh                  # worker: joins, then waits
# or, on an existing Ray cluster: RAY_ADDRESS=10.0.0.1:6379 scripts/train.sh experiment=...
#
# Environment: RAY_PORT (6379), GPUS_PER_NODE (auto: nvidia-smi, else 1 logical slot on CPU),
# RAY_NUM_CPUS (auto), RAY_STOP_ON_EXIT (1: the head stops the Ray cluster it started),
# RAY_AUTH_TOKEN (same value on every node: enables Ray token authentication; unset: off).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
RAY_PORT="${RAY_PORT:-6379}"

gpus_here() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi -L | wc -l
  else
    echo 1  # one logical device slot backed by CPU (the cpu platform)
  fi
}

if [[ "$NNODES" -gt 1 && -z "${RAY_ADDRESS:-}" ]]; then
  : "${MASTER_ADDR:?MASTER_ADDR (the head node address) is required when NNODES > 1}"
  # Ray token authentication: on with a shared RAY_AUTH_TOKEN (the same value on every node),
  # otherwise off, since each node would generate a different token of its own.
  if [[ -z "${RAY_AUTH_MODE:-}" ]]; then
    if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then export RAY_AUTH_MODE=token; else export RAY_AUTH_MODE=disabled; fi
  fi
  GPUS_PER_NODE="${GPUS_PER_NODE:-$(gpus_here)}"
  CPUS_ARG=()
  [[ -n "${RAY_NUM_CPUS:-}" ]] && CPUS_ARG=(--num-cpus="$RAY_NUM_CPUS")
  if [[ "$NODE_RANK" -eq 0 ]]; then
    echo "envace: starting Ray head on ${MASTER_ADDR}:${RAY_PORT} (${GPUS_PER_NODE} device slot(s))"
    "$PY" -m ray.scripts.scripts start --head --node-ip-address="$MASTER_ADDR" --port="$RAY_PORT" \
      --num-gpus="$GPUS_PER_NODE" "${CPUS_ARG[@]}" --disable-usage-stats
    if [[ "${RAY_STOP_ON_EXIT:-1}" == "1" ]]; then
      trap '"$PY" -m ray.scripts.scripts stop >/dev/null 2>&1 || true' EXIT
    fi
    export RAY_ADDRESS="${MASTER_ADDR}:${RAY_PORT}"
    "$PY" -m envace.launch wait-nodes --nodes "$NNODES" --timeout "${RAY_WAIT_NODES_TIMEOUT:-600}"
    exec_args=(trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" "$@")
    "$PY" -m envace.train "${exec_args[@]}"
    exit $?
  else
    echo "envace: node ${NODE_RANK} joining Ray head ${MASTER_ADDR}:${RAY_PORT} (${GPUS_PER_NODE} device slot(s))"
    "$PY" -m ray.scripts.scripts start --address="${MASTER_ADDR}:${RAY_PORT}" \
      --num-gpus="$GPUS_PER_NODE" "${CPUS_ARG[@]}" --block
    exit $?
  fi
fi

exec "$PY" -m envace.train "$@"
