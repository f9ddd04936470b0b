"""End to end on CPU, asynchronous (issue 46), all three methods in one run: EnvACE with EnvSched and Trace2Env
(``cpu_all``) on verl's colocated async trainer (``trainer.v1.trainer_mode=envsched_colocate_async``) through
scripts/train.sh, killed and resumed.

``cpu_all``: the warm-started tiny Qwen3 acting and rehearsing (role-wise GRPO) on batches EnvSched picks from two
environments of the synthetic pool: one served by a Trace2Env worldbook built from its recorded traces (the
``envace_simulator`` loop: only the acting role, every call answered by the simulator), one the policy rehearses
(both roles); in both the reward is the pool's verifier on the real environment's shadow replay. 4 prompts × 2
rollouts a step, two warm-up batches in flight beyond the step's own, and a staleness bound of 2 under verl's
``drop`` strategy. Run A trains steps 1 and 2, checkpointing each; once step 2's checkpoint is complete
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
* **all three methods**: EnvSched's cold start took a task of each environment; the simulated one's rows are the
  acting role's only, their calls answered by the worldbook; the rehearsed one's are both roles', none simulated;
  answered calls were compared with the real environment's responses; within each prompt's group each role's
  advantages are centred on that role's mean (role-wise GRPO).
* envace's per-role metrics and dump columns, as in the sync trainer.

The synchronous trainer's resume, checkpoint export and vLLM weight sync are checked elsewhere: the two-node run's
relaunch (``test_multinode.py``), ``tests/envace/models/test_export.py`` and the learning run on verl's vLLM replica
with the fast test of the CPU weight sync (``tests/envace/platform/test_vllm_cpu_sync.py``).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from envace.data.datasets import stable_order
from envace.envs.base import get_pool
from envace.launch import STEP_LINE
from envace.verl.config import compose

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.warm_start]

REPO = Path(__file__).resolve().parents[2]
B, N, THRESHOLD = 4, 2, 2
#: the environment cpu_all serves with a Trace2Env worldbook, and one it leaves to the policy's rehearsal
SIMULATED, REHEARSED = "syn-bank-00", "syn-shop-01"
OVERRIDES = [
    # EnvACE + EnvSched + Trace2Env (the training tasks, envace.data.train_task_ids=training_tasks(), are added in
    # the test: collection builds no pool)
    "experiment=cpu_all",
    "trainer.v1.trainer_mode=envsched_colocate_async",
    # partial credit gives reward variance inside groups, so the advantages the role-wise check reads are not all zero
    "envace.agent.pool_kwargs.synthetic.reward=partial",
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


def training_tasks(per_env: int = 8) -> list[str]:
    """``per_env`` train-split tasks of each of the two environments (EnvSched's cold start takes one of each)."""
    kwargs = compose(["experiment=cpu_all"]).envace.agent.pool_kwargs.synthetic
    pool = get_pool("synthetic", **kwargs)
    ids = stable_order(pool.task_ids("train"))
    return [t for env in (SIMULATED, REHEARSED) for t in [t for t in ids if pool.task(t).env_id == env][:per_env]]


def env_of(key: str) -> str:
    return key.split("/")[-2]  # EnvSched's task keys are <pool>/<env_id>/t<N>


def launch(run: Path, tasks: list[str]) -> tuple[subprocess.Popen[str], list[str]]:
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)
    cmd = [str(REPO / "scripts" / "train.sh"), *OVERRIDES, f"trainer.default_local_dir={run}",
           f"trainer.rollout_data_dir={run / 'rollouts'}", f"envace.data.train_task_ids=[{','.join(tasks)}]"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def ledger(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "prompts.jsonl").read_text().splitlines()]


