"""Gold-replay traces (``python -m envace.data record-traces``) of the τ²-bench pool, recorded without a user
simulator: a few telecom tasks whose gold mixes the agent's calls with the user's own phone actions."""

from __future__ import annotations

import json

import pytest

from envace.data.__main__ import main as data_main
from envace.data.cli import traces as traces_cli
from envace.data.traces import record_pool
from envace.envs.base import ToolCall, get_pool
from envace.envs.gold_trace import initial_state_id, record_gold_trace
from envace.envs.tau2 import USER_PREFIX, Tau2Pool
from trace2env import Session, align, build_worldbook, load_traces, load_worldbook, parse_trace

# train: user + agent gold actions; the third one's initial state differs from the first two's
TRAIN = [
    "telecom/[mms_issue]bad_network_preference|user_abroad_roaming_disabled_off[PERSONA:None]",
    "telecom/[mms_issue]bad_network_preference|user_abroad_roaming_disabled_on[PERSONA:None]",
    "telecom/[mms_issue]airplane_mode_on|bad_network_preference|data_usage_exceeded[PERSONA:None]",
]


@pytest.fixture(scope="module")
def pool() -> Tau2Pool:
    return get_pool("tau2", domains=("telecom",))  # type: ignore[return-value]


def _calls(trace: dict) -> list[dict]:
    return [tc["function"] for m in trace["messages"] if m["role"] == "assistant" for tc in m.get("tool_calls") or []]


def test_tau2_gold_trace_is_complete_without_a_user_simulator(pool: Tau2Pool) -> None:
    assert pool.user is None
    for tid in TRAIN:
        tr = record_gold_trace(pool, tid)
        gold = [c for turn in pool.gold_actions(tid) for c in turn]
        calls = _calls(tr)
        # every gold action is in the trace, user-side ones under "user:<tool>"
        assert [c["name"] for c in calls] == [
            (USER_PREFIX if c.requestor == "user" else "") + c.name for c in gold]  # type: ignore[attr-defined]
        assert any(c["name"].startswith(USER_PREFIX) for c in calls) and any(
            not c["name"].startswith(USER_PREFIX) for c in calls)
        # the opening τ² shows without a user model: greeting, then the scenario's reason for call
        roles = [m["role"] for m in tr["messages"]]
        assert roles[:3] == ["system", "assistant", "user"]
        assert tr["messages"][2]["content"] == pool.task(tid).first_user_message
        # replaying the recorded actions (sides read back from the names) is the gold replay: reward 1
        replayed = [ToolCall(c["name"], dict(c["arguments"])) for c in calls]
        verdict = pool.replay(tid, [replayed])
        assert verdict.reward == 1.0, verdict.details
        # trace2env reads it: one aligned transition per action, observations verbatim
        trace = parse_trace(tr)
        ts = align(trace)
        tool_msgs = [m["content"] for m in tr["messages"] if m["role"] == "tool"]
        assert [t.observation for t in ts] == tool_msgs and all(t.alignment != "ambiguous" for t in ts)
        assert [t.action.name for t in ts] == [c["name"] for c in calls]
        assert tr["metadata"]["initial_state_id"] == initial_state_id(pool.task(tid))
        assert tr["metadata"]["split"] == "train" and tr["metadata"]["env_id"] == "tau2:telecom"
    # initial states differ with the task's initialization actions
    ids = {initial_state_id(pool.task(t)) for t in TRAIN}
    assert len(ids) == 3


def test_cli_and_worldbook_from_tau2_traces(pool: Tau2Pool, tmp_path, monkeypatch) -> None:
    out = tmp_path / "train.jsonl"
    asked = []
    # the CLI's own pool is this module's (loading τ² again costs a minute of CPU); the arguments are checked
    monkeypatch.setattr(traces_cli, "get_pool", lambda name, **kw: asked.append((name, kw)) or pool)
    kw = json.dumps({"tau2": {"domains": ["telecom"]}})
    assert data_main(["--pool-kwargs", kw, "record-traces", "--pool", "tau2", "--split", "train", "--max-tasks", "2",
                      "--out", str(out), "--by-env", str(tmp_path / "by_env")]) == 0
    assert asked == [("tau2", {"domains": ["telecom"]})]
    lines = out.read_text().splitlines()
    assert [json.loads(x)["metadata"]["task_id"] for x in lines] == pool.task_ids("train")[:2]
    assert (tmp_path / "by_env" / "tau2_telecom.jsonl").read_text() == out.read_text()
    # a model-free worldbook reproduces every recorded observation of its own traces through the evidence
    # route (same initial state, same history), and answers nothing from evidence of another initial state
    traces = record_pool(pool, TRAIN)
    assert len(traces) == 3
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in traces[:2]))
    wb = load_worldbook(build_worldbook(load_traces([path]), tmp_path / "book", environment_id="tau2:telecom"))
    for tr in load_traces([path]):
        s = Session.start(wb, context=tr.metadata["initial_state_id"])
        for t in align(tr):
            r = s.step({"name": t.action.name, "arguments": t.action.arguments})
            assert r.accepted and r.observation == t.observation, (t.action.name, r)
    other = parse_trace(traces[2])
    shared = [t for t in align(other) if wb.exact_evidence(t.action.name, t.action.arguments)]
    assert shared  # the same call was recorded, but from another initial state
    s = Session.start(wb, context=other.metadata["initial_state_id"])
    for t in align(other):
        r = s.step({"name": t.action.name, "arguments": t.action.arguments})
        assert r.route != "evidence"
