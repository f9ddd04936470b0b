"""``python -m envace.eval w2r`` (envace/eval/w2r.py) end to end against the fake OpenAI server: a policy that
makes the gold calls and reports what they returned runs the held-out tasks of one synthetic environment in the
real environment and in the Trace2Env simulator over a worldbook built in the test from the train split's gold
traces. With a faithful worldbook the simulated reads reproduce the real ones (WM = W2R = Real); with a worldbook
built from a falsified recording (one account's balance) the agent reports the simulator's number: the simulator
calls that a success (WM) and the real environment does not (W2R) — the ``wm_only`` tasks. Also: the state-predicate
basis of the simulator's verdict on a worldbook with state and rules, resume, and the errors for a missing worldbook
and an environment without one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from envace.agents.worldbook import WorldbookLibrary
from envace.envs.base import ToolCall
from envace.envs.gold_trace import record_gold_trace
from envace.envs.synthetic import SyntheticPool
from envace.eval.cli import main
from envace.eval.w2r import select_w2r_tasks, simulator_verdict
from envace.toolcall import render_tool_call
from trace2env import (
    ScriptedProvider,
    Session,
    WorldbookIntegrityError,
    build_worldbook,
    load_traces,
    load_worldbook,
    parse_trace,
)

KW = {"n_envs": 2, "tasks_per_env": 40, "seed": 3}
ENV = "syn-bank-00"
TRUE_OBS = '{"id": "A42", "owner": "Priya Nair", "balance": 252, "status": "open"}'  # show_account A42
FALSE_OBS = TRUE_OBS.replace("252", "999")
READS = ("syn-bank-00/t08", "syn-bank-00/t11", "syn-bank-00/t16", "syn-bank-00/t26", "syn-bank-00/t38")
WRITES = ("syn-bank-00/t20", "syn-bank-00/t27")  # act / lookup_act: a write the model-free worldbook cannot answer
ASKS_A42 = ("syn-bank-00/t11", "syn-bank-00/t38")  # "The balance of account A42 is 252."


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    """(pool, held-out task ids, faithful worldbook dir, falsified worldbook dir)."""
    pool = SyntheticPool(**KW)
    train = [t for t in pool.task_ids("train") if pool.task(t).env_id == ENV]
    test = [t for t in pool.task_ids("test") if pool.task(t).env_id == ENV]
    d = tmp_path_factory.mktemp("w2r")
    lines = [json.dumps(record_gold_trace(pool, t)) for t in train]
    assert sum(line.count(json.dumps(TRUE_OBS)) for line in lines) >= 1  # the falsified record exists
    roots = {}
    for name, text in (("true", "\n".join(lines)), ("false", "\n".join(lines).replace(json.dumps(TRUE_OBS),
                                                                                       json.dumps(FALSE_OBS)))):
        (d / f"{name}.jsonl").write_text(text + "\n")
        build_worldbook(load_traces([d / f"{name}.jsonl"]), d / name / "bank", environment_id=ENV)
        roots[name] = d / name
    return pool, test, roots["true"], roots["false"]


def reporting_agent(pool, tasks, replies):
    """Makes the turn's gold calls one per message, then replies with what they returned (as the synthetic
    pool's replay does): whatever the observations say is what the agent reports."""
    by_first = {pool.task(t).first_user_message: t for t in tasks}

    def respond(body, n):
        msgs = body["messages"]
        tid = by_first[next(m for m in msgs if m["role"] == "user")["content"]]
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        calls = pool.gold_actions(tid)[len(users) - 1]
        seen = [m["content"] for m in msgs[users[-1] + 1:] if m["role"] == "tool"]
        if len(seen) < len(calls):
            return replies.chat(render_tool_call(calls[len(seen)]))
        return replies.chat("\n".join(seen) or "Done.")

    return respond


