"""Trace2Env harness step overhead on the rule fast path (issue 9, deliverable 8). Prints figures only.

What it measures, without any model in the loop:

* **steps/s** of :meth:`trace2env.runtime.Session.step` when every step is served by one executable rule
  (action check, rule selection with its dry run, the validation gate on a state copy, template rendering,
  the commit and the memory append);
* **step time at step N vs step n** of one episode (defaults 1,000 and 10): the median over repeated
  episodes of the steps in a small window around each index. The issue's target is a ratio ≤ 1.5
  (the runtime claims an O(1) commit per step: persistent state by path copying, memory as a cons list);
* **fork cost** of a group of ``--group`` (8) forks of a session in the middle of its episode: the time of
  the forks, the memory they allocate (tracemalloc), the same after every fork has taken ``--fork-steps``
  diverging steps, and, for comparison, a deep copy of the state per member (what a state-file harness does).

The worldbook is built the deterministic way from recorded traces: a small in-file ledger environment (the
*real* environment: open / deposit / balance / count over accounts) is played with random actions, its
traces go through :func:`trace2env.build.build_worldbook`, and the rules come from a
:class:`~trace2env.providers.ScriptedProvider` (the model-free stand-in for the rule-induction stage), so
they are promoted only by the same replay review as any proposed rule. The benchmark stops with an error if
a rule is not executable or any timed step leaves the rule path.

Workloads (``--workload``):

* ``grow`` (default) — every step opens a new account, so the state holds one more entry per step (1,000
  accounts at step 1,000): the worst case for path copying, whose containers on the changed path are copied;
* ``fixed`` — deposits, balances and counts over ``--accounts`` accounts (state size constant); its first
  ``--accounts`` steps open them, so with the defaults its early window holds opens, its late one the mix.

Per-step times use this thread's CPU time by default (``--clock cpu``): on a shared machine wall time mostly
measures the scheduler. The commit is a reference swap, but path copying copies every container on the
changed path, so a write into a container of n entries costs O(n) (a C-level dict copy); ``grow`` shows
how much that weighs at the episode lengths asked for.

Usage::

    nice -n 19 .venv/bin/python benchmarks/trace2env_step.py [--steps 1000] [--early 10] [--window 5]
        [--repeats 5] [--workload grow|fixed|both] [--group 8] [--fork-steps 10] [--traces 20]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trace2env.build import build_worldbook
from trace2env.ingest import parse_trace
from trace2env.package import load_worldbook
from trace2env.providers import ScriptedProvider
from trace2env.runtime import Session

# ----------------------------------------------------------------------------------------------- real env


class Ledger:
    """The real environment the traces are recorded from. Errors are observations."""

    def __init__(self) -> None:
        self.accounts: dict[str, int] = {}

    def call(self, name: str, args: dict[str, Any]) -> str:
        a = args.get("account")
        if name == "open":
            if a in self.accounts:
                return json.dumps({"error": "account exists", "account": a})
            self.accounts[a] = 0
            return json.dumps({"ok": True, "account": a, "balance": 0})
        if name == "deposit":
            if a not in self.accounts:
                return json.dumps({"error": "no such account", "account": a})
            self.accounts[a] += args["amount"]
            return json.dumps({"account": a, "balance": self.accounts[a]})
        if name == "balance":
            if a not in self.accounts:
                return json.dumps({"error": "no such account", "account": a})
            return json.dumps({"account": a, "balance": self.accounts[a]})
        if name == "count":
            return json.dumps({"count": len(self.accounts)})
        raise ValueError(f"unknown action {name}")


def _act(rng: random.Random, pool: list[str]) -> tuple[str, dict[str, Any]]:
    name = rng.choice(["open", "open", "deposit", "deposit", "balance", "count"])
    if name == "count":
        return name, {}
    a = rng.choice(pool)
    return name, ({"account": a, "amount": rng.randint(1, 50)} if name == "deposit" else {"account": a})


def record_traces(n: int, length: int = 30) -> list[dict[str, Any]]:
    """``n`` recorded episodes of the ledger (action/observation pairs)."""
    out = []
    for seed in range(n):
        rng, env = random.Random(seed), Ledger()
        pool = [f"acct{seed}_{i}" for i in range(6)]
        steps = []
        for _ in range(length):
            name, args = _act(rng, pool)
            steps.append({"action": {"name": name, "arguments": args}, "observation": env.call(name, args)})
        out.append({"episode_id": f"ledger{seed}", "steps": steps, "metadata": {"trajectory_group": f"g{seed}"}})
    return out


def _arg(k: str) -> str:
    return "{{json:action.arguments." + k + "}}"


ACCT = "world.accounts.$account"
SCRIPT: dict[str, Any] = {
    "induce_schema": {"state_fields": [
        {"path": "world.accounts", "type": "object", "default": {}, "description": "balance per account"},
        {"path": "world.n_accounts", "type": "integer", "default": 0, "description": "number of accounts"}]},
    "induce_rules": {
        "invariants": [{"id": "count_nonnegative",
                        "condition": {"left": {"path": "world.n_accounts"}, "op": "gte", "right": {"literal": 0}}}],
        "rules": [
            {"id": "open_new", "action_type": "open", "outcome": "success",
             "conditions": [{"left": {"path": ACCT}, "op": "not_exists"}],
             "effects": [{"op": "create", "path": ACCT, "value": 0},
                         {"op": "increment", "path": "world.n_accounts", "value": 1}],
             "observation_template": '{"ok": true, "account": ' + _arg("account") + ', "balance": 0}'},
            {"id": "open_exists", "action_type": "open", "outcome": "failure",
             "conditions": [{"left": {"path": ACCT}, "op": "exists"}],
             "observation_template": '{"error": "account exists", "account": ' + _arg("account") + "}"},
            {"id": "deposit_ok", "action_type": "deposit", "outcome": "success",
             "conditions": [{"left": {"path": ACCT}, "op": "exists"}],
             "effects": [{"op": "increment", "path": ACCT, "value": {"$action_arg": "amount"}}],
             "observation_template": '{"account": ' + _arg("account") + ', "balance": {{json:state_after.' + ACCT + "}}}"},
            {"id": "deposit_missing", "action_type": "deposit", "outcome": "failure",
             "conditions": [{"left": {"path": ACCT}, "op": "not_exists"}],
             "observation_template": '{"error": "no such account", "account": ' + _arg("account") + "}"},
            {"id": "balance_ok", "action_type": "balance", "outcome": "success",
             "conditions": [{"left": {"path": ACCT}, "op": "exists"}],
             "observation_template": '{"account": ' + _arg("account") + ', "balance": {{json:state_before.' + ACCT + "}}}"},
            {"id": "balance_missing", "action_type": "balance", "outcome": "failure",
             "conditions": [{"left": {"path": ACCT}, "op": "not_exists"}],
             "observation_template": '{"error": "no such account", "account": ' + _arg("account") + "}"},
            {"id": "count", "action_type": "count", "outcome": "success",
             "observation_template": '{"count": {{json:state_before.world.n_accounts}}}'},
        ]},
}


def build(out_dir: Path, n_traces: int):
    traces = [parse_trace(t) for t in record_traces(n_traces)]
    t0 = time.perf_counter()
    path = build_worldbook(traces, out_dir / "wb", provider=ScriptedProvider(SCRIPT), environment_id="ledger")
    built_s = time.perf_counter() - t0
    wb = load_worldbook(path)
    missing = {r["id"] for r in SCRIPT["induce_rules"]["rules"]} - {r.id for r in wb.rules}
    if missing:
        raise SystemExit(f"rules not executable after the replay review: {sorted(missing)} "
                         f"(candidates: {[(r.id, r.status) for r in wb.candidate_rules]})")
    return wb, built_s


# ----------------------------------------------------------------------------------------------- workloads


def actions(workload: str, n: int, accounts: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    if workload == "grow":
        return [{"name": "open", "arguments": {"account": f"a{seed}_{i}"}} for i in range(n)]
    pool = [f"f{i}" for i in range(accounts)]
    out: list[dict[str, Any]] = [{"name": "open", "arguments": {"account": a}} for a in pool]
    while len(out) < n:
        name = rng.choice(["deposit", "deposit", "balance", "count"])
        args: dict[str, Any] = {} if name == "count" else {"account": rng.choice(pool)}
        if name == "deposit":
            args["amount"] = rng.randint(1, 50)
        out.append({"name": name, "arguments": args})
    return out[:n]


def check_fidelity(wb, acts: list[dict[str, Any]]) -> None:
    """The simulated episode reproduces the real environment's observations (outside the timing)."""
    s, env = Session.start(wb), Ledger()
    for i, a in enumerate(acts):
        r = s.step(a)
        want = env.call(a["name"], a["arguments"])
        if r.route != "rule" or json.loads(r.observation) != json.loads(want):
            raise SystemExit(f"step {i + 1}: route {r.route}, simulated {r.observation!r} != real {want!r}")


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
CLOCK = CLOCKS["cpu"]


