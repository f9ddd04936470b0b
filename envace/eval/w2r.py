"""``python -m envace.eval w2r``: Trace2Env's world-to-real table (paper §5, Table 2) for a task agent served at
any OpenAI-compatible endpoint.

The same held-out tasks of a pool run twice through the evaluation driver (:func:`envace.eval.driver.evaluate`,
the turn engine shared with training, one resumable :class:`~envace.eval.store.ResultStore` per arm):

* ``OUT/real``: the agent in the real environment (:class:`~envace.eval.runner.AgentLoopRunner`); the pool's
  verifier scores it: **Real**;
* ``OUT/simulator``: the agent inside the Trace2Env simulator over a worldbook
  (:class:`envace.agents.worldbook.WorldbookSource`; a directory of packages is matched to a task by
  environment id). The source executes every call in the task's real environment as well, unseen by the
  agent (the shadow), so the pool's verifier of that episode scores the actions chosen inside the simulator,
  replayed in the real environment: **W2R**. **WM** is the simulator's own verdict (:func:`simulator_verdict`).

``OUT/w2r.json`` and ``OUT/w2r.md`` hold :func:`trace2env.consistency.w2r_consistency` of the per-task
outcomes (Real %, WM %, W2R %, CR = W2R / Real with its 95 % bootstrap interval, the ``wm_only`` count) and
the outcomes themselves. A rerun with the same ``--out`` skips the tasks each arm has finished.

WM — what the simulator itself says about the simulated episode. The goal is formed inside the simulator:
the task's gold actions are replayed in a fresh session of the same worldbook from the same initial state
(a fork of the agent's session before its first step). Then

* when that replay changes the simulated state, WM is :class:`trace2env.runtime.StatePredicateVerifier`
  with the gold's final simulated state as its conditions (one ``eq`` per top-level section), evaluated on the
  agent's final simulated state (basis ``state``) — the paper's state predicate;
* when it does not (a worldbook without state, as the model-free build of ``scripts/build_worldbook.sh``
  makes: it replays recorded observations; or a read-only task), the simulator's record of the episode is
  all it has: WM is 1 iff the agent's accepted simulated transitions contain the gold's (same action, same
  simulated observation) in order and the simulated state is unchanged (basis ``transitions``);
* when the simulator cannot replay a gold action (no rule, no supporting evidence, the world model gave up)
  or the pool has no gold actions, it cannot say what success looks like: WM is None (basis ``none``);
  w2r_consistency reports WM over the tasks with a verdict (``wm_tasks``).

The pool's verifier is not used for WM: it reads the real environment's state (the synthetic pool's entity
records, BFCL's class instances), which the simulated state does not map onto. Consequently WM judges the
world, not the agent's final replies: answer checks (the synthetic pool's, BFCL's response checks) have no
counterpart inside the simulator, so a task whose lookups succeed in the simulator but whose reply is wrong
counts in ``wm_only`` too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envace.agents.client import ChatClient
from envace.agents.engine import CallContext, LoopLimits, Observation
from envace.agents.sources import RealSource
from envace.agents.worldbook import WorldbookLibrary, WorldbookSource, world_model_from_endpoint
from envace.envs.base import EnvironmentPool, TaskSpec, ToolCall
from envace.eval.benchmarks import Benchmark
from envace.eval.report import format_grid
from envace.eval.runner import AgentLoopRunner, ChatPolicy, TaskRecord
from trace2env import WorldbookIntegrityError
from trace2env.cliargs import InfrastructureFailure, json_object, number, strict_json
from trace2env.consistency import w2r_consistency
from trace2env.engine import normalise
from trace2env.models import Condition, Operand
from trace2env.runtime import Proposer, Session, StatePredicateVerifier

__all__ = [
    "ARMS",
    "SimulatorRunner",
    "WMVerdict",
    "add_w2r_arguments",
    "format_w2r_table",
    "run_w2r",
    "select_w2r_tasks",
    "simulator_verdict",
    "w2r_outcomes",
]

ARMS = ("real", "simulator")


# --------------------------------------------------------------------------------------------
# WM: the simulator's own verdict
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WMVerdict:
    reward: float | None  # None: the simulator cannot form a verdict for this task
    basis: str  # state | transitions | none
    reason: str = ""


def _accepted(session: Session) -> list[tuple[Any, str]]:
    """(normalised action, observation) of every accepted step, oldest first."""
    return [({"name": t.action.name, "arguments": normalise(t.action.arguments)}, t.observation)
            for t in reversed(list(session.memory.newest_first())) if t.accepted and t.action is not None]


def simulator_verdict(agent: Session, start: Session, gold: Sequence[Sequence[ToolCall]] | None) -> WMVerdict:
    """WM of one simulated episode: ``agent`` is its final session, ``start`` a fork of it before the first
    step, ``gold`` the task's gold actions per user turn (None: the pool has none). See the module docstring."""
    if gold is None:
        return WMVerdict(None, "none", "the pool has no gold actions for this task")
    replay = start.fork()
    for i, call in enumerate(c for turn in gold for c in turn):
        res = replay.step({"name": call.name, "arguments": dict(call.arguments)})
        if not res.accepted:
            kind = json.loads(res.observation).get("type", "error")
            return WMVerdict(None, "none", f"the simulator cannot replay gold call {i} ({call.name}): {kind}")
    goal, initial, final = normalise(replay.state), normalise(start.state), normalise(agent.state)
    if goal != initial:
        sections = set(goal) | set(final) if isinstance(final, Mapping) else set(goal)
        conds = tuple(Condition(left=Operand(path=k), op="eq", right=Operand(literal=goal[k])) if k in goal
                      else Condition(left=Operand(path=k), op="not_exists") for k in sorted(sections))
        ok = StatePredicateVerifier(conds).verify(agent.state, agent.memory) is not None
        return WMVerdict(1.0 if ok else 0.0, "state", "" if ok else "the simulated state differs from the gold's")
    if final != initial:
        return WMVerdict(0.0, "transitions", "the agent changed a simulated state the gold leaves unchanged")
    want, have = _accepted(replay), iter(_accepted(agent))
    for i, step in enumerate(want):
        if not any(step == h for h in have):  # ordered subsequence: `have` is consumed
            return WMVerdict(0.0, "transitions", f"gold transition {i} ({step[0]['name']}) not reached in the simulator")
    return WMVerdict(1.0, "transitions", "")


