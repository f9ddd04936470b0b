"""EnvACE's role-wise GRPO (act + rehearse, as ``experiment=cpu_default`` runs it) learns on CPU: the run's reward
rises over its own control steps (the measure and the settings: ``conftest.py`` of this folder; measured figures:
``docs/results/learning.md``).

The same run is the served environment's end to end (issue 45): its pool is served over OpenEnv apart from the
trainer and restarted while the first learning step's rollouts hold sessions on it (``conftest.KILL_STEP``). The
run goes on: the rollouts that lost their session are masked and counted (stop reason ``env_unavailable``), none is
scored as the model's failure, the episodes that start during the restart wait for the server, and the next steps
train on the restarted one. The rewards of every step the kill did not touch are those of the same actions replayed
in process (a digest over every trajectory).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from envace.envs.base import ToolCall, get_pool
from envace.toolcall import parse_tool_calls
from envace.verl.config import compose

# a whole training run (its fixture set-up counts toward its first test): more than CI's 1800 s default under load
pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.warm_start, pytest.mark.timeout(3600)]

ESTIMATOR = "grpo_rolewise"


def test_control_without_updates_does_not_drift(run, learning):
    learning.control_does_not_drift(run)


def test_training_raises_the_reward_over_the_control(run, learning):
    learning.training_raises_the_reward(run)


def replayed_rewards(run_dir: Path, step: int, pool, max_calls: int) -> list[tuple[str, float, float]]:
    """(task, the run's reward, the in-process replay's reward) of every trajectory of ``step``'s rollout dump: the
    acting outputs' tool calls in order (at most ``max_calls`` a message, as the turn engine answers them)."""
    rows = [json.loads(line) for line in (run_dir / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
    by_traj: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["role"] == "act" and not r["uid"].startswith("pad"):
            by_traj[r["trajectory_id"]].append(r)
    out = []
    for outputs in by_traj.values():
        outputs.sort(key=lambda r: int(r["uid"].rsplit("_", 1)[1]))
        calls = [ToolCall(c.name, c.arguments) for r in outputs for c in parse_tool_calls(r["output"]).calls[:max_calls]]
        task = outputs[0]["task_id"]
        out.append((task, float(outputs[0]["score"]), pool.replay(task, [calls]).reward))
    return out


def test_the_served_pool_restarts_without_a_lost_or_misscored_rollout(run, learning):
    """The rollouts in flight at the kill were masked and counted as the environment's outage, never the model's;
    every other step lost nothing and scored as the in-process pool scores the same actions."""
    kill_step = learning.kill_step
    metrics = {s: {k: v[s] for k, v in run.metrics.items() if s in v} for s in sorted(run.metrics["critic/score/mean"])}
    assert run.killed_with > 0
    hit = metrics[kill_step]  # a lost call stops its rollout (env_unavailable); a lost verification masks it too
    assert hit["envace/masked_rate"] > 0, hit
    assert not any(k.endswith("stop_reason/model_error") for m in metrics.values() for k in m)
    others = [s for s in metrics if s != kill_step]
    for step in others:
        assert metrics[step]["envace/masked_rate"] == 0.0, (step, metrics[step])
        assert "envace/stop_reason/env_unavailable" not in metrics[step], (step, metrics[step])
    max_calls = int(compose(["experiment=cpu_default"]).envace.agent.limits.max_calls_per_message)
    pool = get_pool("synthetic", **run.pool_kwargs)
    digest = [row for step in others for row in replayed_rewards(run.out, step, pool, max_calls)]
    assert digest and all(served == local for _, served, local in digest), [d for d in digest if d[1] != d[2]]
    assert any(served > 0 for _, served, _ in digest)  # the digest compares passes, not only failures
    print(f"served run: killed with {run.killed_with} session(s) open; step {kill_step} masked rate "
          f"{hit['envace/masked_rate']:.3f} (stopped by the outage: "
          f"{hit.get('envace/stop_reason/env_unavailable', 0.0):.3f}); digest {len(digest)} trajectories agree")
