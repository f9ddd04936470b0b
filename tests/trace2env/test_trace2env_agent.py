"""The applicability gate (pure), the evidence route, and the world-model agent loop (scripted and over HTTP)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from t2e_kvenv import FakeKV, record

from trace2env import Session, build_worldbook, load_worldbook, parse_trace
from trace2env.agent import AgentTurn, WorldModelAgent
from trace2env.applicability import applicability, sanitise
from trace2env.llm import OpenAIProvider, OpenAIProviderConfig
from trace2env.models import ActionCall
from trace2env.providers import ScriptedProvider


def A(name, **args):
    return ActionCall(name=name, arguments=args)


def test_applicability_labels():
    get_a, put_a, put_b = A("get", key="a"), A("put", key="a", value=1), A("put", key="b", value=2)
    kw = {"item_context": "s0", "context": "s0"}
    lab = lambda item, act, ih, h, **k: applicability(item, '{"key": "a"}', act, item_history=ih, history=h,
                                                      **{**kw, **k}).label
    assert lab(get_a, get_a, [], []) == "supporting"
    assert lab(get_a, get_a, [put_b], []) == "supporting"  # history on other operands does not matter
    assert lab(get_a, get_a, [put_a], [put_a]) == "supporting"
    assert lab(get_a, get_a, [put_a], []) == "uncertain"  # a write on "a" only in the recorded episode
    assert lab(get_a, get_a, [A("reset")], []) == "uncertain"  # operand-free actions may touch anything
    assert lab(get_a, get_a, [], [], context="s1") == "uncertain"  # another initial state
    assert lab(get_a, get_a, [], [], context=None) == "uncertain"  # unknown initial state
    assert lab(A("get", key="zzz"), get_a, [], []) == "format_only"
    assert lab(A("get", key="zzz"), get_a, [], [], episode_names=frozenset({"zzz"})) == "uncertain"
    assert lab(A("count"), A("count"), [put_a], [put_b]) == "uncertain"  # no operands: the whole history counts
    assert sanitise('{"id": "A17", "at": "2024-05-01 10:00", "n": 12345, "h": "deadbeef01", "ok": 7}') == \
        '{"id": "<id>", "at": "<date>", "n": <num>, "h": "<hash>", "ok": 7}'


@pytest.fixture(scope="module")
def kvbook(tmp_path_factory):
    """A model-free worldbook of the KV environment; every episode starts from the empty store."""
    traces = [parse_trace({**record(s, n=30), "metadata": {"trajectory_group": f"g{s}", "initial_state_id": "empty"}})
              for s in range(12)]
    return load_worldbook(build_worldbook(traces, tmp_path_factory.mktemp("kv") / "wb"))


def test_evidence_route_replays_only_supporting_records(kvbook):
    s = Session.start(kvbook, context="empty")
    real = FakeKV()
    r = s.step({"name": "get", "arguments": {"key": "a"}})  # recorded as a first touch of "a" in some trace
    assert r.route == "evidence" and r.accepted and r.observation == real.call("get", {"key": "a"})
    assert s.revision == 1 and s.state == Session.start(kvbook).state  # no effects
    s.step({"name": "put", "arguments": {"key": "a", "value": "q-unseen"}})  # a put never recorded
    r = s.step({"name": "get", "arguments": {"key": "a"}})
    assert r.route == "error" and not r.accepted  # history on "a" differs from every record: no replay
    other = Session.start(kvbook, context="another-state")
    assert other.step({"name": "get", "arguments": {"key": "a"}}).route == "error"
    off = Session.start(kvbook, context="empty", use_evidence=False)
    assert off.step({"name": "get", "arguments": {"key": "a"}}).route == "error"


def _agent(turns, **kw):
    return WorldModelAgent(ScriptedProvider({"world_model_step": [AgentTurn.model_validate(t) for t in turns]}), **kw)


def test_agent_inspects_is_rejected_then_commits(tmp_path):
    from t2e_kvenv import script  # the scripted rules give the worldbook a state schema

    traces = [parse_trace(record(s, n=20)) for s in range(6)]
    wb = load_worldbook(build_worldbook(traces, tmp_path / "wb", provider=ScriptedProvider(script())))
    agent = _agent([
        {"tool": "read_state", "arguments": {"path": "world.store"}},
        {"tool": "search_evidence", "arguments": {"query": "not an integer"}},
        {"tool": "apply_rule", "arguments": {"rule_id": "incr_existing"}},
        {"tool": "submit", "arguments": {"effects": [{"op": "set", "path": "world.nowhere", "value": 1}],
                                         "observation": "x"}},
        {"tool": "submit", "arguments": {"effects": [], "observation": '{"error": "not an integer", "key": "a"}',
                                         "outcome": "failure"}},
    ])
    s = Session.start(wb, {"world": {"store": {"a": "s"}, "size": 1}}, proposer=agent)
    r = s.step({"name": "incr", "arguments": {"key": "a"}})  # no rule covers incr on a string
    assert r.route == "proposer" and r.accepted and json.loads(r.observation)["error"] == "not an integer"
    assert s.get("world.store.a") == "s"
    st = agent.stats
    assert (st.model_calls, st.tool_calls, st.invalid_submissions, st.accepted) == (5, 3, 1, 1)
    calls = agent.provider.calls
    first, last = calls[0][1], calls[-1][1]
    assert first["action"]["name"] == "incr" and first["transcript"] == [] and first["tool_calls_left"] == 8
    assert any(r["id"] == "incr_existing" and r["applies_now"] for r in first["rules"])
    assert last["transcript"][0]["result"]["text"] == '{"a": "s"}'
    assert last["transcript"][1]["result"] and all("applicability" in e for e in last["transcript"][1]["result"])
    assert "not a number" in last["transcript"][2]["result"]["error"]  # the rule's effect fails on a string
    assert "path not declared" in last["transcript"][3]["result"]["rejected"][0]


def test_agent_budget_and_giving_up_leave_state_unchanged(tmp_path):
    traces = [parse_trace(record(s, n=20)) for s in range(3)]
    wb = load_worldbook(build_worldbook(traces, tmp_path / "wb"))
    looping = _agent([{"tool": "list_actions"}] * 10, max_tool_calls=2, max_invalid_submissions=1)
    s = Session.start(wb, proposer=looping)
    r = s.step({"name": "get", "arguments": {"key": "nope"}})
    assert r.route == "proposer" and not r.accepted and json.loads(r.observation)["type"] == "no_transition"
    assert looping.stats.tool_calls == 2 and looping.stats.invalid_submissions == 2 and looping.stats.gave_up == 1
    assert looping.provider.calls[2][1]["must_submit"] is True
    assert s.revision == 0


def test_agent_over_http_with_the_openai_provider(fake_openai, replies, tmp_path):
    traces = [parse_trace(record(s, n=20)) for s in range(3)]
    wb = load_worldbook(build_worldbook(traces, tmp_path / "wb"))
    turns = [{"thought": "look", "tool": "inspect_action", "arguments": {"name": "get"}},
             {"tool": "submit", "arguments": {"observation": '{"error": "not found", "key": "nope"}', "outcome": "failure"}}]
    srv = fake_openai(lambda body, n: replies.chat(json.dumps(turns[min(n, 1)])))
    p = OpenAIProvider(OpenAIProviderConfig(base_urls=srv.base_url, model="wm"))
    s = Session.start(wb, proposer=WorldModelAgent(p))
    r = s.step({"name": "get", "arguments": {"key": "nope"}})
    assert r.accepted and r.observation == FakeKV().call("get", {"key": "nope"})
    assert len(srv.bodies) == 2 and p.usage["world_model_step"].calls == 2
    sent = json.loads(srv.bodies[1]["messages"][1]["content"])
    assert sent["transcript"][0]["tool"] == "inspect_action" and sent["transcript"][0]["result"]["spec"]["name"] == "get"


def test_eval_measures_agreement_with_held_out_traces(kvbook, tmp_path, capsys):
    from trace2env.__main__ import main
    from trace2env.evaluate import bootstrap_ci, compare, evaluate

    assert compare('{"a": 1, "b": [1.0]}', '{"b":[1],"a":1}') == {"exact": 1.0, "key_overlap": 1.0}
    assert compare('{"a": 1}', '{"a": 2, "c": 0}') == {"exact": 0.0, "key_overlap": 0.5}
    held = [parse_trace({**record(s, n=30), "metadata": {"initial_state_id": "empty"}}) for s in range(100, 106)]
    ev = evaluate(kvbook, held, mode="evidence")["summary"]
    rules = evaluate(kvbook, held, mode="rules")["summary"]
    assert ev["steps"] == rules["steps"] == 180
    assert rules["routes"].keys() <= {"rule", "error"} and rules["exact"] < ev["exact"]  # evidence adds coverage
    assert ev["exact_when_answered"] == 1.0  # what the deterministic paths answer is right
    lo, hi = ev["exact_ci95"]
    assert lo <= ev["exact"] <= hi
    assert bootstrap_ci([(1.0, 1), (0.0, 1)], n_boot=500)[0] < 0.5 < bootstrap_ci([(1.0, 1), (0.0, 1)], n_boot=500)[1]
    p = tmp_path / "held.jsonl"
    p.write_text("".join(json.dumps({**record(s, n=30), "metadata": {"initial_state_id": "empty"}}) + "\n"
                         for s in range(100, 106)))
    assert main(["eval", str(kvbook.root), str(p), "--mode", "evidence", "--out", str(tmp_path / "r.json")]) == 0
    assert json.loads(capsys.readouterr().out)["exact"] == ev["exact"]
    assert len(json.loads((tmp_path / "r.json").read_text())["steps"]) == 180
    with pytest.raises(ValueError, match="needs a proposer"):
        evaluate(kvbook, held, mode="agent")
