#!/usr/bin/env bash
# Traces -> worldbooks: record gold replays of an environment pool, build one Trace2Env worldbook per
# environment (python -m trace2env build) from the train split, and measure next-observation agreement on
# the test split (python -m trace2env eval). The result plugs into training/evaluation with
#   envace.agent.observation_source=simulator envace.agent.worldbook=OUT/books
# Usage:
#   scripts/build_worldbook.sh --pool synthetic --out runs/wb-syn [--pool-kwargs '{"n_envs": 4}'] [--max-tasks N]
#                              [-- BUILD_ARGS...]   # e.g. -- --base-url http://127.0.0.1:8000/v1 --model Qwen3-8B
# OUT/traces/{train,test}.jsonl, OUT/traces/{train,test}/<env>.jsonl, OUT/books/<env>/, OUT/eval/<env>.json
# Nothing is written before the arguments check out (they are checked before the virtualenv is touched; the
# pool, --pool-kwargs and --max-tasks by python -m envace.data record-traces before it writes). Books are built into
# OUT/.books.partial and renamed to OUT/books once all are built and checked: a failed run leaves no OUT/books,
# and the corrected rerun keeps the partial books that still verify (trace2env check) and builds the rest.
# Usage and input mistakes exit 2 with one line.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "build_worldbook.sh: $*" >&2; exit 2; }
value() { [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || die "$1 needs a value (see --help)"; }

POOL="" OUT="" KW="{}" MAX=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --pool) value "$@"; POOL="$2"; shift 2 ;;
    --out) value "$@"; OUT="$2"; shift 2 ;;
    --pool-kwargs) value "$@"; KW="$2"; shift 2 ;;
    --max-tasks)
      value "$@"
      [[ "$2" =~ ^[0-9]+$ && "$2" -ge 1 ]] || die "--max-tasks: expected an integer >= 1, got '$2'"
      MAX=(--max-tasks "$2"); shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[[ -n "$POOL" && -n "$OUT" ]] || die "--pool and --out are required"
[[ ! -e "$OUT/books" ]] || die "$OUT/books exists; worldbooks are immutable (use another --out)"
[[ ! -e "$OUT" || -d "$OUT" ]] || die "--out $OUT is a file, not a directory"

# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"   # the project's virtualenv (created on first use); exports PY

for split in train test; do
  "$PY" -m envace.data --pool-kwargs "{\"$POOL\": $KW}" record-traces --pool "$POOL" --split "$split" \
    ${MAX[@]+"${MAX[@]}"} --out "$OUT/traces/$split.jsonl" --by-env "$OUT/traces/$split"
done
shopt -s nullglob
train_files=("$OUT"/traces/train/*.jsonl)
(( ${#train_files[@]} )) || die "no train traces were recorded under $OUT/traces/train"
PARTIAL="$OUT/.books.partial"
mkdir -p "$PARTIAL" "$OUT/eval"
wanted=()
for f in "${train_files[@]}"; do wanted+=("$(basename "$f" .jsonl)"); done
for old in "$PARTIAL"/.[!.]* "$PARTIAL"/*; do   # an interrupted build's leftovers, books of other environments
  keep=0
  for w in "${wanted[@]}"; do [[ "$old" == "$PARTIAL/$w" ]] && keep=1; done
  (( keep )) || { chmod -R u+w "$old"; rm -rf "$old"; }
done
for f in "${train_files[@]}"; do
  name="$(basename "$f" .jsonl)"
  env_id="$("$PY" -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["metadata"]["env_id"])' "$f")"
  if [[ -e "$PARTIAL/$name" ]]; then
    if "$PY" -m trace2env check "$PARTIAL/$name" >/dev/null 2>&1; then
      echo "build_worldbook.sh: $name: kept from the interrupted build (verifies)" >&2
    else
      chmod -R u+w "$PARTIAL/$name" && rm -rf "$PARTIAL/$name"
    fi
  fi
  [[ -e "$PARTIAL/$name" ]] || "$PY" -m trace2env build "$f" --out "$PARTIAL/$name" --environment-id "$env_id" "$@"
  if [[ -f "$OUT/traces/test/$name.jsonl" ]]; then
    "$PY" -m trace2env eval "$PARTIAL/$name" "$OUT/traces/test/$name.jsonl" --mode evidence \
      --out "$OUT/eval/$name.json" > "$OUT/eval/$name.summary.json"
  fi
done
"$PY" -m trace2env check "$PARTIAL" >/dev/null   # the folder as the simulator will load it: all or nothing
mv -T "$PARTIAL" "$OUT/books"
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