def dump(run: Path, step: int) -> list[dict]:
    """``step``'s rollout dump, verl's padding rows left out."""
    rows = [json.loads(x) for x in (run / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
    return [r for r in rows if not r["uid"].startswith("pad")]


def trained_groups(run: Path, step: int) -> Counter[str]:
    """Trajectories per prompt uid in ``step``'s rollout dump."""
    return Counter(r["uid"].split("_")[0] for r in {r["trajectory_id"]: r for r in dump(run, step)}.values())


def roles_trained(run: Path, step: int) -> set[str]:
    return {r["role"] for r in dump(run, step)}


def test_async_envsched_bounds_staleness_and_a_resume_loses_and_repeats_nothing(tmp_path):
    patterns = compose(["experiment=cpu_all"]).envace.agent.simulated_envs
    assert any(fnmatch.fnmatchcase(SIMULATED, p) for p in patterns)
    assert not any(fnmatch.fnmatchcase(REHEARSED, p) for p in patterns)
    tasks = training_tasks()
    run = tmp_path / "run"
    proc, lines = launch(run, tasks)
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

    proc, lines = launch(run, tasks)
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
        for key in ("envace/act/outputs", "envace/masked_rate", "envsched/batch_size"):
            assert key in m, (step, key)
        # the importance weights reached each trained role's tokens (a step of the simulated environment's prompts
        # alone has no rehearsals)
        for role in roles_trained(run, step):
            assert m[f"envace/{role}/outputs"] > 0 and m[f"envace/{role}/is_weighted_tokens"] > 0, (step, role, m)
    assert max(m["envace/staleness/max"] for m in metrics.values()) == THRESHOLD - 1
    assert set().union(*(roles_trained(run, step) for step in metrics)) == {"act", "rehearse"}
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

    # all three methods: EnvSched's cold start took a task of each environment, the simulated one's rows are the acting
    # role's only (calls answered by the worldbook), the rehearsed one's both roles' (none simulated)
    selections = [json.loads(x) for x in (run / "envsched_selections.jsonl").read_text().splitlines()]
    assert {env_of(t) for t in selections[0]["task_ids"]} == {SIMULATED, REHEARSED}, selections[0]
    by_env: dict[str, list[dict]] = defaultdict(list)
    for step in metrics:
        groups: dict[tuple[str, str], list[float]] = defaultdict(list)
        for r in dump(run, step):
            assert r["role"] in ("act", "rehearse") and r["trajectory_id"] == r["uid"].rsplit("_", 1)[0]
            groups[(r["uid"].split("_")[0], r["role"])].append(r["advantage"])
            by_env[r["env_id"]].append(r)
        # role-wise GRPO: within each prompt's group, each role's advantages are centred on that role's mean
        for advs in groups.values():
            assert abs(sum(advs)) < 1e-4 * max(1, len(advs)), (step, advs)
    assert set(by_env) == {SIMULATED, REHEARSED}, set(by_env)
    sim, reh = by_env[SIMULATED], by_env[REHEARSED]
    assert {r["observation_source"] for r in sim} == {"simulator"} and {r["role"] for r in sim} == {"act"}
    assert sum(r["simulated_calls"] for r in sim) > 0
    assert {r["observation_source"] for r in reh} == {"rehearse"} and {r["role"] for r in reh} == {"act", "rehearse"}
    assert all(r["simulated_calls"] == 0 for r in reh)
    # answered calls, simulated or rehearsed, were compared with the real environment's responses (the shadow)
    assert sum(m.get("envace/rehearsal_fidelity/compared", 0.0) for m in metrics.values()) > 0
    assert any(r["advantage"] != 0 for r in sim + reh)  # the centring check had advantages to check

    # EnvSched's view after the resume: what it holds in flight is the ledger's
    import torch

    state = torch.load(run / "global_step_4" / "envsched.pt", weights_only=True)
    ledger_open = json.loads((run / "global_step_4" / "prompt_ledger.json").read_text())["open"]
    # the state holds pool node indices; the selections log names each selection's tasks in the same order (a
    # selection the killed run made after its checkpoint was made again after the resume: the later record holds)
    logged = {r["selection"]: r["task_ids"] for r in selections}
    task_of = {int(n): t for s, nodes in zip(state["selection_steps"], state["selections"], strict=True)
               for n, t in zip(nodes.tolist(), logged[int(s)], strict=True)}
    sched_open = sorted((int(s), task_of[int(n)]) for s, nodes in zip(state["open_steps"], state["open"], strict=True)
                        for n in nodes.tolist())
    assert sched_open == sorted((int(p[0]), str(p[1])) for _, _, p in ledger_open)
    print(f"async resume count: {len(set(dispatched))} prompts dispatched; {len(trained)} trained once "
          f"({sum(len(x['trained']) for x in a)} before the kill, {sum(len(x['trained']) for x in b)} after), "
          f"{len(dropped)} dropped at the staleness bound, {len(in_flight_at_end)} in flight at the end; "
          f"{len(in_flight_at_kill)} in flight at the kill, restored {restored}; outcomes {dict(Counter(outcomes.values()))}")
