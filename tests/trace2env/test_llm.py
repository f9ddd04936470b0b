"""OpenAIProvider against a real HTTP server speaking the OpenAI protocol: structured output, local
validation with repair rounds, truncation, the error taxonomy, accounting, the cache, and a build."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from t2e_kvenv import record, script

from trace2env import build_worldbook, load_worldbook, make_split_manifest, parse_trace
from trace2env.llm import OpenAIProvider, OpenAIProviderConfig, extract_json_object
from trace2env.providers import ConfigurationError, InfrastructureError, ModelOutputError, RuleProposal, SchemaProposal


def provider(url: str, **kw) -> OpenAIProvider:
    kw.setdefault("backoff_base_s", 0.0)
    return OpenAIProvider(OpenAIProviderConfig(base_urls=url, model="m", **kw))


GOOD = {"rules": [{"id": "r", "action_type": "count", "observation_template": "{}"}]}


def test_structured_request_validation_and_accounting(fake_openai, replies):
    srv = fake_openai(lambda body, n: replies.chat(json.dumps(GOOD), prompt_tokens=1000, completion_tokens=200))
    p = provider(srv.base_url, usd_per_m_prompt=2.0, usd_per_m_completion=10.0)
    out = p.complete("induce_rules", {"transitions": [1, 2]}, RuleProposal)
    assert isinstance(out, RuleProposal) and out.rules[0].id == "r"
    body = srv.bodies[0]
    assert body["model"] == "m" and body["temperature"] == 0.0 and body["max_tokens"] == 2048
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["name"] == "RuleProposal"
    assert "transition rules" in body["messages"][0]["content"]  # the stage's instruction
    assert json.loads(body["messages"][1]["content"]) == {"transitions": [1, 2]}
    u = p.usage["induce_rules"]
    assert (u.calls, u.requests, u.repairs, u.prompt_tokens, u.completion_tokens) == (1, 1, 0, 1000, 200)
    assert u.usd == pytest.approx(1000 * 2e-6 + 200 * 10e-6)
    assert p.usage_table()[-1]["stage"] == "total"


def test_invalid_reply_is_repaired_then_gives_up(fake_openai, replies):
    texts = ["not json at all", '```json\n{"rules": [{"bogus": 1}]}\n```', "<think>hm</think> " + json.dumps(GOOD)]
    srv = fake_openai(lambda body, n: replies.chat(texts[min(n, 2)]))
    p = provider(srv.base_url, repair_rounds=2)
    assert p.complete("induce_rules", {}, RuleProposal).rules[0].id == "r"
    assert len(srv.bodies) == 3 and p.usage["induce_rules"].repairs == 2
    last = srv.bodies[2]["messages"]
    assert last[-2] == {"role": "assistant", "content": texts[1]}
    assert "rules.0" in last[-1]["content"] and "could not be used" in last[-1]["content"]

    srv2 = fake_openai(lambda body, n: replies.chat("still not json"))
    p2 = provider(srv2.base_url, repair_rounds=1)
    with pytest.raises(ModelOutputError, match="after 2 request") as e:
        p2.complete("induce_rules", {}, RuleProposal)
    assert e.value.rounds == 2 and len(srv2.bodies) == 2 and p2.usage["induce_rules"].failures == 1


def test_truncated_reply_doubles_the_budget(fake_openai, replies):
    srv = fake_openai(lambda body, n: replies.chat('{"rules": [', "length") if n == 0 else replies.chat(json.dumps(GOOD)))
    p = provider(srv.base_url, max_tokens=100, max_tokens_cap=150)
    p.complete("induce_rules", {}, RuleProposal)
    assert [b["max_tokens"] for b in srv.bodies] == [100, 150]
    assert "cut off at 100 tokens" in srv.bodies[1]["messages"][-1]["content"]


def test_error_taxonomy(fake_openai, replies, dead_url):
    srv = fake_openai(lambda body, n: replies.error(503) if n < 2 else replies.chat(json.dumps(GOOD)))
    p = provider(srv.base_url, max_retries=2)
    p.complete("induce_rules", {}, RuleProposal)
    assert len(srv.bodies) == 3 and p.usage["induce_rules"].retries == 2  # infrastructure: retried

    srv404 = fake_openai(lambda body, n: replies.error(404, "model not found"))
    p = provider(srv404.base_url, max_retries=3)
    with pytest.raises(ConfigurationError, match="HTTP 404"):
        p.complete("induce_rules", {}, RuleProposal)
    assert len(srv404.bodies) == 1  # configuration: never retried

    p = provider(dead_url, max_retries=1, timeout_s=2.0)
    with pytest.raises(InfrastructureError, match="2 attempt"):
        p.complete("induce_rules", {}, RuleProposal)

    srv_down = fake_openai(lambda body, n: replies.error(429))
    with pytest.raises(InfrastructureError, match="HTTP 429"):
        provider(srv_down.base_url, max_retries=1).complete("induce_rules", {}, RuleProposal)
    assert len(srv_down.bodies) == 2


def test_cache_resumes_without_paying_twice(fake_openai, replies, tmp_path):
    srv = fake_openai(lambda body, n: replies.chat(json.dumps(GOOD)))
    a = provider(srv.base_url, cache_dir=str(tmp_path / "cache"), response_format="json_object")
    a.complete("induce_rules", {"x": 1}, RuleProposal)
    assert srv.bodies[0]["response_format"] == {"type": "json_object"}
    b = provider(srv.base_url, cache_dir=str(tmp_path / "cache"), response_format="json_object")
    assert b.complete("induce_rules", {"x": 1}, RuleProposal).rules[0].id == "r"
    assert len(srv.bodies) == 1 and b.usage["induce_rules"].cache_hits == 1
    b.complete("induce_rules", {"x": 2}, RuleProposal)  # another payload: another key
    assert len(srv.bodies) == 2


@pytest.mark.parametrize("change", [
    {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}},
    {"max_tokens": 64},
    {"temperature": 0.7},
    {"response_format": "json_schema"},
    {"model": "other"},
    {"max_tokens_cap": 4096},
    {"repair_rounds": 0},
])
def test_cache_key_covers_every_parameter_that_changes_the_answer(fake_openai, replies, tmp_path, change):
    """Old behaviour: the key was (model, stage, messages, schema, temperature, response_format), so two
    configurations differing only in extra_body (e.g. thinking on/off) or max_tokens shared cached answers."""
    srv = fake_openai(lambda body, n: replies.chat(json.dumps(GOOD)))
    base = {"cache_dir": str(tmp_path / "cache"), "response_format": "json_object", "max_tokens": 512,
            "extra_body": {"chat_template_kwargs": {"enable_thinking": False}, "seed": 3}}
    kw = {**base, **change}
    model = kw.pop("model", "m")
    provider(srv.base_url, **base).complete("induce_rules", {"x": 1}, RuleProposal)
    changed = OpenAIProvider(OpenAIProviderConfig(base_urls=srv.base_url, model=model, backoff_base_s=0.0, **kw))
    changed.complete("induce_rules", {"x": 1}, RuleProposal)
    assert len(srv.bodies) == 2 and changed.usage["induce_rules"].cache_hits == 0  # a miss: asked again
    assert len(list((tmp_path / "cache" / "induce_rules").glob("*.json"))) == 2
    sent = srv.bodies[1]
    if "extra_body" in change:
        assert sent["chat_template_kwargs"] == {"enable_thinking": True} and "seed" not in sent
    if "max_tokens" in change:
        assert sent["max_tokens"] == 64


def test_identical_requests_hit_the_cache_across_instances(fake_openai, replies, tmp_path):
    """The key is canonical (sorted keys): the same request from another provider, with extra_body written in
    another order, is answered from the cache; the key is a pure function of the request (stable across
    processes: no hash(), no object ids)."""
    srv = fake_openai(lambda body, n: replies.chat(json.dumps(GOOD)))
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "seed": 3}
    a = provider(srv.base_url, cache_dir=str(tmp_path / "cache"), max_tokens=512, extra_body=extra)
    a.complete("induce_rules", {"x": 1}, RuleProposal)
    assert srv.bodies[0]["seed"] == 3 and srv.bodies[0]["max_tokens"] == 512
    b = provider(srv.base_url, cache_dir=str(tmp_path / "cache"), max_tokens=512, timeout_s=5.0,
                 extra_body=dict(reversed(list(extra.items()))))
    assert b.complete("induce_rules", {"x": 1}, RuleProposal).rules[0].id == "r"
    assert len(srv.bodies) == 1 and b.usage["induce_rules"].cache_hits == 1
    req = b._request_body(b.messages("induce_rules", {"x": 1}, RuleProposal), RuleProposal)
    assert a.cache_key("induce_rules", req) == b.cache_key("induce_rules", json.loads(json.dumps(req)))
    assert a.cache_key("induce_rules", req) != a.cache_key("induce_notes", req)


def test_cache_refuses_an_extra_body_that_is_not_json(tmp_path):
    p = provider("http://127.0.0.1:9/v1", cache_dir=str(tmp_path / "cache"), extra_body={"seed": {1, 2}})
    with pytest.raises(ConfigurationError, match="extra_body"):
        p.complete("induce_rules", {}, RuleProposal)


def test_build_with_the_openai_provider_over_http(fake_openai, replies, tmp_path):
    """The construction stages through a real HTTP round trip: a server answering the KV environment's
    schema and rules; the replay review still promotes the true rules and falsifies the wrong one."""
    answers = script()

    def responder(body, n):
        name = body["response_format"]["json_schema"]["name"]
        return replies.chat(json.dumps(answers["induce_schema" if name == SchemaProposal.__name__ else "induce_rules"]))

    srv = fake_openai(responder)
    traces = [parse_trace(record(s, n=30)) for s in range(10)]
    p = provider(srv.base_url)
    wb = load_worldbook(build_worldbook(traces, tmp_path / "wb", provider=p, split=make_split_manifest(traces, train=0.7)))
    ids = {r.id for r in wb.rules}
    assert {"put_new", "get_found", "count"} <= ids and "get_wrong" not in ids
    assert sorted(p.usage) == ["induce_rules", "induce_schema"]
    assert wb.manifest.metadata["model_stages"] == ["induce_schema", "induce_rules"]


texts = st.text(alphabet=st.characters(blacklist_characters="`"), max_size=8)  # a backtick could close a fence


json_values = st.recursive(st.none() | st.booleans() | st.integers() | texts,
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                           max_leaves=10)


@given(obj=st.dictionaries(texts, json_values, max_size=4),
       wrap=st.sampled_from(["%s", "```json\n%s\n```", "<think>a { b</think>%s", "Here it is: %s -- done"]))
def test_extract_json_object_finds_the_object(obj, wrap):
    assert extract_json_object(wrap.replace("%s", json.dumps(obj), 1)) == obj


@given(text=st.text(max_size=40).filter(lambda t: "{" not in t))
def test_extract_json_object_refuses_text_without_an_object(text):
    with pytest.raises(ValueError):
        extract_json_object(text)
