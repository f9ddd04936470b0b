"""The LLM judge of next-observation prediction: 1–5 → 0–100 mapping, the payload, masking of failures."""

from __future__ import annotations

import json

import numpy as np
import pytest
from t2e_kvenv import record

from trace2env import build_worldbook, load_worldbook, parse_trace
from trace2env.evaluate import evaluate
from trace2env.judge import DIMENSIONS, JUDGE_PROMPTS, JUDGE_STAGE, JudgeResult, JudgeVerdict, LLMJudge, to_0_100
from trace2env.models import ActionCall
from trace2env.providers import ConfigurationError, InfrastructureError, ModelOutputError, ScriptedProvider


def verdict(f, fa, c, r, q):
    return {"reasoning": "r", "format": f, "factuality": fa, "consistency": c, "realism": r, "quality": q}


@pytest.fixture(scope="module")
def judge_book(tmp_path_factory):
    traces = [parse_trace({**record(s, n=20), "metadata": {"initial_state_id": "empty"}}) for s in range(6)]
    return load_worldbook(build_worldbook(traces, tmp_path_factory.mktemp("kvj") / "wb"))


def test_scores_map_to_0_100_and_the_total_is_their_mean():
    assert to_0_100([1, 2, 3, 4, 5]).tolist() == [0.0, 25.0, 50.0, 75.0, 100.0]
    r = JudgeResult.from_verdict(JudgeVerdict.model_validate(verdict(5, 4, 3, 2, 1)))
    assert dict(r.raw) == {"format": 5, "factuality": 4, "consistency": 3, "realism": 2, "quality": 1}
    assert [r.scores[d] for d in DIMENSIONS] == [100.0, 75.0, 50.0, 25.0, 0.0] and r.total == 50.0
    r = JudgeResult.from_verdict(JudgeVerdict.model_validate(verdict(5, 5, 5, 5, 4)))
    assert r.total == pytest.approx(95.0)
    for bad in ([0, 3], [6], [np.nan]):
        with pytest.raises(ValueError, match="1..5"):
            to_0_100(bad)
    with pytest.raises(ValueError):  # a verdict outside 1..5 never validates (the provider repairs or fails)
        JudgeVerdict.model_validate(verdict(5, 5, 5, 5, 6))


def test_judge_payload_carries_rubric_context_prediction_and_reference():
    tr = parse_trace({"episode_id": "e", "events": [
        {"actor": "user", "kind": "message", "content": "store things"},
        {"actor": "agent", "kind": "action", "content": {"name": "put", "arguments": {"key": "a", "value": 1}}},
        {"actor": "environment", "kind": "observation", "content": '{"ok": true, "key": "a"}'}]})
    p = ScriptedProvider({JUDGE_STAGE: verdict(4, 4, 4, 4, 4)})
    j = LLMJudge(p)
    res = j.score(action=ActionCall(name="get", arguments={"key": "a"}), predicted='{"value": 2}',
                  reference='{"value": 1}', history=tr.events, environment="a key-value store")
    assert res is not None and res.total == 75.0 and j.judged == 1 and j.failure_count == 0
    stage, payload = p.calls[0]
    assert stage == JUDGE_STAGE
    assert payload["instructions"] == JUDGE_PROMPTS["judge_v1"] and "factuality" in payload["instructions"]
    assert payload["predicted_observation"] == '{"value": 2}' and payload["reference_observation"] == '{"value": 1}'
    assert payload["action"] == {"name": "get", "arguments": {"key": "a"}}
    assert [e["content"] for e in payload["context"]] == ["store things", json.dumps({"name": "put", "arguments":
                                                          {"key": "a", "value": 1}}), '{"ok": true, "key": "a"}']
    assert payload["environment"] == "a key-value store"
    with pytest.raises(ValueError, match="unknown judge prompt"):
        LLMJudge(p, prompt_version="judge_v0")


class Raising:
    def __init__(self, exc):
        self.exc = exc

    def complete(self, stage, payload, response_model):
        raise self.exc


