"""End to end on CPU, asynchronous (issue 46): EnvACE with EnvSched on verl's colocated async trainer
(``trainer.v1.trainer_mode=envsched_colocate_async``) through scripts/train.sh, killed and resumed.

The CPU default (``cpu_default``: the warm-started tiny Qwen3 acting and rehearsing on the synthetic pool, role-wise
GRPO), 4 prompts × 2 rollouts a step, two warm-up batches in flight beyond the step's own, and a staleness bound of 2
under verl's ``drop`` strategy. Run A trains steps 1 and 2, checkpointing each; once step 2's checkpoint is complete
it is SIGKILLed, with prompts in flight. Run B relaunches in the same folder: verl restores the finished groups and
re-issues the pending ones from TransferQueue's checkpoint, and trains steps 3 and 4.

Checked, from the runs' own records (metrics, rollout dumps, the prompt ledger ``prompts.jsonl``, EnvSched's state):

* **staleness**: every trained trajectory lags the updated policy by at most ``threshold - 1`` versions, the bound
  ``drop`` guarantees; two warm-up batches make step 3's oldest groups exceed it, so verl drops them (the bound is
  exercised, not idle). Without the drop those groups train at a lag of 2 and the check fails.
* **the resume count**: every prompt dispatched is trained exactly once, dropped, or still in flight at the end; the
  ones in flight at the checkpoint are exactly the groups verl restores; no uid is trained twice across the kill.
* **whole groups**: every trained group has all its rollouts, whatever weight versions they span.
* **EnvSched**: each trained group was observed under the selection that chose it, once (a repeat is refused and
  would stop the run); after the resume the scheduler's in-flight tasks are the ledger's.
* **rollout correction**: verl's token-level importance weights (decoupled mode) reach the act and the rehearse
  role's tokens alike.
* envace's per-role metrics and dump columns, as in the sync trainer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from envace.launch import STEP_LINE

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.warm_start]

REPO = Path(__file__).resolve().parents[2]
B, N, THRESHOLD = 4, 2, 2
OVERRIDES = [
    "experiment=cpu_default",
    "trainer.v1.trainer_mode=envsched_colocate_async",
    f"data.train_batch_size={B}", f"actor_rollout_ref.rollout.n={N}", f"actor_rollout_ref.actor.ppo_mini_batch_size={B}",
    # two batches in flight beyond the step's: the oldest groups reach the staleness bound at step 3
    "trainer.v1.colocate_async.num_warmup_batches=2",
    f"trainer.v1.sampler.max_off_policy_threshold={THRESHOLD}", "trainer.v1.sampler.max_off_policy_strategy=drop",
    # decoupled rollout correction with token-level importance weights: the trainer recomputes the old log-probs
    # and weighs every response token, act and rehearse alike, by pi_old / pi_rollout (truncated at 2)
    "algorithm.rollout_correction.bypass_mode=false", "algorithm.rollout_correction.rollout_is=token",
    "trainer.total_training_steps=4", "trainer.save_freq=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
    "trainer.logger=[console,file]",
]


def launch(run: Path) -> tuple[subprocess.Popen[str], list[str]]:
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)
    cmd = [str(REPO / "scripts" / "train.sh"), *OVERRIDES, f"trainer.default_local_dir={run}",
           f"trainer.rollout_data_dir={run / 'rollouts'}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def ledger(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "prompts.jsonl").read_text().splitlines()]


def trained_groups(run: Path, step: int) -> Counter[str]:
    """Trajectories per prompt uid in ``step``'s rollout dump (verl's padding rows left out)."""
    rows = [json.loads(x) for x in (run / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
    return Counter(r["uid"].split("_")[0] for r in {r["trajectory_id"]: r for r in rows if not r["uid"].startswith("pad")}.values())


def test_async_envsched_bounds_staleness_and_a_resume_loses_and_repeats_nothing(tmp_path):
    run = tmp_path / "run"
    proc, lines = launch(run)
    tracker = run / "latest_checkpointed_iteration.txt"
    try:
        deadline = time.monotonic() + 1800
        # step 2 checkpointed and logged (its metrics are written after the checkpoint)
        while not (tracker.is_file() and tracker.read_text().strip() == "2"
                   and "2" in {s for ln in list(lines) for s in STEP_LINE.findall(ln)}):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-6000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)  # step 3's rollouts are running: two batches are always in flight
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    a = ledger(run)
    assert [x["step"] for x in a] == [1, 2], "the kill came after step 3 trained: " + "".join(lines)[-3000:]

    proc, lines = launch(run)
    proc.wait(timeout=1800)
    out = "".join(lines)
    assert proc.returncode == 0 and "envace: training finished" in out, out[-8000:]
    b = ledger(run)[2:]
    assert [x["step"] for x in b] == [3, 4]
    from envace.metrics import load_metrics

    series = load_metrics(run)
    metrics = {s: {k: v[s] for k, v in series.items() if s in v} for s in range(1, 5)}

    # staleness: within the bound drop guarantees at every step, and the bound was reached (groups dropped)
    for step, m in metrics.items():
        assert m["envace/staleness/max"] <= THRESHOLD - 1 and m["envace/staleness/violations"] == 0, (step, m)
        assert m["envace/staleness/bound"] == THRESHOLD - 1
        assert m["training/off_policy/trajectory_staleness_worst/max"] == m["envace/staleness/max"]
        for key in ("envace/act/outputs", "envace/rehearse/outputs", "envace/masked_rate", "envsched/batch_size"):
            assert key in m, (step, key)
        # the importance weights reached both roles' tokens
        assert m["envace/act/is_weighted_tokens"] > 0 and m["envace/rehearse/is_weighted_tokens"] > 0, (step, m)
    assert max(m["envace/staleness/max"] for m in metrics.values()) == THRESHOLD - 1
    dropped = {u for x in a + b for u in x["dropped"]}
    assert dropped, "no group reached the staleness bound: the check was idle"

    # the resume count
    dispatched = [u for x in a + b for u in x["dispatched"]]
    trained = [u for x in a + b for u in x["trained"]]
    assert len(dispatched) == len(set(dispatched)), "a uid was dispatched twice"
    assert len(trained) == len(set(trained)), [u for u, c in Counter(trained).items() if c > 1]
    in_flight_at_kill, in_flight_at_end = set(a[-1]["open"]), set(b[-1]["open"])
    restored = int(re.search(r"Restored (\d+) training prompt groups", out).group(1))
    assert restored == len(in_flight_at_kill) > 0, (restored, len(in_flight_at_kill))
    outcomes = Counter({**dict.fromkeys(trained, "trained"), **dict.fromkeys(dropped, "dropped"),
                        **dict.fromkeys(in_flight_at_end, "in flight")})
    assert set(trained).isdisjoint(dropped) and set(trained).isdisjoint(in_flight_at_end)
    assert dropped.isdisjoint(in_flight_at_end)
    assert set(dispatched) == set(trained) | dropped | in_flight_at_end
    assert in_flight_at_kill <= set(trained) | dropped | in_flight_at_end  # none lost in the kill

    # whole groups, matching the ledger, step by step
    for step, x in enumerate(a + b, start=1):
        groups = trained_groups(run, step)
        assert set(groups) == set(x["trained"]) and set(groups.values()) == {N}, (step, groups)

    # EnvSched's view after the resume: what it holds in flight is the ledger's
    import torch

    state = torch.load(run / "global_step_4" / "envsched.pt", weights_only=True)
    ledger_open = json.loads((run / "global_step_4" / "prompt_ledger.json").read_text())["open"]
    # the state holds pool node indices; the selections log names each selection's tasks in the same order (a
    # selection the killed run made after its checkpoint was made again after the resume: the later record holds)
    logged = {r["selection"]: r["task_ids"] for r in map(json.loads, (run / "envsched_selections.jsonl").open())}
    task_of = {int(n): t for s, nodes in zip(state["selection_steps"], state["selections"], strict=True)
               for n, t in zip(nodes.tolist(), logged[int(s)], strict=True)}
    sched_open = sorted((int(s), task_of[int(n)]) for s, nodes in zip(state["open_steps"], state["open"], strict=True)
                        for n in nodes.tolist())
    assert sched_open == sorted((int(p[0]), str(p[1])) for _, _, p in ledger_open)
    print(f"async resume count: {len(set(dispatched))} prompts dispatched; {len(trained)} trained once "
          f"({sum(len(x['trained']) for x in a)} before the kill, {sum(len(x['trained']) for x in b)} after), "
          f"{len(dropped)} dropped at the staleness bound, {len(in_flight_at_end)} in flight at the end; "
          f"{len(in_flight_at_kill)} in flight at the kill, restored {restored}; outcomes {dict(Counter(outcomes.values()))}")
