"""End to end on CPU against an environment served apart from the trainer (issue 45): the default recipe
(``cpu_default``: EnvACE on the synthetic pool's ``act`` tasks, the warm-started tiny Qwen3) trained on the synthetic
pool served over OpenEnv on localhost (``python -m envace.envs serve --protocol openenv``), consumed through the
``openenv`` pool from verl's agent-loop workers.

Mid-run, while step 2's rollouts hold sessions on the server, the server is killed (SIGKILL, every process of it) and
started again on the same port. The run goes on: the rollouts that lost their session are masked and counted (stop
reason ``env_unavailable``), none is scored as the model's failure, the episodes that start during the restart wait
for the server, and the next step trains on the restarted server. The rewards of the steps the kill did not touch are
those of the same actions replayed in process (a digest over every trajectory).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest
from omegaconf import OmegaConf

from envace.envs.base import ToolCall, get_pool
from envace.eval.server import free_port
from envace.launch import STEP_LINE
from envace.metrics import load_metrics
from envace.toolcall import parse_tool_calls
from envace.verl.config import compose

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.warm_start]

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
KILL_STEP = 2


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


def test_the_default_recipe_trains_on_a_served_pool_through_a_server_restart(tmp_path):
    cfg = compose(["experiment=cpu_default"])
    kwargs = OmegaConf.to_container(cfg.envace.agent.pool_kwargs.synthetic, resolve=True)
    max_calls = int(cfg.envace.agent.limits.max_calls_per_message)
    server = Server(free_port(), kwargs).start()
    run = tmp_path / "run"
    cmd = [str(REPO / "scripts" / "train.sh"), "experiment=cpu_default", f"trainer.default_local_dir={run}",
           # the synthetic pool, served: its tasks and gold from the server's catalogue, every call over the socket
           "envace.data.pools=[openenv]",
           f"+envace.agent.pool_kwargs.openenv={{urls:['http://127.0.0.1:{server.port}'],connect_timeout_s:300}}",
           f"trainer.total_training_steps={STEPS}", "trainer.save_freq=-1", f"trainer.test_freq={STEPS}",
           "trainer.val_before_train=false", "data.val_max_samples=4", "trainer.logger=[console,file]"]
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    killed_with = 0
    try:
        # once step 1 is logged, step 2's rollouts open their sessions: kill the server while some are open
        deadline = time.monotonic() + 1800
        while str(KILL_STEP - 1) not in {s for ln in list(lines) for s in STEP_LINE.findall(ln)}:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-6000:]
            time.sleep(0.5)
        while not killed_with:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-6000:]
            killed_with = server.sessions()
            if killed_with:
                server.kill()
            time.sleep(0.02)
        server.start()  # the same port: the episodes starting meanwhile wait for it (connect_timeout_s)
        proc.wait(timeout=1800)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)
        server.kill()
    out = "".join(lines)
    assert proc.returncode == 0 and "envace: training finished" in out, out[-8000:]
    series = load_metrics(run)  # the run's metrics/*.jsonl, per step
    metrics = {s: {k: v[s] for k, v in series.items() if s in v} for s in range(1, STEPS + 1)}
    # the rollouts in flight at the kill were masked and counted as the environment's outage, never the model's
    hit = metrics[KILL_STEP]  # a lost call stops its rollout (env_unavailable); a lost verification masks it too
    assert hit["envace/masked_rate"] > 0, hit
    assert not any(k.endswith("stop_reason/model_error") for m in metrics.values() for k in m)
    # before and after the kill, nothing was lost: every trajectory scored, on the same server protocol
    for step in (1, STEPS):
        assert metrics[step]["envace/masked_rate"] == 0.0, metrics[step]
        assert "envace/stop_reason/env_unavailable" not in metrics[step]
    # the served rewards are the in-process replay's for the same actions (the kill step's masked ones aside)
    pool = get_pool("synthetic", **kwargs)
    digest = [row for step in (1, STEPS) for row in replayed_rewards(run, step, pool, max_calls)]
    assert digest and all(served == local for _, served, local in digest), [d for d in digest if d[1] != d[2]]
    assert any(served > 0 for _, served, _ in digest)  # the digest compares passes, not only failures
    print(f"served run: killed with {killed_with} session(s) open; step {KILL_STEP} masked rate "
          f"{hit['envace/masked_rate']:.3f} (stopped by the outage: "
          f"{hit.get('envace/stop_reason/env_unavailable', 0.0):.3f}); digest {len(digest)} trajectories agree")
