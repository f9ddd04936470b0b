#!/usr/bin/env python
"""Test-time rehearsal with a trained policy, measured (issue 48 item 3; EnvACE §4.3, Table 3, Figure 6).

    .venv/bin/python benchmarks/tts_rehearsal.py --trained RUN_OR_MODEL [--warm MODEL] [--out DIR]
        [--server transformers|vllm] [--modes parallel sequential] [--budgets 0 1 2 4]
        [--memories summary verbatim] [--shapes query lookup_act lookup_query act] [--limit 50]
        [--concurrency 1] [-- EVAL_ARGS ...]
    .venv/bin/python benchmarks/tts_rehearsal.py --base-url URL --model NAME ...   # a running endpoint instead
    .venv/bin/python benchmarks/tts_rehearsal.py --smoke --base-url URL --model NAME --out DIR

Each policy (``trained``: the default recipe's checkpoint, a Hugging Face directory or a verl run directory, exported
with ``python -m envace.models export``; ``warm``: the warm start it was trained from, ``python -m envace.models build
--warm-start``) acts *and* rehearses (the paper's "EnvACE rehearsal" rows against the base model's). Every cell is one
run of the evaluation CLI users run, ``python -m envace.eval synthetic``, on the synthetic pool's held-out tasks as the
default recipe (``experiment=cpu_default``) builds them: its pool arguments, its loop limits, its acting tokens and
temperature, rehearsals at its rehearsal temperature, the chat template without thinking, seed 0. Cells: N = 0 (no
rehearsal: ``--temperature`` = the acting temperature, so N = 0 and N >= 1 act alike) and, for N >= 1, every
``--tts MODE`` x ``--tts-memory MEMORY`` (sequential N = 1 is parallel N = 1: :func:`cells`). Each checkpoint is
served once for all of its runs (``--server``: ``transformers serve``, or vLLM's CPU build with ``--server vllm``, whose
continuous batching serves ``--concurrency`` tasks at once), in fp32 unless ``--server-arg=--dtype=...`` says otherwise
(both were trained in fp32, and vLLM serves an fp32 checkpoint in half precision unless told); the commands recorded
are each cell's stand-alone form, ``--checkpoint`` with the same server and arguments.

Runs resume: each cell's directory (``OUT/<policy>/<cell>``) is the CLI's own ``--out``, so rerunning this command runs
only what is missing. The table reads what the CLI wrote: ``summary.json`` (per shape: finished and passed tasks, the
official verifier's verdicts) and ``results.jsonl`` (per task: the committed execution's real-environment tool calls,
the tokens of every request, the memory's length in ``extra.tts``); success ± its binomial standard error
sqrt(p (1 - p) / n) per cell and shape. Written: ``OUT/tts_rehearsal.{json,md}`` (the table, the commands, each
policy's ``python -m envace.eval tts-table``). Exit: 0, or the first failing run's status (2: its command is wrong,
3: an endpoint outage; rerun to resume).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECIPE = ["experiment=cpu_default"]
#: the shapes where an observation decides the answer or the write's target, then `act` (ids given) for contrast
SHAPES = ("query", "lookup_act", "lookup_query", "act")
#: completion tokens of one self-evaluation / summary reply (the acting budget of 64 would cut the JSON)
JUDGE_MAX_TOKENS = 256


@dataclass(frozen=True)
class Cell:
    """One evaluation run's rehearsal setting."""

    mode: str  # none | parallel | sequential
    n: int  # rehearsals (0: none)
    memory: str  # summary | verbatim ("" without rehearsal)

    @property
    def name(self) -> str:
        return "n0" if self.n == 0 else f"{self.mode}-n{self.n}-{self.memory}"

    @property
    def label(self) -> str:
        return "N=0" if self.n == 0 else f"{'Par.' if self.mode == 'parallel' else 'Seq.'} N={self.n} {self.memory}"

    def flags(self, act_temperature: float, rehearse_temperature: float) -> list[str]:
        if self.n == 0:
            return ["--temperature", str(act_temperature), "--top-p", "1.0"]
        return ["--tts", self.mode, "--rehearsals", str(self.n), "--tts-memory", self.memory,
                "--act-temperature", str(act_temperature), "--rehearse-temperature", str(rehearse_temperature),
                "--tts-judge-max-tokens", str(JUDGE_MAX_TOKENS)]