def time_episode(wb, acts: list[dict[str, Any]]) -> tuple[list[float], Session]:
    """Per-step time (seconds, :data:`CLOCK`) of one episode; every step must be an accepted rule step."""
    s = Session.start(wb)
    dt = []
    clock = CLOCK
    for a in acts:
        t0 = clock()
        r = s.step(a)
        dt.append(clock() - t0)
        if r.route != "rule" or not r.accepted:
            raise SystemExit(f"step {s.step_count} left the rule path: {r.route} {r.observation}")
    return dt, s


def window_median(per_step: list[list[float]], k: int, w: int) -> float:
    """Median over episodes and over steps k-w..k+w (1-based)."""
    vals = [ep[i] for ep in per_step for i in range(max(0, k - 1 - w), min(len(ep), k + w))]
    return statistics.median(vals)


def fork_cost(wb, acts: list[dict[str, Any]], group: int, fork_steps: int, repeats: int) -> dict[str, float]:
    half = len(acts) // 2
    base = Session.start(wb)
    for a in acts[:half]:
        base.step(a)
    # diverging continuations: each member opens its own accounts / deposits to its own choice
    extra = [[{"name": "open", "arguments": {"account": f"fork{g}_{j}"}} for j in range(fork_steps)] for g in range(group)]
    fork_t, step_t, deep_t = [], [], []
    clock = CLOCK
    for _ in range(repeats):
        t0 = clock()
        members = [base.fork() for _ in range(group)]
        fork_t.append(clock() - t0)
        t0 = clock()
        for m, xs in zip(members, extra):
            for a in xs:
                m.step(a)
        step_t.append(clock() - t0)
        t0 = clock()
        copies = [copy.deepcopy(base.state) for _ in range(group)]
        deep_t.append(clock() - t0)
        del members, copies
    gc.collect()
    tracemalloc.start()
    m0 = tracemalloc.get_traced_memory()[0]
    members = [base.fork() for _ in range(group)]
    m1 = tracemalloc.get_traced_memory()[0]
    for m, xs in zip(members, extra):
        for a in xs:
            m.step(a)
    m2 = tracemalloc.get_traced_memory()[0]
    copies = [copy.deepcopy(base.state) for _ in range(group)]
    m3 = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del members, copies
    return {"at_step": half, "fork_s": statistics.median(fork_t), "fork_bytes": m1 - m0,
            "steps_s": statistics.median(step_t), "after_steps_bytes": m2 - m0,
            "deepcopy_s": statistics.median(deep_t), "deepcopy_bytes": m3 - m2}


