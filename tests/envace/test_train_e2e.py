"""End to end on CPU through scripts/train.sh and the project's own config.

Run A trains 3 steps of GRPO with EnvSched choosing the batches (verl's real V1 trainer, FSDP2 on
gloo, the hfcpu rollout, BFCL tasks scored by the official checker), checkpointing at steps 2 and 3.
Run B starts from a copy of A's step-2 checkpoint only, resumes (model, optimizer, dataloader and
scheduler state) and runs step 3: its batch must equal the batch A chose at step 3 uninterrupted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

FAST = [
    "experiment=cpu_envsched",
    "data.max_response_length=96",
    "trainer.test_freq=-1",
    "trainer.logger=[console,file]",
    "trainer.total_training_steps=3",
    "trainer.save_freq=2",
]


def train(run_dir: Path, *overrides: str, timeout: int = 1500) -> str:
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [str(REPO / "scripts" / "train.sh"), f"trainer.default_local_dir={run_dir}", *FAST, *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    return out


def step_metrics(out: str, step: int) -> dict[str, float]:
    line = next(ln for ln in out.splitlines() if re.search(rf"\bstep:{step} - ", ln))
    return {k: float(v) for k, v in re.findall(r"([\w/@.-]+):(-?[\d.]+(?:e-?\d+)?)(?= - |$)", line)}


def selections(run_dir: Path) -> dict[int, list[str]]:
    lines = (run_dir / "envsched_selections.jsonl").read_text().splitlines()
    return {rec["step"]: rec["task_ids"] for rec in map(json.loads, lines)}


def test_train_checkpoint_resume_and_envsched_state(tmp_path):
    a = tmp_path / "a"
    out_a = train(a)
    for step in (1, 2, 3):
        m = step_metrics(out_a, step)
        # the rollout server and the FSDP actor hold the same weights after every sync
        assert m["training/rollout_probs_diff_max"] < 1e-2, m["training/rollout_probs_diff_max"]
        assert 0.0 <= m["critic/score/mean"] <= 1.0
        assert m["envsched/batch_size"] == 2 and m["envsched/observed_groups"] == 2
        assert 0.0 <= m["envsched/realized_var_mean"] <= 0.25
    assert (a / "global_step_2" / "envsched.pt").is_file() and (a / "global_step_3" / "actor").is_dir()
    assert "envace: training finished" in out_a
    assert [p.stem for p in sorted((a / "rollouts").glob("*.jsonl"))] == ["1", "2", "3"]
    assert list((a / "metrics").glob("metrics-*.jsonl"))
    sel_a = selections(a)
    assert sorted(sel_a) == [1, 2, 3] and all(len(v) == 2 for v in sel_a.values())

    # B: only A's step-2 checkpoint (and A's selection log up to step 2)
    b = tmp_path / "b"
    b.mkdir()
    shutil.copytree(a / "global_step_2", b / "global_step_2")
    (b / "latest_checkpointed_iteration.txt").write_text("2")
    out_b = train(b)
    assert "Resuming from" in out_b and "global_step_2" in out_b
    assert not re.search(r"\bstep:1 - ", out_b) and not re.search(r"\bstep:2 - ", out_b)
    step_metrics(out_b, 3)
    assert (b / "global_step_3" / "actor").is_dir()
    assert selections(b) == {3: sel_a[3]}