# --------------------------------------------------------------------------------------------
# The simulator arm's runner
# --------------------------------------------------------------------------------------------


class _CountingSource(WorldbookSource):
    """The worldbook source, keeping what each observation was (kind, fidelity to the shadow's answer)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.start_session = self.session.fork()  # O(1): the state before the first step, for the WM goal
        self.kinds: dict[str, int] = {}
        self.exact: list[float] = []

    async def observe(self, call: ToolCall, ctx: CallContext) -> Observation:
        obs = await super().observe(call, ctx)
        self.kinds[obs.kind] = self.kinds.get(obs.kind, 0) + 1
        fid = obs.meta.get("fidelity")
        if isinstance(fid, Mapping) and "exact" in fid:
            self.exact.append(float(fid["exact"]))
        return obs


class SimulatorRunner(AgentLoopRunner):
    """One task with the Trace2Env simulator answering the agent's calls and the real environment as shadow.

    ``record.reward`` is the pool verifier's score of the shadow episode (W2R); ``record.extra`` holds ``wm``
    (:func:`simulator_verdict`), ``wm_basis``, ``wm_reason``, the simulator's routes, observation kinds and
    the share of observations identical to the real environment's (``fidelity_exact``)."""

    def __init__(self, client: ChatClient, limits: LoopLimits | None = None, *, worldbook: str | Path,
                 proposer: Proposer | None = None, wm: bool = True, **kw: Any) -> None:
        super().__init__(client, limits, **kw)
        self.worldbook = str(worldbook)
        self.proposer = proposer
        self.wm = wm

    def __call__(self, pool: EnvironmentPool, task_id: str) -> TaskRecord:
        started = time.monotonic()
        spec: TaskSpec = pool.task(task_id)
        episode = pool.start(task_id, **self.start_kwargs)
        try:
            source = _CountingSource.for_episode(self.worldbook, episode, proposer=self.proposer,
                                                 shadow=RealSource(self.env_timeout_s))
            rec = self.run_episode(spec, episode, ChatPolicy(self.client), started=started, source=source)
        finally:
            episode.close()
        if self.wm:
            try:
                gold: list[list[ToolCall]] | None = pool.gold_actions(task_id)
            except NotImplementedError:
                gold = None
            verdict = simulator_verdict(source.session, source.start_session, gold)
        else:
            verdict = WMVerdict(None, "none", "--wm none")
        rec.extra.update(
            wm=verdict.reward, wm_basis=verdict.basis, wm_reason=verdict.reason,
            environment_id=source.session.worldbook.manifest.environment_id,
            routes=dict(source.routes), observation_kinds=dict(source.kinds),
            fidelity_exact=(sum(source.exact) / len(source.exact)) if source.exact else None,
        )
        return rec