# ----------------------------------------------------------------------------------------------- main


def run(workload: str, wb, args: argparse.Namespace) -> dict[str, Any]:
    n = max(args.steps + args.window, args.early + args.window)
    episodes = [actions(workload, n, args.accounts, seed) for seed in range(args.repeats)]
    check_fidelity(wb, episodes[0])
    time_episode(wb, episodes[0][: min(n, 200)])  # warm-up (imports, caches)
    per_step, totals = [], []
    for acts in episodes:
        dt, _ = time_episode(wb, acts)
        per_step.append(dt)
        totals.append(sum(dt))
    early = window_median(per_step, args.early, args.window)
    late = window_median(per_step, args.steps, args.window)
    fk = fork_cost(wb, episodes[0], args.group, args.fork_steps, args.repeats)
    return {"workload": workload, "steps": n, "steps_per_s": n / statistics.median(totals),
            "early_us": early * 1e6, "late_us": late * 1e6, "ratio": late / early, **fk}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000, help="the late step index (and episode length)")
    ap.add_argument("--early", type=int, default=10, help="the early step index")
    ap.add_argument("--window", type=int, default=5, help="steps either side of an index in its median")
    ap.add_argument("--repeats", type=int, default=5, help="episodes per workload (and fork repetitions)")
    ap.add_argument("--workload", default="both", choices=["grow", "fixed", "both"])
    ap.add_argument("--accounts", type=int, default=16, help="accounts of the fixed workload")
    ap.add_argument("--group", type=int, default=8, help="forks per group")
    ap.add_argument("--fork-steps", type=int, default=10, help="diverging steps per fork after forking")
    ap.add_argument("--traces", type=int, default=20, help="recorded ledger episodes the worldbook is built from")
    ap.add_argument("--clock", default="cpu", choices=sorted(CLOCKS),
                    help="cpu: this thread's CPU time (robust on a shared, loaded machine); wall: perf_counter")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    if args.early < 1 or args.steps <= args.early or args.window < 0 or args.repeats < 1 or args.group < 1:
        ap.error("need 1 <= --early < --steps, --window >= 0, --repeats >= 1, --group >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        wb, built_s = build(Path(tmp), args.traces)
        print(f"worldbook: {len(wb.rules)} executable rules, {len(wb.state_fields)} state fields, "
              f"{len(wb.transitions)} recorded transitions from {args.traces} traces; built in {built_s:.2f} s "
              f"(deterministic: scripted rules + replay review)")
        rows = [run(w, wb, args) for w in (["grow", "fixed"] if args.workload == "both" else [args.workload])]
    print(f"\nrule fast path, {args.repeats} episodes per workload; step time = median of steps k±{args.window}; "
          f"clock: {args.clock}")
    hdr = (f"{'workload':<8} {'length':>6} {'steps/s':>9} {'step ' + str(args.early) + ' µs':>12} "
           f"{'step ' + str(args.steps) + ' µs':>14} {'ratio':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['workload']:<8} {r['steps']:>6} {r['steps_per_s']:>9.0f} {r['early_us']:>12.1f} "
              f"{r['late_us']:>14.1f} {r['ratio']:>6.2f}")
    print(f"\nfork cost: a group of {args.group} forks at mid-episode, then {args.fork_steps} diverging steps each; "
          f"vs deep-copying the state {args.group}×")
    hdr = (f"{'workload':<8} {'at step':>7} {'fork µs':>8} {'fork KiB':>9} {'+steps ms':>10} {'+steps KiB':>11} "
           f"{'deepcopy ms':>12} {'deepcopy KiB':>13}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['workload']:<8} {r['at_step']:>7} {r['fork_s'] * 1e6:>8.1f} {r['fork_bytes'] / 1024:>9.1f} "
              f"{r['steps_s'] * 1e3:>10.2f} {r['after_steps_bytes'] / 1024:>11.1f} {r['deepcopy_s'] * 1e3:>12.2f} "
              f"{r['deepcopy_bytes'] / 1024:>13.1f}")
    print("\n" + json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
