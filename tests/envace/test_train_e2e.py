"""End to end on CPU through scripts/train.sh and the project's own config: all three methods in one run (``cpu_all``).

Run A: 2 steps of EnvACE (the warm-started tiny Qwen3 acts and rehearses, role-wise GRPO) on batches EnvSched
picks, through verl's real V1 trainer (FSDP2 on gloo) and verl's own vLLM rollout replica on vLLM's CPU build,
checkpointing at steps 1 and 2, validating in the real environment at step 2. The training tasks come from two
environments of the synthetic pool: one ``cpu_all`` serves with a Trace2Env worldbook built from its recorded
traces (the ``envace_simulator`` loop: only the acting role, every call answered by the simulator), one the policy
rehearses (both roles); in both the reward is the pool's verifier on the real environment's shadow replay. Run B
starts from a copy of A's step-1 checkpoint only, resumes (model, optimizer, dataloader and scheduler state) and
runs step 2: its batch must equal the batch A chose at step 2 uninterrupted. B's checkpoint is then exported
(``python -m envace.models export``) and served by ``vllm serve``.

The weight sync is checked where it can fail, by verl's comparison of the rollout's sampled-token probabilities
with the FSDP actor's recomputation (``sync_holds``): vLLM starts from random weights (verl's
``load_format=dummy``), so step 1's rollout is the first sync's, and at a learning rate of 1e-2 one update moves
the policy's token probabilities by far more than ``SYNC_TOLERANCE``, so a stale sync at step 2 of either run (the
resumed one included) fails the largest difference. A rollout on weights that were never synced samples tokens both
models give almost no probability, so the difference stays small (6.6e-6 in a scratch copy whose extension drained
the buckets without loading them) and the correlation of the two probabilities (-0.01 there) is what fails.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from openai import OpenAI

from envace.data.datasets import stable_order
from envace.envs.base import get_pool
from envace.eval.server import launch_server
from envace.verl.config import compose

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.warm_start]

#: the environment cpu_all serves with a Trace2Env worldbook, and one it leaves to the policy's rehearsal
SIMULATED, REHEARSED = "syn-bank-00", "syn-shop-01"


def training_tasks(per_env: int = 8) -> list[str]:
    """``per_env`` train-split tasks of each of the two environments (EnvSched's cold start takes one of each)."""
    kwargs = compose(["experiment=cpu_all"]).envace.agent.pool_kwargs.synthetic
    pool = get_pool("synthetic", **kwargs)
    ids = stable_order(pool.task_ids("train"))
    return [t for env in (SIMULATED, REHEARSED) for t in [t for t in ids if pool.task(t).env_id == env][:per_env]]


FAST = [
    # EnvACE + EnvSched + Trace2Env: cpu_envsched with syn-bank-*, syn-files-*, syn-library-* simulated (the
    # training tasks, envace.data.train_task_ids=training_tasks(), are added in the test: collection builds no pool)
    "experiment=cpu_all",
    # verl's own vLLM replica on vLLM's CPU build (the CPU default is hfcpu, the faster on 2 cores)
    "actor_rollout_ref.rollout.name=vllm",
    # partial credit gives reward variance inside groups, so the advantages are not all zero
    "envace.agent.pool_kwargs.synthetic.reward=partial",
    "trainer.val_before_train=false",
    "trainer.logger=[console,file]",
    "trainer.total_training_steps=2",
    "trainer.save_freq=1",
    "trainer.test_freq=2",
    "data.val_max_samples=4",
    # recompute the old log-probs (cpu_default bypasses it) so verl reports rollout-vs-trainer differences
    "algorithm.rollout_correction.bypass_mode=false",
    # large steps: a rollout that missed an update differs from the trainer by far more than SYNC_TOLERANCE; the
    # entropy term makes every step update, even one whose groups all scored alike (zero advantages)
    "actor_rollout_ref.actor.optim.lr=1e-2",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
]
#: the largest probability difference, over a step's tokens, between vLLM's sampled-token probability and the FSDP
#: actor's recomputation (both fp32, the same weights after a sync)
SYNC_TOLERANCE = 1e-2


def sync_holds(m: dict[str, float], run_dir: Path) -> None:
    """The rollout server held the actor's weights for this step's rollout; a failure names the rows whose tokens
    differ most (the dump's per-row ``rollout_probs_diff_max``: role, environment, observation source, output)."""
    step = int(m["step"])
    rows = [json.loads(line) for line in (run_dir / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
    worst = sorted((r for r in rows if r["rollout_probs_diff_max"] is not None),
                   key=lambda r: -r["rollout_probs_diff_max"])[:3]
    detail = [{k: r[k] for k in ("rollout_probs_diff_max", "role", "env_id", "observation_source", "uid")}
              | {"output": r["output"][-300:]} for r in worst]
    assert m["training/rollout_probs_diff_max"] < SYNC_TOLERANCE, (m["training/rollout_probs_diff_max"], detail)
    assert m["training/rollout_actor_probs_pearson_corr"] > 0.99, (m["training/rollout_actor_probs_pearson_corr"],
                                                                   detail)
    # the dump's per-row column is verl's batch maximum resolved to rows
    assert worst and abs(worst[0]["rollout_probs_diff_max"] - m["training/rollout_probs_diff_max"]) < 1e-6


def step_metrics(out: str, step: int) -> dict[str, float]:
    line = next(ln for ln in out.splitlines() if re.search(rf"\bstep:{step} - ", ln))
    return {k: float(v) for k, v in re.findall(r"([\w/@.-]+):(-?[\d.]+(?:e-?\d+)?)(?= - |$)", line)}


def selections(run_dir: Path) -> dict[int, list[str]]:
    lines = (run_dir / "envsched_selections.jsonl").read_text().splitlines()
    return {rec["step"]: rec["task_ids"] for rec in map(json.loads, lines)}


def env_of(key: str) -> str:
    return key.split("/")[-2]  # EnvSched's task keys are <pool>/<env_id>/t<N>


def test_all_three_methods_train_checkpoint_resume(tmp_path, train_sh):
    patterns = compose(["experiment=cpu_all"]).envace.agent.simulated_envs
    assert any(fnmatch.fnmatchcase(SIMULATED, p) for p in patterns)
    assert not any(fnmatch.fnmatchcase(REHEARSED, p) for p in patterns)
    overrides = [*FAST, f"envace.data.train_task_ids=[{','.join(training_tasks())}]"]
    a = tmp_path / "a"
    out_a = train_sh(a, *overrides)
    roles_seen: set[str] = set()
    by_env: dict[str, list[dict]] = defaultdict(list)
    for step in (1, 2):
        m = step_metrics(out_a, step)
        # the rollout server and the FSDP actor hold the same weights after every sync
        sync_holds(m, a)
        assert m["actor/grad_norm"] > 0  # every step updates, so every later rollout needs the sync
        assert 0.0 <= m["critic/score/mean"] <= 1.0
        # EnvSched chose the step's batch and was fed back every group's rewards
        assert m["envsched/batch_size"] == 2 and m["envsched/observed_groups"] == 2
        # per-role metrics every step
        for key in ("envace/act/outputs", "envace/rehearse/outputs", "envace/act/calls_per_trajectory",
                    "envace/masked_rate", "envace/trajectories"):
            assert key in m, key
        assert m["envace/trajectories"] == 4  # 2 prompts x 2 rollouts
        rows = [json.loads(line) for line in (a / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        roles_seen |= {r["role"] for r in rows}
        # role-wise GRPO: within each prompt's group, each role's advantages are centred on that role's mean
        groups: dict[tuple[str, str], list[float]] = defaultdict(list)
        for r in rows:
            if r["uid"].startswith("pad"):
                continue
            assert r["role"] in ("act", "rehearse") and r["trajectory_id"] == r["uid"].rsplit("_", 1)[0]
            groups[(r["uid"].split("_")[0], r["role"])].append(r["advantage"])
            by_env[r["env_id"]].append(r)
        for advs in groups.values():
            assert abs(sum(advs)) < 1e-4 * max(1, len(advs)), advs
    assert roles_seen == {"act", "rehearse"}  # both roles are trained
    # EnvSched's cold start takes one task of each environment: step 1 trained both kinds
    sel_a = selections(a)
    assert sorted(sel_a) == [1, 2] and all(len(v) == 2 for v in sel_a.values())
    assert {env_of(t) for t in sel_a[1]} == {SIMULATED, REHEARSED}
    assert set(by_env) == {env_of(t) for v in sel_a.values() for t in v}
    # the simulated environment: the envace_simulator loop, the acting role only, calls answered by the worldbook
    sim = by_env[SIMULATED]
    assert {r["observation_source"] for r in sim} == {"simulator"} and {r["role"] for r in sim} == {"act"}
    assert sum(r["simulated_calls"] for r in sim) > 0
    # the other: rehearsed by the policy (both roles), its calls executed in the real environment, none simulated
    reh = by_env[REHEARSED]
    assert {r["observation_source"] for r in reh} == {"rehearse"} and {r["role"] for r in reh} == {"act", "rehearse"}
    assert all(r["simulated_calls"] == 0 for r in reh)
    # answered calls, simulated or rehearsed, were compared with the real environment's responses (the shadow)
    assert sum(step_metrics(out_a, step).get("envace/rehearsal_fidelity/compared", 0.0) for step in (1, 2)) > 0
    assert "val-core/synthetic" in out_a and "envace: training finished" in out_a
    assert (a / "global_step_1" / "envsched.pt").is_file() and (a / "global_step_2" / "actor").is_dir()

    # B: only A's step-1 checkpoint
    b = tmp_path / "b"
    b.mkdir()
    shutil.copytree(a / "global_step_1", b / "global_step_1")
    (b / "latest_checkpointed_iteration.txt").write_text("1")
    out_b = train_sh(b, *overrides)
    assert "Resuming from" in out_b and "global_step_1" in out_b
    assert not re.search(r"\bstep:1 - ", out_b)
    m = step_metrics(out_b, 2)
    # the resumed run's rollout server was synced from the restored actor, not left on its dummy weights
    sync_holds(m, b)
    assert (b / "global_step_2" / "actor").is_dir()
    assert selections(b) == {2: sel_a[2]}

    # the resumed run's checkpoint, exported to a Hugging Face checkpoint, is what `vllm serve` evaluates
    hf = tmp_path / "hf"
    exported = subprocess.run([sys.executable, "-m", "envace.models", "export", str(b), str(hf)], capture_output=True,
                              text=True, timeout=600, check=False)
    assert exported.returncode == 0, exported.stderr[-3000:]
    with launch_server(str(hf), "vllm", startup_timeout=600, log_path=tmp_path / "serve.log",
                       extra_args=["--enforce-eager", "--max-model-len=4096"]) as srv:
        reply = OpenAI(base_url=srv.base_url, api_key="unused").chat.completions.create(
            model=srv.model, messages=[{"role": "user", "content": "List the files."}], max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens > 0 and reply.choices[0].message.role == "assistant"