# --------------------------------------------------------------------------------------------
# Task selection, outcomes, table
# --------------------------------------------------------------------------------------------


def select_w2r_tasks(pool: EnvironmentPool, library: WorldbookLibrary, *, split: str | None,
                     envs: Sequence[str] | None = None, tasks_per_env: int | None = None,
                     limit: int | None = None) -> dict[str, str]:
    """Task id → category, in pool order: tasks of ``envs`` (default: the environments the worldbooks are
    for; every environment for a single package whose environment id names none of the pool's), at most ``tasks_per_env`` per environment and ``limit`` per category (the first ones, so reruns
    select the same tasks). Raises ValueError when a wanted environment has no worldbook or nothing is left."""
    ids = pool.task_ids(split)
    specs = {t: pool.task(t) for t in ids}
    in_pool = list(dict.fromkeys(s.env_id for s in specs.values()))
    have = sorted(library.by_env)
    if envs:
        unknown = [e for e in envs if e not in in_pool]
        if unknown:
            raise ValueError(f"environments {unknown} have no {split or 'any'}-split task in pool {pool.name!r} "
                             f"(it has {len(in_pool)}: {in_pool[:6]}...)")
        missing = [e for e in envs if library.single is None and e not in library.by_env]
        if missing:
            raise ValueError(f"no worldbook for environment(s) {missing} under {library.path} (it has worldbooks for "
                             f"{have}); build them with scripts/build_worldbook.sh")
        wanted = set(envs)
    elif library.single is not None and library.single.manifest.environment_id not in in_pool:
        wanted = set(in_pool)  # one package built over the whole pool (e.g. "bfcl"): it serves every task
    else:
        wanted = set(library.by_env) & set(in_pool)
        if not wanted:
            raise ValueError(f"no {split or 'any'}-split task of pool {pool.name!r} is in an environment with a "
                             f"worldbook under {library.path} (worldbooks for {have}; the pool's environments: "
                             f"{in_pool[:6]}...); pass --envs to run other environments on a single package")
    selected: dict[str, str] = {}
    per_env: dict[str, int] = {}
    per_cat: dict[str, int] = {}
    for tid in ids:
        spec = specs[tid]
        if spec.env_id not in wanted:
            continue
        if tasks_per_env is not None and per_env.get(spec.env_id, 0) >= tasks_per_env:
            continue
        if limit is not None and per_cat.get(spec.category, 0) >= limit:
            continue
        per_env[spec.env_id] = per_env.get(spec.env_id, 0) + 1
        per_cat[spec.category] = per_cat.get(spec.category, 0) + 1
        selected[tid] = spec.category
    if not selected:
        raise ValueError(f"no tasks selected (pool {pool.name!r}, split {split!r}, envs {sorted(wanted)})")
    return selected


def w2r_outcomes(selected: Mapping[str, str], real: Mapping[str, TaskRecord],
                 simulated: Mapping[str, TaskRecord]) -> list[dict[str, Any]]:
    """One row per selected task: Real / WM / W2R rewards (None where that arm has no record yet) and the
    simulator arm's diagnostics."""
    rows = []
    for tid, cat in selected.items():
        r, s = real.get(tid), simulated.get(tid)
        extra = s.extra if s is not None else {}
        rows.append({
            "task_id": tid, "category": cat,
            "real": r.reward if r is not None else None,
            "wm": extra.get("wm"),
            "w2r": s.reward if s is not None else None,
            "wm_basis": extra.get("wm_basis"), "wm_reason": extra.get("wm_reason"),
            "routes": extra.get("routes"), "observation_kinds": extra.get("observation_kinds"),
            "fidelity_exact": extra.get("fidelity_exact"),
        })
    return rows


def _pct(v: float) -> str:
    return "–" if v is None or math.isnan(v) else f"{v:.1f}"


