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
# Environment: RAY_PORT (6379), NODE_IP_ADDRESS (a worker's own address; default: its interface that routes to
# MASTER_ADDR), GPUS_PER_NODE (auto: the CUDA devices this node offers, honouring
# CUDA_VISIBLE_DEVICES and MIG; 1 logical slot without an NVIDIA driver), RAY_NUM_CPUS (auto),
# RAY_JOIN_TIMEOUT (600: how long a worker waits for its head, and the head for its workers),
# ENVACE_STARTUP_DEADLINE (10800: seconds a multi-node run may take to its first step line, i.e. to load, start
# vLLM and validate before training, 0: none), ENVACE_STEP_DEADLINE (7200: seconds each training step after it may
# take, 0: none); past either, or on a lost Ray node at once, the head stops the run: exit 3 with the node or the
# deadline and the checkpoint to relaunch from.
# Multi-node Ray is token-authenticated: RAY_AUTH_TOKEN (the same secret on every node) or
# RAY_AUTH_TOKEN_PATH (a file on shared storage: the head writes a new token there, the workers read it);
# RAY_AUTH_MODE=disabled opts out explicitly. Network interfaces: NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME,
# NCCL_IB_* set here reach every Ray worker of the job. Every node must see the model and
# trainer.default_local_dir at the same paths (shared storage); the head checks that before it builds anything and
# again before training. A multi-node run's generated data (data.*_files: auto, worldbook: auto) goes into
# trainer.default_local_dir; a builtin: model is built into the head's ENVACE_CACHE (default ~/.cache/envace): set it
# to shared storage, or give a model path.
# Single node: the job starts its own Ray cluster (never one an old `ray start` left behind).
#
# Pre-flight, before anything slow: the variables above are checked first, before the virtualenv is installed (a bad
# value exits 2 with one line naming it); then the config: python -m envace.train checks all of it before it builds
# data or models or starts Ray, and a multi-node head runs the same checks (--preflight-only) before it starts Ray
# and waits for its workers.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

env_error() {
  echo "scripts/train.sh: error: $*" >&2
  exit 2
}

# check_int NAME LOW [HIGH [NOTE]]: $NAME is a whole number in [LOW, HIGH], rewritten in plain decimal (08 -> 8)
check_int() {
  local value="${!1}" high="${3:-999999999}"
  if [[ ! "$value" =~ ^[0-9]{1,9}$ ]] || ((10#$value < $2 || 10#$value > high)); then
    env_error "$1='$value' must be a whole number from $2 to $high${4:+ ($4)}"
  fi
  printf -v "$1" '%d' "$((10#$value))"
}

# check_seconds NAME NOTE: $NAME is a finite number of seconds >= 0 (no unit, no sign, no NaN)
check_seconds() {
  local value="${!1}"
  [[ "$value" =~ ^([0-9]+[.]?[0-9]*|[.][0-9]+)$ ]] ||
    env_error "$1='$value' must be a number of seconds >= 0, such as 7200 or 0.5 ($2)"
}

# The variables a multi-node node reads (NNODES > 1 without RAY_ADDRESS), defaults filled in, and its Ray
# authentication (RAY_AUTH_MODE exported: token unless disabled, with a token source): all checked before anything
# is installed or started.
check_multinode_env() {
  [[ -n "${MASTER_ADDR:-}" ]] || env_error "MASTER_ADDR (the head node's address) is required when NNODES > 1"
  NODE_RANK="${NODE_RANK:-0}"
  check_int NODE_RANK 0 $((NNODES - 1)) "NNODES=$NNODES; 0 is the head"
  RAY_PORT="${RAY_PORT:-6379}"
  check_int RAY_PORT 1 65535
  [[ -z "${RAY_WAIT_NODES_TIMEOUT:-}" ]] || check_int RAY_WAIT_NODES_TIMEOUT 0 999999999 "seconds"
  RAY_JOIN_TIMEOUT="${RAY_JOIN_TIMEOUT:-${RAY_WAIT_NODES_TIMEOUT:-600}}"
  check_int RAY_JOIN_TIMEOUT 0 999999999 "seconds"
  [[ -z "${GPUS_PER_NODE:-}" ]] || check_int GPUS_PER_NODE 0  # 0: a CPU-only worker node; the head's pre-flight checks trainer.n_gpus_per_node
  [[ -z "${RAY_NUM_CPUS:-}" ]] || check_int RAY_NUM_CPUS 0
  ENVACE_STEP_DEADLINE="${ENVACE_STEP_DEADLINE:-7200}"
  check_seconds ENVACE_STEP_DEADLINE "0: no deadline"
  # start-up, timed to the first step line: 1 h to build, load an 8B model from shared storage into the actor, the
  # reference and every rollout replica, and start vLLM (compilation, CUDA graphs); then validation before training
  # (or, without it, the first step): the 2 h a step with its validation pass gets (docs/multinode.md#losing-a-node)
  ENVACE_STARTUP_DEADLINE="${ENVACE_STARTUP_DEADLINE:-10800}"
  check_seconds ENVACE_STARTUP_DEADLINE "0: no deadline"
  case "${RAY_AUTH_MODE:-}" in
    disabled) ;;
    "" | token)
      [[ -n "${RAY_AUTH_TOKEN:-}${RAY_AUTH_TOKEN_PATH:-}" ]] ||
        env_error "multi-node Ray needs token authentication, and no token was given: export" \
          "RAY_AUTH_TOKEN=<secret> (the same value on every node, e.g. from \`openssl rand -hex 32\` once), or" \
          "RAY_AUTH_TOKEN_PATH=<file> (on storage all nodes share: the head writes a new token there, mode 600," \
          "and the workers read it), or RAY_AUTH_MODE=disabled (a trusted, isolated network only)"
      export RAY_AUTH_MODE=token
      ;;
    *) env_error "RAY_AUTH_MODE='$RAY_AUTH_MODE' must be token or disabled" ;;
  esac
}

