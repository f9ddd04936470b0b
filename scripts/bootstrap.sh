#!/usr/bin/env bash
# Sourced by scripts/*.sh: make sure the project's virtualenv exists and matches the lock file,
# then export PY (its python). Idempotent: a second run costs one hash comparison.
#   ENVACE_VENV   where the virtualenv lives (default: <repo>/.venv)
#   ENVACE_PYTHON interpreter used to create it (default: python3)
set -euo pipefail
_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ENVACE_VENV:-$_ROOT/.venv}"
LOCK="$_ROOT/requirements/cpu.lock"
STAMP="$VENV/.envace-installed"
want="$(cat "$LOCK" "$_ROOT/pyproject.toml" "$_ROOT/requirements/"*.txt 2>/dev/null | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" || ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
  echo "envace: installing into $VENV (first run takes a few minutes)" >&2
  [[ -x "$VENV/bin/python" ]] || "${ENVACE_PYTHON:-python3}" -m venv "$VENV"
  log="$VENV/.envace-install.log"
  {
    "$VENV/bin/python" -m pip install --upgrade "pip>=24" &&
    # CPU machines: the locked tree pins torch 2.13.0 (CPU wheel) and never pulls vLLM or CUDA.
    "$VENV/bin/python" -m pip install -r "$LOCK" &&
    # bfcl-eval pins numpy 1.26 (clashes with verl): install it without its dependency pins;
    # its environments and checker need only what the lock already holds.
    "$VENV/bin/python" -m pip install --no-deps -r "$_ROOT/requirements/no-deps.txt" &&
    "$VENV/bin/python" -m pip install --no-deps -e "$_ROOT[test]"
  } >"$log" 2>&1 || { tail -n 40 "$log" >&2; echo "envace: install failed; full log: $log" >&2; exit 1; }
  echo "$want" > "$STAMP"
fi
export PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"