def test_failed_judgements_are_masked_and_counted_configuration_errors_raise():
    a = ActionCall(name="count")
    j = LLMJudge(Raising(ModelOutputError("no valid verdict", text="5/5", rounds=3)))
    assert j.score(action=a, predicted="x", reference="y") is None
    j.provider = Raising(InfrastructureError("down"))
    assert j.score(action=a, predicted="x", reference="y") is None
    assert dict(j.failures) == {"model_output": 1, "infrastructure": 1} and j.judged == 0
    j.provider = Raising(ConfigurationError("HTTP 404"))
    with pytest.raises(ConfigurationError):
        j.score(action=a, predicted="x", reference="y")


def test_evaluate_excludes_masked_judgements_from_the_mean(judge_book):
    held = [parse_trace({**record(s, n=6), "metadata": {"initial_state_id": "empty"}}) for s in (200, 201)]
    n = evaluate(judge_book, held, mode="rules")["summary"]["steps"]
    assert n == 12
    # every third judgement fails validation (a score of 9): masked, never scored 0
    answers = [verdict(9, 1, 1, 1, 1) if i % 3 == 2 else verdict(1 + i % 5, 5, 5, 5, 5) for i in range(n)]
    j = LLMJudge(ScriptedProvider({JUDGE_STAGE: answers}))
    out = evaluate(judge_book, held, mode="rules", judge=j, n_boot=500)
    s, steps = out["summary"], out["steps"]
    ok = [i for i in range(n) if i % 3 != 2]
    want = [np.mean([(1 + i % 5 - 1) * 25.0, 100.0, 100.0, 100.0, 100.0]) for i in ok]
    assert s["judge_failures"] == n - len(ok) == 4 and s["judged"] == len(ok)
    assert [st["judge"] for st in steps] == [want[ok.index(i)] if i in ok else None for i in range(n)]
    assert s["judge"] == pytest.approx(np.mean(want))  # a zero for each failure would give 2/3 of it
    assert s["judge_format"] == pytest.approx(np.mean([(i % 5) * 25.0 for i in ok]))
    assert s["judge_factuality"] == 100.0
    lo, hi = s["judge_ci95"]
    assert lo <= s["judge"] <= hi
    assert s["judge_prompt_version"] == "judge_v1"
    # the judge saw each step's own recorded observation as the reference and the simulator's as the prediction
    calls = j.provider.calls
    assert [c[1]["predicted_observation"] for c in calls] == [st["predicted"] for st in steps]


def test_judge_over_http_repairs_an_invalid_verdict_and_masks_a_hopeless_one(fake_openai, replies):
    from trace2env.llm import OpenAIProvider, OpenAIProviderConfig

    texts = ['{"format": 6, "factuality": 1, "consistency": 1, "realism": 1, "quality": 1}',  # out of range
             "<think>ok</think>" + json.dumps(verdict(5, 5, 4, 4, 3))]
    srv = fake_openai(lambda body, n: replies.chat(texts[min(n, 1)]))
    p = OpenAIProvider(OpenAIProviderConfig(base_urls=srv.base_url, model="judge", repair_rounds=1, backoff_base_s=0.0))
    j = LLMJudge(p)
    res = j.score(action=ActionCall(name="count"), predicted='{"count": 2}', reference='{"count": 3}')
    assert res is not None and res.total == pytest.approx(np.mean([100, 100, 75, 75, 50]))
    assert len(srv.bodies) == 2 and p.usage[JUDGE_STAGE].repairs == 1
    assert srv.bodies[0]["response_format"]["json_schema"]["name"] == "JudgeVerdict"
    sent = json.loads(srv.bodies[0]["messages"][1]["content"])
    assert sent["instructions"] == JUDGE_PROMPTS["judge_v1"] and sent["reference_observation"] == '{"count": 3}'
    bad = fake_openai(lambda body, n: replies.chat("I cannot judge this"))
    j2 = LLMJudge(OpenAIProvider(OpenAIProviderConfig(base_urls=bad.base_url, model="judge", repair_rounds=1)))
    assert j2.score(action=ActionCall(name="count"), predicted="a", reference="b") is None
    assert dict(j2.failures) == {"model_output": 1} and len(bad.bodies) == 2
