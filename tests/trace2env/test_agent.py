"""The world-model agent loop (``trace2env/agent.py``): scripted, and over HTTP with the OpenAI provider."""

from __future__ import annotations

import json

from t2e_kvenv import FakeKV, record

from trace2env import Session, build_worldbook, load_worldbook, parse_trace
from trace2env.agent import AgentTurn, WorldModelAgent
from trace2env.llm import OpenAIProvider, OpenAIProviderConfig
from trace2env.providers import ScriptedProvider


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