NNODES="${NNODES:-1}"
check_int NNODES 1
MULTINODE=0
if [[ "$NNODES" -gt 1 && -z "${RAY_ADDRESS:-}" ]]; then
  MULTINODE=1
  check_multinode_env
fi

# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"

# No network at run time: models, tokenizers and data come from local paths and the envace cache.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

# --help prints the trainer's usage and starts nothing, on any node
case " $* " in *" --help "* | *" -h "*) exec "$PY" -m envace.train --help ;; esac

# Pre-flight on every node, before any Ray start: a driver too old for the installed torch's CUDA build
# (requirements/gpu-cu13.lock needs driver R580+ or NVIDIA's forward-compatibility package, gpu-cu12.lock R525.60.13+)
# stops here with the fix.
"$PY" -m envace.launch cuda-check
# ... and a GPU node without a C compiler or the Python headers, which Triton builds its launcher with at run time
# (vLLM's kernels, verl's use_torch_compile), stops here naming the packages (docs/gpu.md#build-tools).
"$PY" -m envace.launch build-check

# Multi-node Ray authentication (its mode and source checked above): with RAY_AUTH_TOKEN_PATH, writes a new token
# there (head) or waits for the head's (worker).
ray_auth() {
  if [[ "$RAY_AUTH_MODE" == "disabled" ]]; then
    echo "envace: WARNING: RAY_AUTH_MODE=disabled: the Ray cluster on ${MASTER_ADDR}:${RAY_PORT} accepts any" \
      "client that can reach it (its ports listen on all interfaces); use it only on a trusted network" >&2
    return 0
  fi
  if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
    return 0
  fi
  if [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
    export RAY_AUTH_TOKEN_PATH
    if [[ "$NODE_RANK" -eq 0 ]]; then
      "$PY" -m envace.launch auth-token "$RAY_AUTH_TOKEN_PATH"
    else
      local waited=0
      until [[ -s "$RAY_AUTH_TOKEN_PATH" ]]; do
        if [[ "$waited" -ge "$RAY_JOIN_TIMEOUT" ]]; then
          echo "envace: no Ray auth token at $RAY_AUTH_TOKEN_PATH after ${RAY_JOIN_TIMEOUT}s" \
            "(the head writes it there: is the path on storage shared with the head?)" >&2
          exit 2
        fi
        sleep 2
        waited=$((waited + 2))
      done
    fi
  fi
}

if [[ "$MULTINODE" -eq 1 ]]; then
  GPUS_PER_NODE="${GPUS_PER_NODE:-$("$PY" -m envace.launch gpus)}"
  if [[ "$NODE_RANK" -eq 0 ]]; then
    # The config's pre-flight, the driver's own checks under the driver's settings, before this head writes a token,
    # starts Ray or waits up to RAY_JOIN_TIMEOUT for its workers: a mistake exits 2 now, naming the key.
    RAY_ADDRESS="${MASTER_ADDR}:${RAY_PORT}" "$PY" -m envace.train --preflight-only trainer.nnodes="$NNODES" \
      trainer.n_gpus_per_node="$GPUS_PER_NODE" "$@"
  fi
  ray_auth
  RAY_NODE_PID=""
  TRAIN_PID=""
  WATCH_PID=""
  # On exit, stop the training driver (if still running), then only the Ray node this script started
  # (never `ray stop`, which stops every Ray cluster of the host). The node is also bound to this
  # script's life (envace.launch bound-exec), so even a SIGKILL of this script stops it.
  stop_children() {
    local pid
    for pid in "$TRAIN_PID" "$WATCH_PID" "$RAY_NODE_PID"; do
      if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
      fi
    done
    [[ -z "${DRIVER_LOG:-}" ]] || rm -f "$DRIVER_LOG"
  }
  trap stop_children EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT
  if [[ "$NODE_RANK" -eq 0 ]]; then
    echo "envace: starting Ray head on ${MASTER_ADDR}:${RAY_PORT} (${GPUS_PER_NODE} device slot(s)," \
      "auth: ${RAY_AUTH_MODE})"
    "$PY" -m envace.launch bound-exec --parent $$ -- "$PY" -m ray.scripts.scripts start --head \
      --node-ip-address="$MASTER_ADDR" --port="$RAY_PORT" --num-gpus="$GPUS_PER_NODE" \
      ${RAY_NUM_CPUS:+"--num-cpus=$RAY_NUM_CPUS"} --disable-usage-stats --block &
    RAY_NODE_PID=$!
    export RAY_ADDRESS="${MASTER_ADDR}:${RAY_PORT}"
    "$PY" -m envace.launch wait-nodes --address "$RAY_ADDRESS" --nodes "$NNODES" --timeout "$RAY_JOIN_TIMEOUT" \
      --node-pid "$RAY_NODE_PID"
    # The driver's console output also goes to DRIVER_LOG, where the watcher reads its step lines. The watcher
    # stops the run (exit 3) when a Ray node is lost, when the first step line (validation before training, or the
    # first step) does not come within ENVACE_STARTUP_DEADLINE seconds, or a later step within ENVACE_STEP_DEADLINE,
    # naming the cause and the checkpoint a relaunch resumes from (verl would otherwise wait on a lost node forever).
    DRIVER_LOG="$(mktemp "${TMPDIR:-/tmp}/envace-driver.XXXXXX")"
    PYTHONUNBUFFERED=1 "$PY" -m envace.train trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" "$@" \
      > >(tee -a "$DRIVER_LOG") 2> >(tee -a "$DRIVER_LOG" >&2) &
    TRAIN_PID=$!
    "$PY" -m envace.launch watch --pid "$TRAIN_PID" --address "$RAY_ADDRESS" --log "$DRIVER_LOG" \
      --startup-deadline "$ENVACE_STARTUP_DEADLINE" --step-deadline "$ENVACE_STEP_DEADLINE" -- "$@" &
    WATCH_PID=$!
    rc=0
    wait "$TRAIN_PID" || rc=$?
    TRAIN_PID=""
    wrc=0
    wait "$WATCH_PID" || wrc=$?
    WATCH_PID=""
    rm -f "$DRIVER_LOG"
    [[ "$wrc" -ne 3 ]] || rc=3
    exit "$rc"
  else
    echo "envace: node ${NODE_RANK} joining Ray head ${MASTER_ADDR}:${RAY_PORT} (${GPUS_PER_NODE} device slot(s))"
    "$PY" -m envace.launch wait-head --address "${MASTER_ADDR}:${RAY_PORT}" --timeout "$RAY_JOIN_TIMEOUT"
    # this node's address on the interface that reaches the head (Ray's own guess may pick another NIC)
    NODE_IP="${NODE_IP_ADDRESS:-$("$PY" -m envace.launch node-ip --head "$MASTER_ADDR")}"
    "$PY" -m envace.launch bound-exec --parent $$ -- "$PY" -m ray.scripts.scripts start \
      --address="${MASTER_ADDR}:${RAY_PORT}" --node-ip-address="$NODE_IP" --num-gpus="$GPUS_PER_NODE" \
      ${RAY_NUM_CPUS:+"--num-cpus=$RAY_NUM_CPUS"} --block &
    RAY_NODE_PID=$!
    rc=0
    wait "$RAY_NODE_PID" || rc=$?
    RAY_NODE_PID=""
    # The head stops the cluster when the run ends, and this node's Ray then exits non-zero: that is this
    # node's normal end (the run's result is the head's exit status). A node that fails while its head is
    # still up keeps its error.
    if [[ "$rc" -ne 0 ]] && ! "$PY" -m envace.launch wait-head --address "${MASTER_ADDR}:${RAY_PORT}" \
        --timeout 0 2>/dev/null; then
      echo "envace: the Ray head ${MASTER_ADDR}:${RAY_PORT} has closed the cluster: node ${NODE_RANK} is done" \
        "(the run's result is the head's exit status)"
      rc=0
    fi
    exit "$rc"
  fi
fi

exec "$PY" -m envace.train "$@"
