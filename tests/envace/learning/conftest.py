"""Learning you can see on CPU: GRPO and EnvACE's role-wise GRPO, through ``scripts/train.sh`` and verl's real
trainer, raise the reward; the same run's steps without updates do not.

Each run trains on 8 fixed synthetic training tasks with the warm-started tiny Qwen3, rollouts sampled at temperature
1.0, one optimizer step per batch of all 8 tasks x 4 rollouts. The measure is the on-policy training reward
(``critic/score/mean``, the pool's verifier on the real environment's state).

* ``grpo``: plain GRPO acting in the real environment, one training sample per trajectory.
* ``grpo_rolewise``: EnvACE as ``experiment=cpu_default`` runs it: the policy acts and rehearses every tool
  response (both at the rollout temperature), one training sample per generation, act and rehearse advantages
  with separate baselines within each task's group; the reward is the verifier on a real-environment replay of
  the calls. **Its environment is served apart from the trainer** (``Estimator.served``): the synthetic pool over
  OpenEnv on localhost (``python -m envace.envs serve --protocol openenv``), consumed through the ``openenv`` pool
  from verl's agent-loop workers, and killed (SIGKILL, every process of it) and started again on the same port while
  the first learning step's rollouts hold sessions on it. So the suite's one EnvACE learning run is also its served
  environment's end-to-end run (``test_grpo_rolewise.py`` checks what the restart must leave: the rollouts in flight
  masked as the environment's outage, never the model's failure, and every other step's rewards those of the same
  actions replayed in process). The kill lands on a learning step, never on a control step or the last ``WINDOW``,
  so the learning checks' means are over whole steps.

**The tasks are chosen by the warm start's measured success, not by position** (``learnable_tasks``): the first
``CANDIDATES`` training tasks (the data build's seeded order) are each rolled out ``PROBE_SAMPLES`` times at the
training temperature in the real environment (``envace.models.warmstart.task_success``), and the 8 with the largest
p(1 - p) are trained, as learnability sampling picks them. A GRPO group learns only where its rollouts differ, so a
weaker or stronger warm-start build (they differ with the CPU and the load: the copy circuit's step count moves)
changes which tasks are trained, not whether the run can learn (the first 8 tasks by position can all sit where
every rollout fails, which leaves a GRPO group nothing to learn from). A build with fewer than 8 candidate tasks inside the
band fails the run, naming the count: that is a broken warm start, not bad luck.

Each estimator (``ESTIMATORS``) runs once: its first ``CONTROL_STEPS`` steps only generate and score (verl's
``trainer.critic_warmup``), so their mean is the initial policy's reward, the control; the next ``Estimator.steps``
steps update the policy. The learning steps' last ``WINDOW`` must beat the control's mean by ``MARGIN``.

False-failure rate. Both means are over 4 x 32 rollouts of the same 8 tasks, so their difference has a sampling
standard error of at most sqrt(2 x 0.25 / 128) = 0.063. A run fails by chance when that noise takes a true rise
of delta below ``MARGIN``: probability Phi((MARGIN - delta) / 0.063), under 1 % for delta >= MARGIN + 2.33 x 0.063
= 0.247. The rises measured on band-chosen tasks, and so the rate each check runs at, are in
``docs/results/learning.md``; ``Estimator.steps`` is set so that the measured rise clears 0.247. The control's
drift check is three standard errors wide (a chance failure rate of 0.13 %).

What this catches: a sign error in the advantage, a mask that trains the environment's tokens or no tokens, a
weight sync that never reaches the rollout server, an optimizer that does not step: each leaves the reward flat (or
falling) at the control's level, which passes with probability Phi((0 - MARGIN) / 0.063) = 6 % at most.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from omegaconf import OmegaConf

from envace.metrics import load_metrics

REPO = Path(__file__).resolve().parents[3]

TASKS = 8  # training tasks of a run
CANDIDATES = 32  # tasks probed, the first of the data build's seeded order of the train split
PROBE_SAMPLES = 6  # rollouts per candidate at the training temperature

WINDOW = 4  # the last learning steps, averaged
CONTROL_STEPS = 4  # first steps, without updates, all averaged: the initial policy's reward (4 x 32 rollouts)
MARGIN = 0.1  # the last window must exceed the control's mean reward by this much
ROLLOUTS_PER_STEP = 8 * 4  # data.train_batch_size x rollout.n below
COMMON = [
    "experiment=cpu_default",
    # verl's own vLLM replica on vLLM's CPU build: the weight sync and log-probs GPU users train with
    "actor_rollout_ref.rollout.name=vllm",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.rollout.temperature=1.0",
    # steps before this one only generate and score: the control
    f"trainer.critic_warmup={CONTROL_STEPS + 1}",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.logger=[console,file]",
]


@dataclass(frozen=True)
class Estimator:
    steps: int  # optimizer steps after the control steps
    overrides: tuple[str, ...]
    shapes: tuple[str, ...] | None = None  # task shapes the candidates are drawn from (None: all)
    served: bool = False  # the pool served over OpenEnv and restarted mid-run (``KILL_STEP``), not in process


ESTIMATORS = {
    # plain GRPO, acting in the real environment, one training sample per trajectory
    "grpo": Estimator(8, (
        "algorithm.adv_estimator=grpo",
        "envace.agent.observation_source=real",
        "envace.agent.act_layout=trajectory",
        "actor_rollout_ref.actor.optim.lr=2e-3",
    )),
    # EnvACE as cpu_default runs it: act + rehearse, one sample per generation, role-wise advantages
    # (candidates: ``act`` tasks, whose reward, the real environment's replay of the actor's write, does not depend on
    # what the rehearsals said, so the warm start's real-environment success measures it; on an answer task the
    # answer comes from a rehearsed observation, and the initial reward was 0.0 to 0.02 on the band's query tasks)
    # (both roles sample at the rollout temperature: verl scores every trained output at it)
    # (9 learning steps: the served pool's restart masks the first one's rollouts, all of them in flight at the kill,
    # which leaves the 8 updates the rises in docs/results/learning.md were measured after)
    "grpo_rolewise": Estimator(9, (
        "actor_rollout_ref.actor.optim.lr=1e-3",
    ), shapes=("act",), served=True),
}
CONTROL = range(1, CONTROL_STEPS + 1)
#: the step whose rollouts lose the served pool: the first learning step (after the control, before the window)
KILL_STEP = CONTROL_STEPS + 1


def mean(series: dict[int, float], steps: range) -> float:
    return sum(series[s] for s in steps) / len(steps)


def learnable_tasks(shapes: tuple[str, ...] | None = None) -> list[str]:
    """The ``TASKS`` candidates (of ``shapes``) with the largest p(1 - p) under the warm start (ties: the seeded
    order)."""
    from envace.data.datasets import stable_order
    from envace.models.warmstart import learning_pool, task_success

    pool = learning_pool()
    ids = [t for t in pool.task_ids("train") if shapes is None or pool.task(t).category in shapes]
    candidates = stable_order(ids, 0)[:CANDIDATES]
    threads = int(os.environ.get("ENVACE_TRAINER_THREADS", "1"))  # scripts/test.sh sizes it for its slow workers
    p = task_success(candidates, PROBE_SAMPLES, temperature=1.0, pool=pool, threads=threads)
    ranked = sorted(candidates, key=lambda t: -p[t] * (1 - p[t]))[:TASKS]
    inside = [t for t in ranked if 0 < p[t] < 1]
    print("learnable tasks:", {t: p[t] for t in ranked}, flush=True)
    assert len(inside) == TASKS, (
        f"the warm start solves only {len(inside)} of {CANDIDATES} candidate tasks sometimes but not always "
        f"({PROBE_SAMPLES} rollouts each at temperature 1.0): {p}; rebuild it (python -m envace.models build "
        "--warm-start --force)")
    return ranked


@dataclass
class Run:
    """A finished run: its estimator, per-metric series by step and folder; for a served run, the pool's options and
    the sessions open on the server when it was killed."""

    estimator: str
    metrics: dict[str, dict[int, float]]
    out: Path
    pool_kwargs: dict = field(default_factory=dict)
    killed_with: int = 0


class Server:
    """``python -m envace.envs serve --pool synthetic --protocol openenv`` on a fixed port, in its own process group."""

    def __init__(self, port: int, pool_kwargs: dict) -> None:
        self.port, self.pool_kwargs = port, pool_kwargs
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Server:
        cmd = [sys.executable, "-m", "envace.envs", "--pool-kwargs", json.dumps({"synthetic": self.pool_kwargs}),
               "serve", "--pool", "synthetic", "--protocol", "openenv", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        line = self.proc.stdout.readline()  # its one line once it listens
        assert f"at http://127.0.0.1:{self.port}" in line, line + self.proc.stdout.read()[-3000:]
        return self

    def sessions(self) -> int:
        """WebSocket sessions open on the server now (established TCP connections to its port)."""
        return sum(c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == self.port
                   for c in psutil.net_connections(kind="tcp"))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def train_through_a_restart(out: Path, overrides: list[str], pool_kwargs: dict) -> int:
    """``scripts/train.sh OVERRIDES`` on the synthetic pool served over OpenEnv, the server killed while
    ``KILL_STEP``'s rollouts hold sessions on it and started again on the same port (the episodes that start
    meanwhile wait for it: ``connect_timeout_s``); asserts exit 0 and returns the sessions open at the kill."""
    from envace.eval.server import free_port
    from envace.launch import STEP_LINE

    server = Server(free_port(), pool_kwargs).start()
    cmd = [str(REPO / "scripts" / "train.sh"), f"trainer.default_local_dir={out}", *overrides,
           "envace.data.pools=[openenv]",
           f"+envace.agent.pool_kwargs.openenv={{urls:['http://127.0.0.1:{server.port}'],connect_timeout_s:300}}"]
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    killed_with = 0
    try:
        # once the step before is logged, KILL_STEP's rollouts open their sessions: kill the server while some are open
        deadline = time.monotonic() + 3000
        while str(KILL_STEP - 1) not in {s for ln in list(lines) for s in STEP_LINE.findall(ln)}:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-6000:]
            time.sleep(0.5)
        while not killed_with:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-6000:]
            killed_with = server.sessions()
            if killed_with:
                server.kill()
            time.sleep(0.02)
        server.start()
        proc.wait(timeout=3000)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)
        server.kill()
    text = "".join(lines)
    assert proc.returncode == 0 and "envace: training finished" in text, text[-8000:]
    return killed_with


@pytest.fixture(scope="module")
def run(request, tmp_path_factory, train_sh) -> Run:
    """The run of the test file's estimator (its module's ``ESTIMATOR``) on ``learnable_tasks``:
    ``CONTROL_STEPS`` steps without updates, then its learning steps."""
    from envace.verl.config import compose

    name = request.module.ESTIMATOR
    est = ESTIMATORS[name]
    out = tmp_path_factory.mktemp(name)
    total = CONTROL_STEPS + est.steps
    tasks = ",".join(f"'{t}'" for t in learnable_tasks(est.shapes))
    overrides = [*COMMON, f"envace.data.train_task_ids=[{tasks}]", f"trainer.total_training_steps={total}",
                 *est.overrides]
    result = Run(name, {}, out)
    if est.served:
        assert CONTROL_STEPS < KILL_STEP <= total - WINDOW
        cfg = compose(["experiment=cpu_default"])
        result.pool_kwargs = OmegaConf.to_container(cfg.envace.agent.pool_kwargs.synthetic, resolve=True)
        result.killed_with = train_through_a_restart(out, overrides, result.pool_kwargs)
    else:
        train_sh(out, *overrides, timeout=3000)
    result.metrics = metrics = load_metrics(out)
    steps = sorted(metrics["critic/score/mean"])
    assert steps == list(range(1, total + 1)), steps
    # the control steps did not update the actor, every learning step did
    assert sorted(metrics["actor/grad_norm"]) == list(range(CONTROL_STEPS + 1, total + 1))
    return result


def control_does_not_drift(run: Run) -> None:
    """The control's second half does not beat its first by more than sampling noise explains: MARGIN, or three
    standard errors of the difference of two means of binary rewards (at the control's mean p, 0.077 at p = 0.25
    with 64 rollouts a half), whichever is larger — at MARGIN alone a GRPO control at p = 0.25 would fail one run
    in ten by chance. (That no update happens in these steps is asserted in ``run``, from ``actor/grad_norm``.)"""
    metrics = run.metrics
    reward, half = metrics["critic/score/mean"], CONTROL_STEPS // 2
    first, last = mean(reward, range(1, half + 1)), mean(reward, range(half + 1, CONTROL_STEPS + 1))
    p = mean(reward, CONTROL)
    se = math.sqrt(2 * p * (1 - p) / (half * ROLLOUTS_PER_STEP))
    assert last - first < max(MARGIN, 3 * se), (first, last, se, reward)


def training_raises_the_reward(run: Run) -> None:
    """The learning steps' last ``WINDOW`` beat the control's mean by ``MARGIN``, with non-zero gradients."""
    estimator, metrics = run.estimator, run.metrics
    reward = metrics["critic/score/mean"]
    total = max(reward)  # the last step
    control, last = mean(reward, CONTROL), mean(reward, range(total - WINDOW + 1, total + 1))
    assert last >= control + MARGIN, (estimator, control, last, reward)
    # the updates are real: non-zero gradients on steps with reward variance
    assert max(metrics["actor/grad_norm"].values()) > 0, metrics["actor/grad_norm"]


@pytest.fixture
def learning() -> SimpleNamespace:
    """The two checks every estimator's file runs on its ``run``, and the step a served run's pool is killed in."""
    return SimpleNamespace(
        control_does_not_drift=control_does_not_drift, training_raises_the_reward=training_raises_the_reward,
        kill_step=KILL_STEP,
    )
