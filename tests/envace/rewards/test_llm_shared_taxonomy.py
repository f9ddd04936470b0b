"""One error taxonomy across envace and trace2env: the classes envace catches are the ones trace2env's provider
raises (envllm defines them once), checked with real HTTP failures of a local OpenAI-style server."""

from __future__ import annotations

import json

import pytest

import envllm
from envace.agents.client import classify_http_error
from envace.agents.engine import ModelError
from envace.rewards import llm as envace_llm
from trace2env import providers as t2e_providers
from trace2env.llm import OpenAIProvider, OpenAIProviderConfig
from trace2env.providers import RuleProposal


@pytest.mark.parametrize("name", ["InfrastructureError", "ConfigurationError", "ModelOutputError", "LLMError",
                                  "JudgeFormatError", "extract_json_object"])
def test_envace_names_are_the_core_objects(name):
    assert getattr(envace_llm, name) is getattr(envllm, name)


def test_trace2env_names_are_the_core_objects():
    for name in ("InfrastructureError", "ConfigurationError", "ModelOutputError"):
        assert getattr(t2e_providers, name) is getattr(envllm, name)
    assert t2e_providers.ProviderError is envace_llm.LLMError


def _provider(url: str, **kw) -> OpenAIProvider:
    return OpenAIProvider(OpenAIProviderConfig(base_urls=url, model="m", backoff_base_s=0.0, **kw))


def test_envace_except_clauses_catch_what_the_trace2env_provider_raises(fake_openai, replies):
    down = fake_openai(lambda body, n: replies.error(503))
    try:
        _provider(down.base_url, max_retries=1).complete("induce_rules", {}, RuleProposal)
    except envace_llm.InfrastructureError as e:  # what envace/eval/cli.py and runner.py catch
        assert e.attempts == 2 and not e.timed_out and "HTTP 503" in str(e)
    else:
        pytest.fail("no InfrastructureError")
    assert len(down.bodies) == 2

    wrong = fake_openai(lambda body, n: replies.error(404, "model not found"))
    with pytest.raises(envace_llm.ConfigurationError, match="base URL end in /v1") as e:
        _provider(wrong.base_url).complete("induce_rules", {}, RuleProposal)
    assert (e.value.status_code, e.value.base_url) == (404, wrong.base_url)

    garbage = fake_openai(lambda body, n: replies.chat("no json"))
    with pytest.raises(envace_llm.ModelOutputError) as e:
        _provider(garbage.base_url, repair_rounds=1).complete("induce_rules", {}, RuleProposal)
    assert e.value.rounds == 2 and e.value.text == "no json" and not isinstance(e.value, envace_llm.JudgeFormatError)


async def test_trace2env_except_clauses_catch_what_the_envace_pool_raises(fake_openai, replies):
    srv = fake_openai(lambda body, n: replies.error(502))
    cfg = envace_llm.LLMEndpointConfig(base_urls=[srv.base_url], model="judge", max_retries=0, backoff_base_s=0.0)
    async with envace_llm.LLMPool(cfg) as pool:
        with pytest.raises(t2e_providers.InfrastructureError):
            await pool.complete_text([{"role": "user", "content": "hi"}])
    good = fake_openai(lambda body, n: replies.chat(json.dumps({"rules": "not a list"})))
    cfg = envace_llm.LLMEndpointConfig(base_urls=[good.base_url], model="judge")
    async with envace_llm.LLMPool(cfg) as pool:
        with pytest.raises(t2e_providers.ModelOutputError):  # JudgeFormatError is one
            await pool.complete_json([{"role": "user", "content": "hi"}], RuleProposal, repair_rounds=0)


@pytest.mark.parametrize(("status", "message", "kind"), [
    (None, "connection refused", envllm.InfrastructureError),
    (429, "slow down", envllm.InfrastructureError),
    (503, "overloaded", envllm.InfrastructureError),
    (400, "This model's maximum context length is 8192 tokens", ModelError),
    (400, "unknown field 'tools'", envllm.ConfigurationError),
    (404, "no such model", envllm.ConfigurationError),
])
def test_the_eval_client_classifies_into_the_core_taxonomy(status, message, kind):
    err = classify_http_error(status, message, base_url="http://h/v1", model="m")
    assert type(err) is kind
    if status == 404:
        assert "base URL end in /v1" in str(err) and err.status_code == 404
