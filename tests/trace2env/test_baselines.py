"""The paper's baselines behind one predictor interface: what each prompt contains, and what it must not."""

from __future__ import annotations

import json

import pytest
from t2e_kvenv import record

from trace2env import build_worldbook, load_worldbook, parse_trace
from trace2env.agent import WorldModelAgent
from trace2env.baselines import (
    PREDICT_PROMPTS,
    PREDICT_STAGE,
    DirectPrompting,
    HarnessOnly,
    SimulatorPredictor,
    StepPredictor,
    TraceRAG,
    WorldbookPrompting,
    make_predictor,
    strip_knowledge,
)
from trace2env.evaluate import evaluate
from trace2env.providers import ModelOutputError, ScriptedProvider


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    train = [parse_trace({**record(s, n=20), "metadata": {"initial_state_id": "empty"}}) for s in range(6)]
    return load_worldbook(build_worldbook(train, tmp_path_factory.mktemp("kvb") / "wb")), train


def obs(d):
    return json.dumps(d)


# a held-out episode whose last observation carries a marker found nowhere else
HELD = parse_trace({"episode_id": "held", "metadata": {"initial_state_id": "empty"}, "messages": [
    {"role": "user", "content": "remember zebra-7"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function", "function": {
        "name": "put", "arguments": json.dumps({"key": "a", "value": "zebra-7"})}}]},
    {"role": "tool", "tool_call_id": "c0", "content": obs({"ok": True, "key": "a"})},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get", "arguments": json.dumps({"key": "a"})}}]},
    {"role": "tool", "tool_call_id": "c1", "content": obs({"key": "a", "value": "zebra-7", "note": "target-marker"})},
]})


def run(kvbook, predictor, traces=(HELD,)):
    return evaluate(kvbook, list(traces), predictor=predictor, n_boot=200)


def worldbook_markers(wb):
    """Strings that only worldbook content contains."""
    return [r.id for r in wb.rules] + [t.id for t in wb.transitions[:20]] + [wb.manifest.environment_id]


def test_every_system_implements_the_one_protocol(kv):
    p = ScriptedProvider({})
    for s in ("rules", "evidence", "direct", "trace_rag", "worldbook_prompt", "harness_only"):
        assert isinstance(make_predictor(s, provider=p), StepPredictor)
    assert make_predictor("agent", provider=p).name == "agent"
    with pytest.raises(ValueError, match="needs a model provider"):
        make_predictor("direct")
    with pytest.raises(ValueError, match="unknown system"):
        make_predictor("oracle", provider=p)
    with pytest.raises(ValueError, match="needs a proposer or a provider"):
        make_predictor("agent")


def test_direct_prompting_sees_the_recorded_prefix_and_the_action_only(kv):
    wb, _ = kv
    p = ScriptedProvider({PREDICT_STAGE: {"observation": {"key": "a", "value": "zebra-7", "note": "target-marker"}}})
    out = run(wb, DirectPrompting(p))
    first, second = (c[1] for c in p.calls)
    assert first["instructions"] == PREDICT_PROMPTS["direct_v1"]
    assert first["action"] == {"name": "put", "arguments": {"key": "a", "value": "zebra-7"}}
    assert [e["kind"] for e in first["history"]] == ["message"]
    assert [e["kind"] for e in second["history"]] == ["message", "action", "observation"]
    assert second["history"][2]["content"] == obs({"ok": True, "key": "a"})  # the recorded observation, teacher-forced
    assert set(first) == {"instructions", "prompt_version", "environment", "history", "action"}
    text = json.dumps(p.calls)
    assert "target-marker" not in text  # never the observation it predicts
    assert not any(m in text for m in worldbook_markers(wb))  # nothing from the worldbook
    s = out["summary"]  # a JSON reply is dumped once and scored like any observation
    assert s["system"] == "direct" and s["steps"] == 2 and s["answered"] == 1.0 and s["exact"] == 0.5
    assert out["steps"][1]["route"] == "model"


def test_direct_prompting_failure_is_an_error_observation_not_an_exception(kv):
    wb, _ = kv

    class Bad:
        def complete(self, stage, payload, response_model):
            raise ModelOutputError("nothing validated", text="?", rounds=3)

    d = DirectPrompting(Bad())
    s = run(wb, d)["summary"]
    assert s["answered"] == 0.0 and s["exact"] == 0.0 and d.failures == 2 and s["routes"] == {"error": 2}