def format_w2r_table(label: str, table: Mapping[str, Any], *, markdown: bool = False) -> str:
    """The paper's Table 2 row: Real / WM / W2R (%), CR [95 % CI], WM-only, tasks."""
    lo, hi = table["cr_ci95"]
    cr = "–" if math.isnan(table["cr"]) else f"{table['cr']:.2f}"
    if not (math.isnan(lo) or math.isnan(hi)):
        cr += f" [{lo:.2f}, {hi:.2f}]"
    wm = _pct(table["wm"]) + (f" ({table['wm_tasks']})" if table["wm_tasks"] != table["tasks"] else "")
    head = ["Agent", "Real (%)", "WM (%)", "W2R (%)", "CR [95% CI]", "WM-only", "Tasks"]
    row = [label, _pct(table["real"]), wm, _pct(table["w2r"]), cr, str(table["wm_only"]), str(table["tasks"])]
    return format_grid(head, [row], markdown=markdown)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_w2r_arguments(p: argparse.ArgumentParser) -> None:
    """The ``w2r`` subcommand's own flags (the endpoint, generation, loop and run flags are the others')."""
    g = p.add_argument_group("W2R (Trace2Env §5: the same tasks in the real environment and in the simulator)")
    g.add_argument("--pool", required=True, help="environment pool (synthetic, bfcl_multi_turn, ...)")
    g.add_argument("--pool-kwargs", type=json_object, default={}, metavar="JSON",
                   help="pool constructor arguments, as for scripts/build_worldbook.sh")
    g.add_argument("--worldbook", required=True,
                   help="a worldbook package, or a directory of them (scripts/build_worldbook.sh OUT/books)")
    g.add_argument("--envs", nargs="+", default=None, metavar="ENV",
                   help="only these environments (default: those the worldbooks are for)")
    g.add_argument("--tasks-per-env", type=number(int, min=1), default=None,
                   help="at most N tasks per environment (the first N)")
    g.add_argument("--wm", choices=("gold", "none"), default="gold",
                   help="gold: the simulator's verdict against the gold actions replayed in it; none: no WM column")
    g.add_argument("--success-at", type=number(float, min=0, max=1, min_open=True), default=1.0,
                   help="a task succeeds at reward >= this")
    g.add_argument("--n-boot", type=number(int, min=1), default=2000, help="bootstrap resamples of CR's 95%% interval")
    g.add_argument("--simulator-base-url", default=None,
                   help="world-model agent endpoint for steps without a rule or supporting evidence (default: none)")
    g.add_argument("--simulator-model", default=None)
    g.add_argument("--simulator-api-key", default=None)
    p.set_defaults(split="test")


def _worldbook_identity(library: WorldbookLibrary, envs: Sequence[str]) -> dict[str, str]:
    """Environment id → the package's manifest digest (which covers every file's hash and the manifest)."""
    return {env: library.for_env(env).manifest.digest[:16] for env in sorted(envs)}


