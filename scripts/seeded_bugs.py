#!/usr/bin/env python
"""Seeded-bug probe (issue 14): each bug kind the issue lists, applied by hand, must fail a fast test.

    .venv/bin/python scripts/seeded_bugs.py                    # every bug below, one after the other
    .venv/bin/python scripts/seeded_bugs.py --only c3_window   # chosen bugs
    .venv/bin/python scripts/seeded_bugs.py --jobs 2           # bugs probed in parallel (default 1)
    .venv/bin/python scripts/seeded_bugs.py --list             # the bugs, their files and tests

Not part of CI: one bug costs a scratch copy and a pytest run (about 20 s to a minute on 2 cores). For each
bug the work tree as git sees it (tracked and untracked-not-ignored files, like scripts/mutation.sh) is copied
to a scratch folder, the one source replacement is applied there (the work tree itself is never touched), and
the bug's fast tests run with ``-m "not slow" -x``. A bug is CAUGHT when a test fails, MISSED when all pass.
The script stops with an error if a replacement's ``old`` text does not occur exactly once, so an edit of the
code cannot turn a bug into a no-op unnoticed. Exit status: 0 when every probed bug is caught, 1 when one is not
(MISSED, a pytest error or a time-out), 2 when the probe itself is stale.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "LITELLM_LOCAL_MODEL_COST_MAP": "True", "OMP_NUM_THREADS": "1"}
TIMEOUT_S = 900  # one bug's test run; a hang is reported as TIMEOUT (not caught)


@dataclasses.dataclass(frozen=True)
class Bug:
    name: str
    issue: str  # the bug kind, as issue 14 words it
    file: str
    old: str  # occurs exactly once in ``file``
    new: str
    tests: tuple[str, ...]  # test files or node ids (the smallest set that catches it)


BUGS = [
    # -- EnvSched estimation (envsched/estimate.py) --------------------------------------------------------
    Bug("est_no_centering", "Eq. 6's centring dropped inside the half-life estimate", "envsched/estimate.py",
        "y_tilde = center(vals, step_means[inv], b_t, intervals[y])",
        "y_tilde = vals",
        ("tests/envsched/test_estimate.py",)),
    Bug("est_unobserved_neighbours", "neighbours with no history still counted", "envsched/estimate.py",
        "avail = (idx >= 0) & (W[safe] > 0)",
        "avail = idx >= 0",
        ("tests/envsched/test_estimate.py",)),
    Bug("est_lambda_swap", "lambda_g and lambda_s swapped", "envsched/estimate.py",
        "level = environment_reference(ybars[y], W, env, out[\"b\"][y], cfg.lambda_g)\n"
        "            G[rel] = relation_estimate(a, relation_values(ybars[y], safe, level, intervals[y]), out[\"b\"][y], cfg.lambda_g)\n"
        "        P = graph_prior(G[\"in\"], G[\"cross\"], mass[\"in\"], mass[\"cross\"], out[\"b\"][y], cfg.lambda_g, cfg.fusion_within, cfg.fusion)\n"
        "        out[y] = fuse_prior(P, W, ybars[y], cfg.lambda_s)",
        "level = environment_reference(ybars[y], W, env, out[\"b\"][y], cfg.lambda_s)\n"
        "            G[rel] = relation_estimate(a, relation_values(ybars[y], safe, level, intervals[y]), out[\"b\"][y], cfg.lambda_s)\n"
        "        P = graph_prior(G[\"in\"], G[\"cross\"], mass[\"in\"], mass[\"cross\"], out[\"b\"][y], cfg.lambda_s, cfg.fusion_within, cfg.fusion)\n"
        "        out[y] = fuse_prior(P, W, ybars[y], cfg.lambda_g)",
        ("tests/envsched/test_estimate.py",)),
    # -- scheduling (envsched/scheduler.py) ----------------------------------------------------------------
    Bug("c3_window", "the C3 rolling window off by one", "envsched/scheduler.py",
        "for s in range(step - cfg.cap_env_window_steps + 1, step):",
        "for s in range(step - cfg.cap_env_window_steps, step):",
        ("tests/envsched/test_scheduler.py",)),
    Bug("no_exposure_factor", "the exposure factor omega left out of exploitation", "envsched/scheduler.py",
        "score = q * exposure_factor(self.sel_count, cfg.exposure_c0)",
        "score = q",
        ("tests/envsched/test_scheduler.py",)),
    Bug("resume_forgets_available", "load_state_dict forgets `available` (filtered tasks come back)",
        "envsched/scheduler.py",
        "        self.available = np.asarray(state[\"available\"], dtype=bool).copy()\n",
        "",
        ("tests/envsched/test_scheduler.py",)),
    # -- agent-loop limits (envace/agents/engine.py, verl_loop.py) -----------------------------------------
    Bug("no_budget_stop", "the response-budget stop removed", "envace/agents/engine.py",
        "                    if reply.budget_exhausted:\n"
        "                        t.stop_reason = StopReason.TOKEN_BUDGET\n"
        "                        return t\n",
        "",
        ("tests/envace/agents/test_engine.py",)),
    Bug("call_cap", "the per-message tool-call cap off by one", "envace/agents/engine.py",
        "if i >= limits.max_calls_per_message:",
        "if i > limits.max_calls_per_message:",
        ("tests/envace/agents/test_engine.py",)),
    Bug("user_turn_cap", "the user-turn cap off by one", "envace/agents/engine.py",
        "if t.user_turns >= limits.max_user_turns:",
        "if t.user_turns > limits.max_user_turns:",
        ("tests/envace/agents/test_engine.py",)),
    Bug("generation_not_capped", "each generation not capped by the budget left (the output's final slice "
        "still bounds its length: the old test_env_loop.py test could not fail)", "envace/agents/verl_loop.py",
        "if self.cfg.act_max_tokens else left",
        "if self.cfg.act_max_tokens else self.budget",
        ("tests/envace/agents/test_verl_loop.py::test_response_budget_stops_the_episode_and_caps_each_generation",)),
    # -- evaluation store (envace/eval/store.py) -----------------------------------------------------------
    Bug("store_first_wins", "'first record wins' instead of 'last record wins'", "envace/eval/store.py",
        "records[rec.task_id] = rec",
        "records.setdefault(rec.task_id, rec)",
        ("tests/envace/eval/test_eval_store.py",)),
    # -- rollout (envace/platform/rollout.py, hfcpu) -------------------------------------------------------
    Bug("repetition_penalty_inverted", "the repetition penalty inverted", "envace/platform/rollout.py",
        "torch.where(pen > 0, pen / spec.repetition_penalty,\n"
        "                                                      pen * spec.repetition_penalty)",
        "torch.where(pen > 0, pen * spec.repetition_penalty,\n"
        "                                                      pen / spec.repetition_penalty)",
        ("tests/envace/platform/test_hfcpu_sampling.py::test_repetition_penalty_pushes_greedy_decoding_off_the_tokens_already_seen",)),
    # -- role-wise GRPO (envace/advantage.py) --------------------------------------------------------------
    Bug("roles_pooled", "roles pooled into one baseline instead of one per role", "envace/advantage.py",
        "keys = np.stack([prompt_code, role_code], axis=1)",
        "keys = np.stack([prompt_code, np.zeros_like(role_code)], axis=1)",
        ("tests/envace/test_advantage.py::test_output_baseline_is_row_weighted_per_role",)),
    # -- ECHO's observation loss (envace/verl/observation_loss.py) ------------------------------------------
    Bug("observation_loss_on_actions", "the observation loss reaches the policy's own (action) tokens",
        "envace/verl/observation_loss.py",
        "return inside & (mask == 0) & trained_row",
        "return inside & trained_row",
        (("tests/envace/verl/test_observation_loss.py::"
          "test_the_policy_gradient_skips_observations_and_the_observation_loss_covers_exactly_them"),)),
    # -- glue that used to be untested ---------------------------------------------------------------------
    Bug("envsched_pt_not_restored", "envace/verl/trainers.py: the trainer's resume skips restoring envsched.pt",
        "envace/verl/trainers.py",
        "        load_scheduler_state(self.scheduler, path)\n",
        "",
        ("tests/envace/verl/test_sched_adapter.py::test_the_trainer_writes_envsched_pt_with_each_checkpoint_and_restores_it_on_resume",)),
    Bug("envsched_pt_not_saved", "envace/verl/trainers.py: a checkpoint without envsched.pt",
        "envace/verl/trainers.py",
        "        save_scheduler_state(self.scheduler, folder / STATE_FILE)\n",
        "",
        ("tests/envace/verl/test_sched_adapter.py::test_the_trainer_writes_envsched_pt_with_each_checkpoint_and_restores_it_on_resume",)),
    Bug("load_weights_drops_one", "HFCPUServer.load_weights ignores a tensor", "envace/platform/rollout.py",
        "self.model.load_state_dict(state_dict, strict=False)",
        "self.model.load_state_dict(dict(list(state_dict.items())[:-1]), strict=False)",
        ("tests/envace/platform/test_hfcpu_server.py::test_load_weights_changes_what_is_generated_and_rejects_foreign_tensors",)),
    Bug("fit_prompts_limit", "train.fit_prompts off by one", "envace/train.py",
        "<= max_prompt_length)",
        "< max_prompt_length)",
        ("tests/envace/test_train_glue.py::test_fit_prompts_limit_is_inclusive",)),
    Bug("eval_cli_limits_ignored", "eval CLI: the loop-limit flags never reach the run", "envace/eval/cli.py",
        "limits=limits_from_args(args),",
        "limits=LoopLimits(),",
        ("tests/envace/eval/test_eval_cli.py::test_the_loop_limit_flags_reach_the_run",)),
    Bug("console_script_argv", "the `envace` console script passes its command name on", "envace/cli.py",
        "return int(module.main(rest) or 0)",
        "return int(module.main(args) or 0)",
        ("tests/envace/test_cli.py",)),
    Bug("vllm_sync_no_finalize", "vLLM CPU weight sync skips the layer-wise reload's finalize step",
        "envace/platform/vllm_cpu.py",
        "        finalize_layerwise_reload(model, self.model_runner.model_config)\n",
        "        pass\n",
        ("tests/envace/platform/test_vllm_cpu_sync.py",)),
]


def copy_tree(dest: Path) -> None:
    """The work tree as git sees it (tracked and untracked-not-ignored files) into ``dest``."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    for rel in filter(None, out.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():  # a deleted, not yet staged file is still listed
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def die(message: str) -> NoReturn:
    """A probe that cannot be trusted (a stale bug, a copy that is not imported): exit status 2."""
    print(f"seeded_bugs.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def seeded(bug: Bug, text: str) -> str:
    """``text`` (the current ``bug.file``) with the bug in it; stops the whole probe unless ``old`` occurs once."""
    n = text.count(bug.old)
    if n != 1:
        die(f"{bug.name}: the old text occurs {n} times in {bug.file} (expected once); "
                         f"update the bug to the current code:\n{bug.old}")
    return text.replace(bug.old, bug.new)


def probe(bug: Bug, python: str) -> tuple[str, list[str], float, str]:
    """(verdict, failing tests, seconds, pytest output tail) of one bug."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"seeded-{bug.name}-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        path = tree / bug.file
        path.write_text(seeded(bug, path.read_text(encoding="utf-8")), encoding="utf-8")
        # PYTHONPATH: subprocesses the tests start (console script, servers) import the copy too
        env = {**os.environ, **ENV, "PYTHONPATH": str(tree)}
        top = bug.file.split("/")[0]
        origin = subprocess.run([python, "-c", f"import importlib.util as u; print(u.find_spec({top!r}).origin)"],
                                cwd=tree, env=env, capture_output=True, text=True, check=False).stdout.strip()
        if not origin.startswith(str(tree)):
            die(f"{bug.name}: {top} imports from {origin}, not from the scratch copy")
        cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-m", "not slow", "-q", "-x", "-rfE", *bug.tests]
        try:
            run = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return "TIMEOUT", [], time.monotonic() - t0, ""
    out = run.stdout + run.stderr
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.MULTILINE)
    verdict = {0: "MISSED", 1: "CAUGHT"}.get(run.returncode, f"ERROR(rc={run.returncode})")
    return verdict, failed, time.monotonic() - t0, out[-3000:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="probe only these bugs")
    ap.add_argument("--jobs", type=int, default=1, help="bugs probed at once (default 1)")
    ap.add_argument("--list", action="store_true", help="list the bugs and exit")
    args = ap.parse_args()
    names = {b.name for b in BUGS}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        ap.error(f"unknown bug(s) {unknown}; one of: {' '.join(b.name for b in BUGS)}")
    bugs = [b for b in BUGS if not args.only or b.name in args.only]
    if args.list:
        for b in bugs:
            print(f"{b.name:<28} {b.file:<28} {' '.join(b.tests)}\n{'':<28} {b.issue}")
        return 0
    for b in bugs:  # every replacement checked before any test runs
        seeded(b, (ROOT / b.file).read_text(encoding="utf-8"))
    python = str(ROOT / ".venv" / "bin" / "python")
    if not Path(python).exists():
        python = sys.executable
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max(args.jobs, 1)) as pool:
        futures = {b.name: pool.submit(probe, b, python) for b in bugs}
        results = {}
        for b in bugs:
            results[b.name] = verdict, failed, secs, tail = futures[b.name].result()
            print(f"{b.name:<28} {verdict:<7} {secs:6.1f}s  {' '.join(failed)}", flush=True)
            if verdict != "CAUGHT":
                print(f"   {b.issue} ({b.file}); tests: {' '.join(b.tests)}\n" + tail, flush=True)
    missed = [n for n, (v, *_) in results.items() if v != "CAUGHT"]
    print(f"\n{len(bugs) - len(missed)}/{len(bugs)} seeded bugs caught in {time.monotonic() - t0:.0f} s"
          + (f"; not caught: {' '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
