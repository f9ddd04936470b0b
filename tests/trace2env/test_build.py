"""Building a worldbook (``trace2env/build.py``): the replay review promotes true rules and falsifies a wrong one; a
build without a model is deterministic."""

from __future__ import annotations

import json

import pytest
from t2e_kvenv import record

from trace2env import Session, build_worldbook, load_worldbook, parse_trace


def test_replay_review_promotes_true_rules_and_falsifies_the_wrong_one(built):
    wb, _, _ = built
    executable = {r.id for r in wb.rules}
    assert {"put_new", "put_existing", "get_found", "get_missing", "delete_found", "count"} <= executable
    cand = {r.id: r for r in wb.candidate_rules}
    assert cand["get_wrong"].status == "conflicted" and cand["get_wrong"].counterexamples
    assert "get_wrong" not in executable
    # deterministic template rule for put (state-free observation) was induced and survived review
    assert any(r.id.startswith("tpl:put:") and r.status == "supported" for r in wb.rules)
    assert {a.name for a in wb.actions} == {"put", "get", "delete", "incr", "count"}
    assert wb.actions[[a.name for a in wb.actions].index("put")].arguments["value"].type == "any"  # str and int seen
    assert any(f.path == "world.store" for f in wb.state_fields)


def test_deterministic_build_without_a_model(tmp_path):
    traces = [parse_trace(record(s)) for s in range(5)]
    wb = load_worldbook(build_worldbook(traces, tmp_path / "wb"))
    assert [r.action_type for r in wb.rules] == ["put"]  # the only state-free action
    s = Session.start(wb)
    r = s.step({"name": "put", "arguments": {"key": "q.r", "value": "v1"}})
    assert r.route == "rule" and r.observation == json.dumps({"ok": True, "key": "q.r"})
    r = s.step({"name": "get", "arguments": {"key": "q.r"}})
    assert not r.accepted and json.loads(r.observation)["type"] == "no_applicable_rule"
    ev = wb.exact_evidence("get", {"key": "a"})
    assert ev and all(t.action.arguments == {"key": "a"} for t in ev)
    hits = wb.search_evidence("deleted")
    assert hits and all("deleted" in h["observation"] for h in hits)
    assert wb.manifest.metadata["deterministic"] is True
    with pytest.raises(FileExistsError):
        build_worldbook(traces, tmp_path / "wb")
