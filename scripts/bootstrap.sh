#!/usr/bin/env bash
# Sourced by scripts/*.sh: make sure the project's virtualenv exists and matches the lock file,
# then export PY (its python). Idempotent: a second run costs one hash comparison.
#   ENVACE_VENV       where the virtualenv lives (default: <repo>/.venv)
#   ENVACE_PYTHON     interpreter used to create it (default: python3)
#   ENVACE_PLATFORM   cpu | gpu | auto (default): which lock to install; auto = gpu when nvidia-smi lists a GPU
#   ENVACE_FLASH_ATTN 1: on gpu, also build flash-attn (optional; README "GPU install")
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
export ENVACE_PLATFORM
LOCK="$_ROOT/requirements/$ENVACE_PLATFORM.lock"
# flash-attn 2.8.3: the version verl 0.9.1's own `fsdp` extra pins (built against the installed CUDA torch)
FLASH_ATTN=""
[[ "$ENVACE_PLATFORM" == "gpu" && "${ENVACE_FLASH_ATTN:-0}" == "1" ]] && FLASH_ATTN="flash-attn==2.8.3"
STAMP="$VENV/.envace-installed"
want="$( { echo "$ENVACE_PLATFORM $FLASH_ATTN"; cat "$LOCK" "$_ROOT/pyproject.toml" "$_ROOT/requirements/"*.txt; } 2>/dev/null \
  | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" || ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
  echo "envace: installing requirements/$ENVACE_PLATFORM.lock into $VENV (first run takes a few minutes)" >&2
  [[ -x "$VENV/bin/python" ]] || "${ENVACE_PYTHON:-python3}" -m venv "$VENV"
  log="$VENV/.envace-install.log"
  {
    "$VENV/bin/python" -m pip install --upgrade "pip>=24" &&
    # cpu.lock: torch 2.13.0 (CPU wheel), never vLLM or CUDA. gpu.lock: verl 0.9.1's vLLM 0.24.0 tree
    # (CUDA 13 torch 2.11.0, transformers 5.9.0).
    "$VENV/bin/python" -m pip install -r "$LOCK" &&
    # bfcl-eval pins numpy 1.26 (clashes with verl): install it without its dependency pins;
    # its environments and checker need only what the lock already holds.
    "$VENV/bin/python" -m pip install --no-deps -r "$_ROOT/requirements/no-deps.txt" &&
    "$VENV/bin/python" -m pip install --no-deps -e "$_ROOT[test]" &&
    # flash-attn compiles against the installed torch (needs nvcc; minutes): only when asked for
    { [[ -z "$FLASH_ATTN" ]] || "$VENV/bin/python" -m pip install --no-build-isolation "$FLASH_ATTN"; }
  } >"$log" 2>&1 || { tail -n 40 "$log" >&2; echo "envace: install failed; full log: $log" >&2; exit 1; }
  echo "$want" > "$STAMP"
fi
export PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"