def run(server, book: Path, out: Path, *extra: str) -> int:
    return main(["w2r", "--pool", "synthetic", "--pool-kwargs", json.dumps(KW), "--worldbook", str(book),
                 "--base-url", server.base_url, "--model", "m", "--no-progress", "--seed", "0", "--out", str(out),
                 "--tool-timeout-s", "0", "--tool-memory-mb", "0",  # no forked dry run per call: faster
                 *extra])


def outcomes(out: Path) -> tuple[dict, dict]:
    data = json.loads((out / "w2r.json").read_text())
    return data["table"], {r["task_id"]: r for r in data["outcomes"]}


def test_faithful_worldbook_reads_transfer_and_writes_have_no_wm_verdict(books, fake_openai, replies, tmp_path,
                                                                         capsys):
    pool, test, true_book, _ = books
    server = fake_openai(reporting_agent(pool, test, replies))
    out = tmp_path / "run"
    assert run(server, true_book, out) == 0
    printed = capsys.readouterr().out
    table, rows = outcomes(out)
    assert set(rows) == set(test) and table["tasks"] == len(test) == 9
    assert all(r["real"] == 1.0 for r in rows.values())  # the gold calls succeed in the real environment
    for tid in READS:  # served from recorded evidence, identical to the real answers
        r = rows[tid]
        assert (r["wm"], r["w2r"], r["wm_basis"]) == (1.0, 1.0, "transitions"), r
        assert r["routes"] == {"evidence": sum(map(len, pool.gold_actions(tid)))} and r["fidelity_exact"] == 1.0
    for tid in WRITES:  # the simulator cannot answer the write; the shadow executed it, the state is right
        r = rows[tid]
        assert r["wm"] is None and r["wm_basis"] == "none" and "cannot replay gold call" in r["wm_reason"], r
        assert r["w2r"] == 1.0 and r["observation_kinds"].get("simulator_gap", 0) == 1
    wm_rows = [r for r in rows.values() if r["wm"] is not None]
    assert table["wm_tasks"] == len(wm_rows) >= len(READS) and table["wm_only"] == 0
    assert table["real"] == 100.0 and table["wm"] == 100.0
    n_w2r = sum(r["w2r"] == 1.0 for r in rows.values())
    assert table["w2r"] == pytest.approx(100.0 * n_w2r / 9) and table["cr"] == pytest.approx(n_w2r / 9)
    assert f"{table['real']:.1f}" in printed and "WM-only" in printed
    assert "| Agent | Real (%) | WM (%) | W2R (%)" in (out / "w2r.md").read_text()
    # the simulated arm's records are the driver's: one per task, with the simulator's diagnostics
    sim = [json.loads(x) for x in (out / "simulator" / "results.jsonl").read_text().splitlines()]
    real = [json.loads(x) for x in (out / "real" / "results.jsonl").read_text().splitlines()]
    assert len(sim) == len(real) == 9 and all("wm" in r["extra"] for r in sim)
    # the agent saw the simulator's answers in the simulated arm: an error observation for every write
    gap_bodies = [b for b in server.bodies if any("no_applicable_rule" in str(m.get("content")) for m in b["messages"])]
    assert gap_bodies

    # resume: nothing runs again, the same table
    n = server.n_requests
    assert run(server, true_book, out) == 0
    assert server.n_requests == n and capsys.readouterr().out == printed


def test_a_simulator_that_lies_gives_wm_success_and_real_failure(books, fake_openai, replies, tmp_path):
    pool, test, _, false_book = books
    server = fake_openai(reporting_agent(pool, test, replies))
    out = tmp_path / "run"
    assert run(server, false_book, out) == 0
    table, rows = outcomes(out)
    for tid in ASKS_A42:  # the agent reported the simulator's 999; the real account holds 252
        r = rows[tid]
        assert (r["real"], r["wm"], r["w2r"]) == (1.0, 1.0, 0.0), r
        assert r["fidelity_exact"] < 1.0
    assert table["wm_only"] == len(ASKS_A42) and table["w2r_only"] == 0
    for tid in set(READS) - set(ASKS_A42):
        assert (rows[tid]["real"], rows[tid]["wm"], rows[tid]["w2r"]) == (1.0, 1.0, 1.0)
    n_w2r = sum(r["w2r"] == 1.0 for r in rows.values())
    assert table["cr"] == pytest.approx(n_w2r / 9) and table["cr"] < 1.0
    lo, hi = table["cr_ci95"]
    assert lo <= table["cr"] <= hi <= 1.0