def test_trace_rag_adds_top_k_lexical_transitions_never_from_the_evaluated_trace(kv):
    wb, train = kv
    p = ScriptedProvider({PREDICT_STAGE: {"observation": "{}"}})
    run(wb, TraceRAG(p, k=3))
    payload = p.calls[1][1]
    assert payload["instructions"] == PREDICT_PROMPTS["trace_rag_v1"] and "worldbook" not in payload
    hits = payload["retrieved_transitions"]
    assert 1 <= len(hits) <= 3
    by_id = {t.id: t for t in wb.transitions}
    assert all(h["transition_id"] in by_id for h in hits)
    assert all(h["observation"] == by_id[h["transition_id"]].observation for h in hits)  # raw, not sanitised
    assert any(h["action"] == "get" and h["arguments"].get("key") == "a" for h in hits)  # ranked for get a
    assert "target-marker" not in json.dumps(p.calls)
    # evaluating a construction trace: its own transitions are never retrieved (that would leak the answer)
    own = train[0]
    p2 = ScriptedProvider({PREDICT_STAGE: {"observation": "{}"}})
    with pytest.warns(UserWarning, match="not held-out"):
        run(wb, TraceRAG(p2), [own])
    got = [h["transition_id"] for _, pl in p2.calls for h in pl["retrieved_transitions"]]
    assert got and not {by_id[t].trace_id for t in got} & {own.trace_id}
    assert all(len(pl["retrieved_transitions"]) == 5 for _, pl in p2.calls)


def test_worldbook_prompting_gets_a_fixed_dump_of_the_worldbook(kv):
    wb, _ = kv
    p = ScriptedProvider({PREDICT_STAGE: {"observation": "{}"}})
    run(wb, WorldbookPrompting(p))
    a, b = (c[1] for c in p.calls)
    assert a["instructions"] == PREDICT_PROMPTS["worldbook_v1"] and "retrieved_transitions" not in a
    dump = a["worldbook"]
    assert dump == b["worldbook"]  # static context, the same at every step
    assert [r["id"] for r in dump["rules"]] == [r.id for r in wb.rules] and wb.rules
    assert [x["name"] for x in dump["actions"]] == [x.name for x in wb.actions]
    assert len(dump["demonstrations"]) == min(4, len(wb.demonstrations)) and len(dump["recorded_transitions"]) == 6
    assert "provenance" not in json.dumps(dump)
    assert "target-marker" not in json.dumps(p.calls)


def test_harness_only_runs_the_agent_without_worldbook_knowledge_or_state(kv):
    wb, _ = kv
    bare = strip_knowledge(wb)
    assert not (bare.rules or bare.transitions or bare.demonstrations or bare.state_fields or bare.contracts)
    assert [a.name for a in bare.actions] == [a.name for a in wb.actions]
    assert bare.search_evidence("get a") == [] and wb.search_evidence("get a")
    put_effect = {"op": "create", "path": "world.store.a", "value": "zebra-7"}
    answers = [{"tool": "submit", "arguments": {"effects": [put_effect], "observation": obs({"ok": True, "key": "a"})}},
               {"tool": "submit", "arguments": {"effects": [], "observation": obs({"ok": True, "key": "a"})}},
               {"tool": "submit", "arguments": {"observation": obs({"key": "a", "value": None})}}]
    p = ScriptedProvider({"world_model_step": answers})
    out = run(wb, HarnessOnly(p, agent_factory=lambda prov: WorldModelAgent(prov, max_invalid_submissions=1)))
    briefs = [c[1] for c in p.calls]
    assert len(briefs) == 3
    b0 = briefs[0]
    assert b0["rules"] == [] and b0["evidence"] == [] and b0["demonstrations"] == [] and b0["contracts"] == []
    assert b0["action_spec"]["name"] == "put"  # the action interface stays
    # state effects are rejected: there is no declared state to persist them
    assert "rejected" in json.dumps(briefs[1]["transcript"]) and "world.store" in json.dumps(briefs[1]["transcript"])
    assert out["summary"]["answered"] == 1.0 and [s["route"] for s in out["steps"]] == ["proposer", "proposer"]
    assert out["steps"][0]["exact"] == 1.0
    # the same agent over the full worldbook would see its rules and evidence (what Harness only removes)
    full = ScriptedProvider({"world_model_step": [answers[1], answers[2]]})
    run(wb, SimulatorPredictor("agent", WorldModelAgent(full), min_rule_confidence=2.0), [HELD])
    assert full.calls[0][1]["rules"] and full.calls[0][1]["evidence"]
