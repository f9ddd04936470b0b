#!/usr/bin/env bash
# Next-observation agreement of a worldbook with held-out traces: a thin wrapper around
# `python -m trace2env eval WORLDBOOK TRACES... [--mode rules|evidence|agent] [--out FILE]`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"   # the project's virtualenv (created on first use); exports PY
exec "$PY" -m trace2env eval "$@"
