#!/usr/bin/env bash
# Mutation testing (mutmut 3.8.1, the `mutation` extra of pyproject.toml) of the math and control modules,
# each against its fast tests. Not part of CI: a target takes minutes to tens of minutes on 2 cores.
#   scripts/mutation.sh                         # every target below, one after the other
#   scripts/mutation.sh advantage toolcall      # chosen targets
#   MUTATION_JOBS=2 scripts/mutation.sh estimate    # mutants run in parallel (default 1)
#   MUTATION_DIR=/somewhere scripts/mutation.sh ... # scratch folder (default ${TMPDIR:-/tmp}/envace-mutation)
# Each target runs in its own scratch copy of the work tree ($MUTATION_DIR/<target>; the work tree itself is
# never touched) and prints its counts, the mutation score (killed / (killed + survived + timeout +
# suspicious); "no tests" mutants count as survivors) and the survivors; `cd $MUTATION_DIR/<target> &&
# mutmut show <name>` prints a survivor's diff. A scratch copy keeps its results: mutmut re-tests a mutant only
# when its function changed, not when the tests did, so after adding tests re-test the survivors by name
# (`cd $MUTATION_DIR/<target> && mutmut run <names>`) or delete the folder to start afresh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 LITELLM_LOCAL_MODEL_COST_MAP=True
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$PY" -c "import mutmut" 2>/dev/null || "$PY" -m pip install --quiet "mutmut==3.8.1"

# target: <module to mutate> | <its fast tests>
declare -A TARGETS=(
  [advantage]="envace/advantage.py|tests/envace/test_advantage.py tests/envace/test_advantage_oracle.py"
  [toolcall]="envace/toolcall.py|tests/envace/test_toolcall.py"
  [engine]="envace/agents/engine.py|tests/envace/agents/test_engine.py tests/envace/agents/test_verl_loop.py"
  [estimate]="envsched/estimate.py|tests/envsched/test_estimate.py tests/envsched/test_estimate_oracle.py tests/envsched/test_scheduler_observe.py tests/envsched/test_select.py tests/envsched/test_neighbors.py"
  [select]="envsched/select.py|tests/envsched/test_select.py tests/envsched/test_filters.py tests/envsched/test_scheduler.py tests/envsched/test_neighbors.py"
  [scheduler]="envsched/scheduler.py|tests/envsched/test_scheduler.py tests/envsched/test_estimate_oracle.py tests/envsched/test_scheduler_observe.py tests/envsched/test_select.py tests/envsched/test_filters.py tests/envsched/test_estimate.py"
)
ORDER=(advantage toolcall engine estimate select scheduler)
(( $# )) && ORDER=("$@")
BASE="${MUTATION_DIR:-${TMPDIR:-/tmp}/envace-mutation}"
JOBS="${MUTATION_JOBS:-1}"

for name in "${ORDER[@]}"; do
  [[ -n "${TARGETS[$name]:-}" ]] || { echo "mutation.sh: unknown target '$name' (one of: ${!TARGETS[*]})" >&2; exit 2; }
  module="${TARGETS[$name]%%|*}" tests="${TARGETS[$name]#*|}"
  work="$BASE/$name"
  mkdir -p "$work"
  # the work tree as git sees it (tracked and untracked-not-ignored files), without the old mutants
  (cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$work"
  {
    echo "[mutmut]"
    echo "source_paths = ${module%%/*}"
    echo "only_mutate = $module"
    # what tests read besides the code and tests/ (mutmut runs them inside mutants/)
    printf 'also_copy =\n    configs\n    requirements\n    scripts\n    benchmarks\n    envace\n    envsched\n    trace2env\n'
    printf 'pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -m\n    not slow\n'
    echo "pytest_add_cli_args_test_selection ="
    for t in $tests; do echo "    $t"; done
  } > "$work/setup.cfg"
  echo "== $name: $module against $tests" >&2
  (cd "$work" && "$VENV/bin/mutmut" run --max-children "$JOBS" >"$work/mutmut-run.log" 2>&1) || {
    tail -n 30 "$work/mutmut-run.log" >&2; echo "mutation.sh: mutmut run failed for $name (log: $work/mutmut-run.log)" >&2; exit 1; }
  (cd "$work" && "$VENV/bin/mutmut" export-cicd-stats >/dev/null && "$VENV/bin/mutmut" results > "$work/survivors.txt" 2>&1 || true)
  "$PY" - "$name" "$work" <<'PY'
import json, sys
from pathlib import Path
name, work = sys.argv[1], Path(sys.argv[2])
s = json.loads((work / "mutants" / "mutmut-cicd-stats.json").read_text())
bad = s["survived"] + s["no_tests"] + s["timeout"] + s["suspicious"]
score = 100.0 * s["killed"] / max(s["killed"] + bad, 1)
print(f"{name}: {s['total']} mutants, killed {s['killed']}, survived {s['survived']}, no tests {s['no_tests']}, "
      f"timeout {s['timeout']}, suspicious {s['suspicious']}, skipped {s.get('skipped', 0)}: score {score:.1f}%")
for line in (work / "survivors.txt").read_text().splitlines():
    if line.strip():
        print("   ", line.strip())
PY
done