def cells(modes: list[str], budgets: list[int], memories: list[str]) -> list[Cell]:
    """The runs of one policy: N = 0 first, then every N >= 1 x mode x memory, except sequential N = 1 where parallel
    N = 1 is planned too: one attempt sees no earlier one, so the two runs play the same requests with the same seeds
    (measured identical task for task, docs/results/tts_rehearsal.md) and the table's parallel N = 1 row stands for
    both."""
    out = [Cell("none", 0, "")] if 0 in budgets else []
    return out + [Cell(m, n, mem) for n in sorted(set(budgets) - {0}) for m in modes for mem in memories
                  if not (n == 1 and m == "sequential" and "parallel" in modes)]


def recipe_flags(overrides: list[str]) -> tuple[list[str], float, float]:
    """The evaluation flags that play the held-out tasks as the training recipe built, limited and sampled them, and
    its acting and rehearsal temperatures."""
    from omegaconf import OmegaConf

    from envace.verl.config import compose

    cfg = compose([*RECIPE, *overrides])
    agent = cfg.envace.agent
    lim = agent.limits
    pool_kwargs = OmegaConf.to_container(agent.pool_kwargs.synthetic, resolve=True)
    act_t = float(cfg.actor_rollout_ref.rollout.temperature)
    rehearse_t = float(agent.rehearse_temperature) if agent.rehearse_temperature is not None else act_t
    flags = ["--pool-kwargs", json.dumps(pool_kwargs), "--split", "test",
             "--max-user-turns", str(lim.max_user_turns), "--max-steps-per-turn", str(lim.max_steps_per_turn),
             "--max-calls-per-message", str(lim.max_calls_per_message),
             "--max-observation-chars", str(lim.max_observation_chars), "--max-tokens", str(agent.act_max_tokens),
             "--chat-template-kwargs", json.dumps({"enable_thinking": False}), "--seed", "0"]
    return flags, act_t, rehearse_t


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"{what} failed (exit {proc.returncode}: {shlex.join(cmd)}): {last}")
    return proc.stdout.strip().splitlines()[-1]


def model_dir(path: str, out: Path, name: str) -> str:
    """A Hugging Face model directory for ``path``: itself, or its export (a verl run or checkpoint directory)."""
    if (Path(path) / "config.json").is_file():
        return path
    target = out / "models" / name
    if not (target / "config.json").is_file():
        _run([sys.executable, "-m", "envace.models", "export", path, str(target)], f"exporting {path}")
    return str(target)


@dataclass(frozen=True)
class Policy:
    """One acting-and-rehearsing policy: a running endpoint, or a checkpoint the benchmark serves once for all of its
    runs (a server start per run would cost a minute or more each on CPU, and every run would load the same
    weights)."""

    name: str
    base_url: str | None = None  # a running endpoint (--base-url) ...
    model: str | None = None  # ... and its model name
    checkpoint: str | None = None  # or a Hugging Face directory to serve
    server: str = "transformers"  # envace.eval.server's kind for the checkpoint
    server_args: tuple[str, ...] = ()  # passed on to that server

    def flags(self) -> list[str]:
        """The evaluation CLI's flags for this policy as a user runs one cell alone (``--checkpoint`` serves it for
        that run, the same server with the same arguments)."""
        if self.checkpoint is None:
            return ["--base-url", str(self.base_url), "--model", str(self.model)]
        return ["--checkpoint", self.checkpoint, "--server", self.server, *(f"--server-arg={a}" for a in self.server_args)]

    @contextlib.contextmanager
    def endpoint(self, log: Path) -> Iterator[list[str]]:
        """The evaluation CLI's endpoint flags while the policy is served (its server's output goes to ``log``)."""
        if self.checkpoint is None:
            yield self.flags()
            return
        from envace.eval.server import ServerLaunchError, launch_server
        from trace2env.cliargs import one_line

        with contextlib.ExitStack() as stack:
            try:
                srv = stack.enter_context(launch_server(self.checkpoint, self.server, extra_args=self.server_args,
                                                        log_path=log))
            except ServerLaunchError as exc:  # as the CLI reports it for --checkpoint: one line, exit 2
                print(f"[tts_rehearsal] serving {self.name} ({self.checkpoint}) failed: {one_line(exc)} (its log: "
                      f"{log})", file=sys.stderr)
                raise SystemExit(2) from None
            yield ["--base-url", srv.base_url, "--model", srv.model]