def run_w2r(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from envace.agents.client import check_model_served
    from envace.envs.base import get_pool
    from envace.eval.args import (
        agent_endpoint,
        default_label,
        limits_from_args,
        run_identity,
        runner_name,
        slug,
        validate_args,
    )
    from envace.eval.driver import evaluate, failing
    from envace.eval.store import ResultStore

    validate_args(args, parser)
    if runner_name(args) != "agent_loop" or args.runner_arg:
        parser.error("w2r runs the agent loop in both arms; drop --runner / --runner-arg / --tts")
    if bool(args.simulator_base_url) != bool(args.simulator_model):
        parser.error("give both --simulator-base-url and --simulator-model, or neither")
    try:
        library = WorldbookLibrary.shared(args.worldbook)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    except WorldbookIntegrityError as exc:  # one broken book refuses the folder: no environment drops out
        where = exc.reason if exc.path == "." else f"{Path(args.worldbook) / exc.path}: {exc.reason}"
        raise ValueError(f"--worldbook: {where}") from None
    pool = get_pool(args.pool, **args.pool_kwargs)
    selected = select_w2r_tasks(pool, library, split=args.split, envs=args.envs, tasks_per_env=args.tasks_per_env,
                                limit=args.limit)
    envs = sorted({pool.task(t).env_id for t in selected})
    for env in envs:
        library.for_env(env, pool.name)  # ValueError for a book of another pool's traces
    bench = Benchmark(name="w2r", pool=args.pool, title=f"{args.pool} W2R", categories=tuple(dict.fromkeys(
        selected.values())), labels=tuple(dict.fromkeys(selected.values())))
    label = args.label or default_label(args)
    out_dir = Path(args.out or Path("results") / "eval" / "w2r" / slug(label))
    stores = {arm: ResultStore(out_dir / arm, create=False) for arm in ARMS}  # nothing written before pre-flight
    base = {**run_identity(args, bench, args.model or ""), "pool": args.pool, "pool_kwargs": args.pool_kwargs}
    sim_endpoint = ({"base_urls": args.simulator_base_url, "model": args.simulator_model,
                     "api_key": args.simulator_api_key} if args.simulator_base_url else {})
    identities = {
        "real": {**base, "arm": "real"},
        "simulator": {**base, "arm": "simulator", "worldbook": _worldbook_identity(library, envs), "wm": args.wm,
                      "simulator_model": args.simulator_model},
    }
    todo = 0
    for arm, store in stores.items():
        store.check_run_config(identities[arm], force=args.force_resume, record=False)
        done = store.completed()
        todo += sum(t not in done for t in selected)
    print(f"[envace.eval] w2r: {len(selected)} task(s) of {args.pool} ({', '.join(envs)}), "
          f"{2 * len(selected) - todo} of {2 * len(selected)} runs already done in {out_dir}", file=sys.stderr)

    records: dict[str, dict[str, TaskRecord]] = {}
    incomplete = False
    outages: list[str] = []  # one line per arm whose tasks failed on the endpoint or the environment
    with contextlib.ExitStack() as stack:
        if todo and args.checkpoint:
            out_dir.mkdir(parents=True, exist_ok=True)  # the server's log
        client = ChatClient(agent_endpoint(args, stack, out_dir, serve=bool(todo)))
        if todo and not args.checkpoint:
            check_model_served(client.config)
        for arm, store in stores.items():  # pre-flight passed: the run starts here
            store.check_run_config(identities[arm], force=args.force_resume)
            store.repair()
        proposer = world_model_from_endpoint(sim_endpoint)
        common: dict[str, Any] = {"keep_transcript": not args.no_transcripts, "env_timeout_s": args.env_timeout}
        runners = {
            "real": AgentLoopRunner(client, limits_from_args(args), **common),
            "simulator": SimulatorRunner(client, limits_from_args(args), worldbook=args.worldbook, proposer=proposer,
                                         wm=args.wm == "gold", **common),
        }
        for arm in ARMS:
            bench_arm = dataclasses.replace(bench, name=bench.name + "-" + arm)
            outcome = evaluate(pool, bench_arm, selected, runners[arm], stores[arm], concurrency=args.concurrency,
                               progress=not args.no_progress)
            records[arm] = {r.task_id: r for r in outcome.records}
            incomplete |= not outcome.summary["complete"]
            if outcome.errors:
                print(f"[envace.eval] {arm}: {outcome.errors} infrastructure error(s) (retried on rerun)",
                      file=sys.stderr)
                outages.append(failing(f"{outcome.errors} {arm} run(s) failed", outcome.last_error, stores[arm]))

    rows = w2r_outcomes(selected, records["real"], records["simulator"])
    table = w2r_consistency(rows, success_at=args.success_at, n_boot=args.n_boot, seed=args.seed or 0)
    text = format_w2r_table(label, table)
    report = {"label": label, "pool": args.pool, "pool_kwargs": args.pool_kwargs, "split": args.split,
              "worldbook": str(args.worldbook), "environments": envs, "identity": identities["simulator"],
              "table": table, "outcomes": rows}
    tmp = out_dir / "w2r.json.tmp"
    tmp.write_text(strict_json(report, indent=2, ensure_ascii=False, default=str), encoding="utf-8")
    tmp.replace(out_dir / "w2r.json")
    (out_dir / "w2r.md").write_text(format_w2r_table(label, table, markdown=True) + "\n", encoding="utf-8")
    print(text)
    bases = dict(Counter(r["wm_basis"] for r in rows if r["wm_basis"]))
    print(f"WM verdicts by basis: {bases}; wm_only {table['wm_only']}, w2r_only {table['w2r_only']}"
          + (f"; without both outcomes: {len(table['dropped'])}" if table["dropped"] else ""))
    print(f"[envace.eval] results in {out_dir} (real/, simulator/, w2r.json, w2r.md)", file=sys.stderr)
    if outages:
        raise InfrastructureFailure("; ".join(outages))
    return 1 if incomplete else 0

