"""Sessions over a worldbook (``trace2env/runtime.py``): the rule fast path reproducing recorded observations, the
evidence route, the validation gate, invalid actions as error observations, forks, the gym API, ambiguous rules."""

from __future__ import annotations

import json

import pytest
from t2e_kvenv import FakeKV, script

from trace2env import (
    ScriptedProvider,
    Session,
    TransitionProposal,
    WorldbookEnv,
    align,
    build_worldbook,
    load_worldbook,
    parse_trace,
    validation_gate,
)
from trace2env.models import ActionCall, Effect


def _replay(wb, trace):
    sess = Session.start(wb, trace.metadata.get("initial_state"))
    covered = reproduced = 0
    for t in align(trace):
        res = sess.step({"name": t.action.name, "arguments": t.action.arguments})
        if res.route == "rule" and res.accepted:
            covered += 1
            reproduced += res.observation == t.observation
            assert res.observation == t.observation, (t.id, res.observation, t.observation)
    return covered, reproduced, len(align(trace))


@pytest.mark.parametrize("split_name", ["train", "test"])
def test_fast_path_reproduces_every_rule_covered_recorded_observation(built, split_name):
    wb, traces, split = built
    ids = set(split.ids(split_name))
    assert ids, "split is empty"
    total_cov = total = 0
    for tr in traces:
        if tr.trace_id in ids:
            cov, rep, n = _replay(wb, tr)
            assert cov == rep
            total_cov, total = total_cov + cov, total + n
    # only incr on a string value is outside the rules (the real env answers an error the rules don't model)
    assert total_cov >= 0.9 * total


def test_gate_rejects_invalid_effects_and_leaves_state_unchanged(built):
    wb, _, _ = built
    s = Session.start(wb, {"world": {"store": {"a": 1}, "size": 1}})
    before = json.dumps(s.state, sort_keys=True)
    act = ActionCall(name="put", arguments={"key": "a", "value": 2})
    bad = [
        [Effect(op="set", path="world.nowhere", value=1)],                       # undeclared path
        [Effect(op="set", path="world.size", value="many")],                    # wrong type
        [Effect(op="decrement", path="world.size", value=5)],                    # invariant size >= 0
        [Effect(op="delete", path="world.store.zzz")],                          # does not apply
        [Effect(op="set", path="world.store.$missing_arg", value=1)],           # does not resolve
        [Effect(op="set", path="world.store.a", value=3), Effect(op="append", path="world.size", value=1)],
    ]
    for effects in bad:
        d = validation_gate(wb, s.state, act, TransitionProposal(effects=tuple(effects)))
        assert not d.accepted and d.errors, effects
    d = validation_gate(wb, s.state, act, TransitionProposal(effects=(Effect(op="set", path="world.store.a", value=9),),
                                                             rule_ids=("put_existing",), outcome="success"))
    assert not d.accepted and "differ from cited rule" in d.errors[0]
    assert json.dumps(s.state, sort_keys=True) == before

    class Liar:  # a proposer whose effects break the invariant: rejected as an error observation
        def propose(self, workspace, action, *, seed):
            return TransitionProposal(effects=(Effect(op="decrement", path="world.size", value=9),), observation="ok")

    s2 = Session.start(wb, {"world": {"store": {"a": 1}, "size": 1}}, proposer=Liar())
    r = s2.step({"name": "incr", "arguments": {"key": "a"}, "unused": 1})
    assert r.route == "rule"  # a rule covers it: the proposer is not consulted
    r = s2.step({"name": "put", "arguments": {"key": "a", "value": "s"}})
    r = s2.step({"name": "incr", "arguments": {"key": "a"}})  # no rule applies to a string: the proposer lies
    assert r.route == "proposer" and not r.accepted and "invariant violated" in r.errors[0]
    assert s2.get("world.store.a") == "s" and s2.get("world.size") == 1


def test_invalid_actions_are_error_observations(built):
    wb, _, _ = built
    s = Session.start(wb)
    for bad, kind in [("not json", "invalid_action"), ({"name": "fly", "arguments": {}}, "unknown_action"),
                      ({"name": "get", "arguments": {}}, "invalid_action"),
                      ({"name": "get", "arguments": {"key": 3}}, "invalid_action"),
                      ({"name": "get", "arguments": '{"key": '}, "invalid_action"), (42, "invalid_action")]:
        r = s.step(bad)
        assert not r.accepted and json.loads(r.observation)["type"] == kind, bad
    assert s.revision == 0 and s.step_count == 6 and len(s.memory) == 6


def test_fork_is_isolated_and_shares_structure(built):
    wb, _, _ = built
    s = Session.start(wb)
    s.step({"name": "put", "arguments": {"key": "a", "value": "x"}})
    s.step({"name": "put", "arguments": {"key": "big", "value": "y"}})
    group = [s.fork() for _ in range(8)]
    for i, g in enumerate(group):
        g.step({"name": "put", "arguments": {"key": "a", "value": i}})
    assert [g.get("world.store.a") for g in group] == list(range(8))
    assert s.get("world.store.a") == "x" and len(s.memory) == 2 and all(len(g.memory) == 3 for g in group)
    assert group[0].memory.tail is s.memory  # memory shared, not copied
    assert group[0].state["session"] is s.state["session"]  # untouched namespaces shared
    assert group[0].memory.recall("big")[0].step == 2


def test_gym_api_reset_step_and_state_predicate_reward(built):
    wb, _, _ = built
    env = WorldbookEnv(wb, max_steps=5)
    obs, info = env.reset({"instruction": "store b", "initial_state": {"world": {"store": {"a": 1}, "size": 1}},
                           "conditions": [{"left": {"path": "world.store.b"}, "op": "eq", "right": {"literal": 7}}]},
                          seed=3)
    assert obs == "store b" and info["seed"] == 3
    real = FakeKV()
    real.store = {"a": 1}
    o, done, info = env.step({"name": "get", "arguments": {"key": "a"}})
    assert o == real.call("get", {"key": "a"}) and not done and "reward" not in info
    o, done, info = env.step({"name": "put", "arguments": {"key": "b", "value": 7}})
    assert o == real.call("put", {"key": "b", "value": 7}) and done and info["reward"] == 1.0
    env.reset({"max_steps": 2})
    assert env.step({"name": "count", "arguments": {}})[0] == '{"count": 0}'
    _, done, info = env.step({"name": "count", "arguments": {}})
    assert done and info["truncated"]


def test_ambiguous_rules_are_detected_not_guessed(tmp_path):
    rules = {"rules": [
        {"id": "r1", "action_type": "count", "priority": 1, "outcome": "success", "observation_template": "{\"count\": 0}"},
        {"id": "r2", "action_type": "count", "priority": 1, "outcome": "success", "observation_template": "{\"count\": 0}",
         "effects": [{"op": "set", "path": "world.size", "value": 0}]}]}
    sc = script()
    sc["induce_rules"] = rules
    traces = [parse_trace({"steps": [{"action": {"name": "count", "arguments": {}}, "observation": "{\"count\": 0}"}]})]
    wb = load_worldbook(build_worldbook(traces, tmp_path / "wb", provider=ScriptedProvider(sc)))
    assert {r.id for r in wb.rules} >= {"r1", "r2"}
    r = Session.start(wb).step({"name": "count", "arguments": {}})
    assert not r.accepted and json.loads(r.observation)["type"] == "ambiguous_rule"


# -- the evidence route -----------------------------------------------------------------------------------------------

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