def test_missing_worldbook_and_environment_without_one_are_clean_errors(books, fake_openai, replies, tmp_path,
                                                                       capsys):
    pool, test, true_book, _ = books
    server = fake_openai(reporting_agent(pool, test, replies))
    assert run(server, tmp_path / "nowhere", tmp_path / "o1") == 2
    assert "does not exist" in capsys.readouterr().err
    assert run(server, true_book, tmp_path / "o2", "--envs", "syn-shop-01") == 2
    err = capsys.readouterr().err
    assert "no worldbook for environment(s) ['syn-shop-01']" in err and ENV in err
    assert run(server, true_book, tmp_path / "o3", "--envs", "syn-nowhere-7") == 2
    assert "have no test-split task" in capsys.readouterr().err
    assert server.n_requests == 0


def test_a_books_folder_with_a_broken_book_is_refused_whole(books, fake_openai, replies, tmp_path, capsys):
    """Finding 1: a book that lost its manifest.json no longer drops out of the run silently; nothing is
    written (finding 12) and no request is sent."""
    pool, test, true_book, _ = books
    folder = tmp_path / "books"
    shutil.copytree(true_book, folder)
    shutil.copytree(true_book / "bank", folder / "shop")
    (folder / "shop" / "manifest.json").unlink()
    server = fake_openai(reporting_agent(pool, test, replies))
    server.models = ["m"]
    assert run(server, folder, tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert f"--worldbook: {folder / 'shop' / 'manifest.json'}: missing" in err and len(err.splitlines()) == 1
    assert server.n_requests == 0 and not (tmp_path / "o").exists()
    with pytest.raises(WorldbookIntegrityError, match="^shop/manifest.json: missing"):
        WorldbookLibrary(folder)


def test_a_book_of_another_pools_traces_is_refused(books, fake_openai, replies, tmp_path, capsys):
    """Finding 5: a book records its traces' pool; the simulator never serves it for another pool's tasks."""
    pool, test, true_book, _ = books
    lib = WorldbookLibrary(true_book / "bank")
    assert lib.for_env(ENV, "synthetic").manifest.source_pool == "synthetic"
    with pytest.raises(ValueError, match="built from traces of pool 'synthetic', not of 'bfcl_multi_turn'"):
        lib.for_env("GorillaFileSystem", "bfcl_multi_turn")
    server = fake_openai(reporting_agent(pool, test, replies))
    server.models = ["m"]
    assert main(["w2r", "--pool", "bfcl_multi_turn", "--worldbook", str(true_book / "bank"), "--base-url",
                 server.base_url, "--model", "m", "--no-progress", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "not of 'bfcl_multi_turn'" in err and len(err.splitlines()) == 1
    assert server.n_requests == 0 and not (tmp_path / "o").exists()


def test_task_selection_follows_the_worldbooks(books, tmp_path):
    pool, test, true_book, _ = books
    both = pool.task_ids("test")
    # a directory of packages, or one package for a pool environment: that environment's tasks
    assert list(select_w2r_tasks(pool, WorldbookLibrary(true_book), split="test")) == test
    assert list(select_w2r_tasks(pool, WorldbookLibrary(true_book / "bank"), split="test")) == test
    assert list(select_w2r_tasks(pool, WorldbookLibrary(true_book), split="test", tasks_per_env=3)) == test[:3]
    first_of = {}
    for t in test:
        first_of.setdefault(pool.task(t).category, t)
    one_each = select_w2r_tasks(pool, WorldbookLibrary(true_book), split="test", limit=1)
    assert sorted(one_each) == sorted(first_of.values()) and len(one_each) < len(test)
    # one package built over the whole pool (environment id "synthetic", as for BFCL's "bfcl"): every task
    wide = build_worldbook(load_traces([true_book.parent / "true.jsonl"]), tmp_path / "wide", environment_id="synthetic")
    assert list(select_w2r_tasks(pool, WorldbookLibrary(wide), split="test")) == both
    assert set(select_w2r_tasks(pool, WorldbookLibrary(wide), split="test", envs=["syn-shop-01"]).values())


def test_simulator_verdict_on_a_worldbook_with_state_is_the_state_predicate(tmp_path):
    # a counter world: bump increments world.n (an executable rule), peek reads it
    steps = []
    for i in range(1, 4):
        steps += [{"action": {"name": "bump", "arguments": {}}, "observation": json.dumps({"n": i})},
                  {"action": {"name": "peek", "arguments": {}}, "observation": json.dumps({"n": i})}]
    trace = parse_trace({"episode_id": "e0", "steps": steps})
    rules = {"rules": [
        {"id": "bump", "action_type": "bump", "priority": 1, "outcome": "success",
         "effects": [{"op": "increment", "path": "world.n", "value": 1}],
         "observation_template": '{"n": {{json:state_after.world.n}}}'},
        {"id": "peek", "action_type": "peek", "priority": 1, "outcome": "success",
         "observation_template": '{"n": {{json:state_before.world.n}}}'}]}
    schema = {"state_fields": [{"path": "world.n", "type": "integer", "default": 0, "description": "counter"}]}
    wb = load_worldbook(build_worldbook([trace], tmp_path / "wb",
                                        provider=ScriptedProvider({"induce_schema": schema, "induce_rules": rules})))
    start = Session.start(wb)
    bump, peek = ToolCall("bump", {}), ToolCall("peek", {})

    def agent(*calls: ToolCall) -> Session:
        s = start.fork()
        for c in calls:
            assert s.step({"name": c.name, "arguments": {}}).accepted
        return s

    gold = [[bump, bump]]
    ok = simulator_verdict(agent(peek, bump, peek, bump), start, gold)
    assert (ok.reward, ok.basis) == (1.0, "state")  # the state counts, not the route to it
    short = simulator_verdict(agent(bump), start, gold)
    assert (short.reward, short.basis) == (0.0, "state") and "differs" in short.reason
    over = simulator_verdict(agent(bump, bump, bump), start, gold)
    assert over.reward == 0.0
    # a read-only goal: the agent must read what the gold read and change nothing
    assert simulator_verdict(agent(peek), start, [[peek]]).reward == 1.0
    assert simulator_verdict(agent(bump, peek), start, [[peek]]).reward == 0.0
    assert simulator_verdict(agent(), start, [[peek]]).reward == 0.0
    assert simulator_verdict(agent(), start, None).reward is None
    unknown = simulator_verdict(agent(), start, [[ToolCall("reset", {})]])
    assert unknown.reward is None and "cannot replay gold call 0 (reset)" in unknown.reason


@pytest.mark.parametrize(("extra", "message"), [
    (["--tts", "parallel"], "w2r runs the agent loop in both arms"),
    (["--tasks-per-env", "0"], "argument --tasks-per-env: expected an integer >= 1"),
    (["--n-boot", "0"], "argument --n-boot: expected an integer >= 1"),
    (["--success-at", "nan"], "argument --success-at: expected a number > 0 and <= 1"),
    (["--pool-kwargs", "{"], "argument --pool-kwargs: not valid JSON"),
    (["--simulator-model", "wm"], "give both --simulator-base-url and --simulator-model"),
])
def test_bad_w2r_arguments_exit_2_before_anything_runs(extra, message, capsys, tmp_path):
    argv = ["w2r", "--pool", "synthetic", "--worldbook", str(tmp_path), "--base-url", "http://127.0.0.1:9/v1",
            "--model", "m", "--out", str(tmp_path / "o"), *extra]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):  # --pool and --worldbook are required
        main(["w2r", "--base-url", "http://127.0.0.1:9/v1", "--model", "m"])
