#!/usr/bin/env bash
# Traces -> worldbooks: record gold replays of an environment pool, build one Trace2Env worldbook per
# environment (python -m trace2env build) from the train split, and measure next-observation agreement on
# the test split (python -m trace2env eval). The result plugs into training/evaluation with
#   envace.agent.observation_source=simulator envace.agent.worldbook=OUT/books
# Usage:
#   scripts/build_worldbook.sh --pool synthetic --out runs/wb-syn [--pool-kwargs '{"n_envs": 4}'] [--max-tasks N]
#                              [-- BUILD_ARGS...]   # e.g. -- --base-url http://127.0.0.1:8000/v1 --model Qwen3-8B
# OUT/traces/{train,test}.jsonl, OUT/traces/{train,test}/<env>.jsonl, OUT/books/<env>/, OUT/eval/<env>.json
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"   # the project's virtualenv (created on first use); exports PY

POOL="" OUT="" KW="{}" MAX=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --pool) POOL="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --pool-kwargs) KW="$2"; shift 2 ;;
    --max-tasks) MAX=(--max-tasks "$2"); shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "build_worldbook.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$POOL" && -n "$OUT" ]] || { echo "build_worldbook.sh: --pool and --out are required" >&2; exit 2; }
[[ ! -e "$OUT/books" ]] || { echo "build_worldbook.sh: $OUT/books exists; worldbooks are immutable" >&2; exit 2; }

for split in train test; do
  "$PY" -m envace.envs.traces --pool "$POOL" --pool-kwargs "$KW" --split "$split" "${MAX[@]}" \
    --out "$OUT/traces/$split.jsonl" --by-env "$OUT/traces/$split"
done
mkdir -p "$OUT/books" "$OUT/eval"
for f in "$OUT"/traces/train/*.jsonl; do
  name="$(basename "$f" .jsonl)"
  env_id="$("$PY" -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["metadata"]["env_id"])' "$f")"
  "$PY" -m trace2env build "$f" --out "$OUT/books/$name" --environment-id "$env_id" "$@"
  if [[ -f "$OUT/traces/test/$name.jsonl" ]]; then
    "$PY" -m trace2env eval "$OUT/books/$name" "$OUT/traces/test/$name.jsonl" --mode evidence \
      --out "$OUT/eval/$name.json" > "$OUT/eval/$name.summary.json"
  fi
done
"$PY" - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = [json.loads(p.read_text()) for p in sorted((out / "eval").glob("*.summary.json"))]
steps = sum(r["steps"] for r in rows)
if steps:
    for k in ("exact", "key_overlap", "answered"):
        print(f"held-out {k}: {sum(r[k] * r['steps'] for r in rows) / steps:.3f} over {steps} steps, {len(rows)} env(s)")
print(f"use: envace.agent.observation_source=simulator envace.agent.worldbook={out / 'books'}")
PY