def policies(args: argparse.Namespace) -> list[Policy]:
    """The policies to measure: the endpoint given, or the trained policy and its warm start, each computing in fp32 as
    it was trained unless a ``--server-arg`` names a dtype."""
    if args.base_url:
        return [Policy(args.label, base_url=args.base_url, model=args.model)]
    server_args = list(args.server_arg)
    if not any(a.startswith("--dtype") for a in server_args):
        server_args.insert(0, "--dtype=float32")
    warm = args.warm or _run([sys.executable, "-m", "envace.models", "build", "--warm-start"], "the warm start")
    return [Policy(name, checkpoint=model_dir(path, args.out, name), server=args.server, server_args=tuple(server_args))
            for name, path in (("trained", args.trained), ("warm", warm))]


# --------------------------------------------------------------------------------------------
# The table, from what the CLI wrote
# --------------------------------------------------------------------------------------------


def _tokens(rec: Any) -> int:
    """Tokens of every request the task made: each role of a rehearsal run, else the agent's."""
    cost = (rec.extra or {}).get("tts", {}).get("cost")
    if cost:
        return int(sum(r["prompt_tokens"] + r["completion_tokens"] for r in cost.values()))
    return rec.prompt_tokens + rec.completion_tokens


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def cell_rows(run_dir: Path) -> list[dict[str, Any]]:
    """One row per shape of a finished (or partial) run: the CLI's summary.json and results.jsonl."""
    from envace.eval.store import ResultStore

    summary = json.loads((run_dir / "summary.json").read_text())["summary"]
    records = list(ResultStore(run_dir, create=False).completed().values())
    rows = []
    for shape, cat in summary["categories"].items():
        n, passed = cat["finished"], cat["passed"]
        p = passed / n if n else None
        recs = [r for r in records if r.category == shape]
        memory = [float(r.extra["tts"].get("memory_chars", len(r.extra["tts"].get("memory_text") or "")))
                  for r in recs if (r.extra or {}).get("tts")]
        rows.append({"shape": shape, "tasks": n, "expected": cat["expected"], "passed": passed, "success": p,
                     "se": math.sqrt(p * (1 - p) / n) if n else None,
                     "real_calls": _mean([float(r.tool_calls) for r in recs]),
                     "tokens": _mean([float(_tokens(r)) for r in recs]), "memory_chars": _mean(memory)})
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def format_rows(rows: list[dict[str, Any]], *, markdown: bool) -> str:
    from envace.eval.report import format_grid

    header = ["policy", "rehearsal", "shape", "tasks", "success ± s.e.", "real calls/task", "tokens/task",
              "memory chars/task"]
    body = [[r["policy"], r["cell"], r["shape"], f"{r['tasks']}/{r['expected']}",
             "–" if r["success"] is None else f"{r['success']:.3f} ± {r['se']:.3f}", _fmt(r["real_calls"], ".2f"),
             _fmt(r["tokens"], ".0f"), _fmt(r["memory_chars"], ".0f")] for r in rows]
    return format_grid(header, body, markdown=markdown)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trained", help="the default recipe's trained policy: a Hugging Face directory or a verl run")
    p.add_argument("--warm", default=None, help="the warm start (default: python -m envace.models build --warm-start)")
    p.add_argument("--base-url", help="a running endpoint instead of --trained/--warm (one policy, --label)")
    p.add_argument("--model", help="the model name at --base-url")
    p.add_argument("--label", default="endpoint", help="the policy's name with --base-url")
    p.add_argument("--server", choices=("transformers", "vllm"), default="transformers",
                   help="the server the CLI starts for a checkpoint (transformers: CPU; vllm: GPU or its CPU build)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="passed on as --server-arg")
    p.add_argument("--modes", nargs="+", choices=("parallel", "sequential"), default=["parallel", "sequential"])
    p.add_argument("--budgets", nargs="+", type=int, default=[0, 1, 2, 4], metavar="N", help="rehearsals N (0: none)")
    p.add_argument("--memories", nargs="+", choices=("summary", "verbatim"), default=["summary", "verbatim"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="held-out task shapes (--categories)")
    p.add_argument("--limit", type=int, default=50, help="held-out tasks per shape, the first N (--limit)")
    p.add_argument("--concurrency", type=int, default=1, help="tasks in flight per run (--concurrency)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "tts_rehearsal")
    p.add_argument("--recipe-override", action="append", default=[], metavar="KEY=VALUE",
                   help="Hydra override of the recipe the flags are read from (repeatable)")
    p.add_argument("--smoke", action="store_true",
                   help="one tiny cell (parallel, N=1, verbatim memory, 2 query tasks) against --base-url")
    args = p.parse_args(argv)
    if args.smoke:
        args.modes, args.budgets, args.memories, args.shapes, args.limit = ["parallel"], [1], ["verbatim"], ["query"], 2
    if bool(args.base_url) != bool(args.model):
        p.error("give --base-url and --model together")
    if not args.base_url and not args.trained:
        p.error("give --trained (and optionally --warm), or --base-url/--model" + (" (--smoke)" if args.smoke else ""))
    if any(n < 0 for n in args.budgets):
        p.error("--budgets must be >= 0")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    flags, act_t, rehearse_t = recipe_flags(args.recipe_override)
    plan = cells(args.modes, args.budgets, args.memories)
    commands: list[str] = []
    rows: list[dict[str, Any]] = []
    tts_tables: dict[str, str] = {}
    status = 0
    for policy in policies(args):
        # every run of the policy against one server; the CLI itself skips what a run directory already holds
        with policy.endpoint(args.out / policy.name / "server.log") as endpoint:
            for cell in plan:
                run_dir = args.out / policy.name / cell.name
                head = [sys.executable, "-m", "envace.eval", "synthetic"]
                rest = [*flags, "--categories", *args.shapes, "--limit", str(args.limit), "--concurrency",
                        str(args.concurrency), "--no-progress", "--label", f"{policy.name} {cell.label}", "--out",
                        str(run_dir), *cell.flags(act_t, rehearse_t), *extra]
                commands.append(shlex.join([*head, *policy.flags(), *rest]))  # as a user reruns the cell alone
                print(f"[tts_rehearsal] {policy.name} {cell.label}: {commands[-1]}", flush=True)
                code = subprocess.run([*head, *endpoint, *rest], cwd=REPO, check=False).returncode
                if code in (2, 3):  # the command itself is wrong, or an endpoint is down: later runs would fail alike
                    print(f"[tts_rehearsal] stopped: exit {code} (rerun to resume)", file=sys.stderr)
                    return code
                status = status or code
                if (run_dir / "summary.json").exists():
                    rows += [{"policy": policy.name, "cell": cell.label, **r} for r in cell_rows(run_dir)]
        dirs = [str(args.out / policy.name / c.name) for c in plan
                if (args.out / policy.name / c.name / "summary.json").exists()]
        if dirs:  # the CLI's own Table-3 layout of this policy's runs
            tts_tables[policy.name] = subprocess.run(
                [sys.executable, "-m", "envace.eval", "tts-table", "--markdown", *dirs],
                cwd=REPO, capture_output=True, text=True, check=False).stdout
    print(format_rows(rows, markdown=False))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tts_rehearsal.json").write_text(json.dumps(
        {"rows": rows, "commands": commands, "tts_tables": tts_tables}, indent=2))
    md = ["# Test-time rehearsal on the synthetic pool's held-out tasks", "", format_rows(rows, markdown=True), "",
          "## Commands", "", "```", *commands, "```"]
    for policy, table in tts_tables.items():
        md += ["", f"## `python -m envace.eval tts-table` ({policy})", "", table.strip()]
    (args.out / "tts_rehearsal.md").write_text("\n".join(md) + "\n")
    print(f"[tts_rehearsal] {args.out / 'tts_rehearsal.md'}, {args.out / 'tts_rehearsal.json'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
