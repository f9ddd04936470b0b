"""LLMPool against a real local HTTP server: routing, concurrency, timeouts, retries, error taxonomy, JSON."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import BaseModel, ConfigDict

from envace.rewards import (
    ConfigurationError,
    InfrastructureError,
    JudgeFormatError,
    LLMEndpointConfig,
    LLMPool,
    ModelOutputError,
    extract_json_object,
)

pytestmark = pytest.mark.timeout(30)


def cfg(*urls: str, **kw) -> LLMEndpointConfig:
    base = {"model": "judge", "timeout_s": 2.0, "max_retries": 2, "backoff_base_s": 0.01, "backoff_max_s": 0.02}
    base.update(kw)
    return LLMEndpointConfig(base_urls=list(urls), **base)


class Verdict(BaseModel):
    model_config = ConfigDict(strict=True)
    reasoning: str
    answer: bool


USER = [{"role": "user", "content": "hi"}]


# -- config ---------------------------------------------------------------------------------------------
def test_config_validation_and_api_key_env(monkeypatch) -> None:
    with pytest.raises(ValueError, match="base_urls"):
        LLMEndpointConfig(base_urls=[], model="m")
    with pytest.raises(ValueError, match="concurrency"):
        LLMEndpointConfig(base_urls=["http://x/v1"], model="m", concurrency=0)
    c = LLMEndpointConfig(base_urls="http://x/v1/", model="m", api_key="k", api_key_env="ENVACE_TEST_KEY")
    assert c.base_urls == ["http://x/v1"]
    monkeypatch.delenv("ENVACE_TEST_KEY", raising=False)
    assert c.resolved_api_key() == "k"
    monkeypatch.setenv("ENVACE_TEST_KEY", "from-env")
    assert c.resolved_api_key() == "from-env"


# -- plain completions ----------------------------------------------------------------------------------
async def test_complete_text_success_sends_config(fake_openai, replies, monkeypatch) -> None:
    monkeypatch.setenv("ENVACE_TEST_KEY", "sk-test")
    srv = fake_openai(replies.script(replies.chat("hello")))
    pool = LLMPool(cfg(srv.base_url, api_key_env="ENVACE_TEST_KEY", temperature=0.3, top_p=0.9, max_tokens=77))
    async with pool:
        assert await pool.complete_text(USER, seed=5) == "hello"
    body = srv.bodies[0]
    assert body["model"] == "judge" and body["messages"] == USER
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.3, 0.9, 77, 5)
    assert srv.headers[0]["authorization"] == "Bearer sk-test"
    c = pool.counters()
    assert (c["calls"], c["requests"], c["successes"], c["retries"], c["failures"]) == (1, 1, 1, 0, 0)
    assert c["latency_sum_s"] > 0 and c["latency_mean_s"] == c["latency_sum_s"]


async def test_http_500_twice_then_success_is_retried(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.error(500), replies.error(503), replies.chat("ok")))
    async with LLMPool(cfg(srv.base_url)) as pool:
        completion = await pool.complete(USER)
    assert completion.text == "ok" and completion.attempts == 3
    assert srv.n_requests == 3
    c = pool.counters()
    assert (c["requests"], c["retries"], c["server_errors"], c["successes"], c["failures"]) == (3, 2, 2, 1, 0)


async def test_429_honours_retry_after_within_backoff_cap(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.error(429, headers={"Retry-After": "0.05"}), replies.chat("ok")))
    async with LLMPool(cfg(srv.base_url, backoff_max_s=0.05)) as pool:
        assert await pool.complete_text(USER) == "ok"
    assert pool.counters()["retries"] == 1


async def test_5xx_forever_raises_infrastructure_error_after_retries(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.error(502, "bad gateway")))
    async with LLMPool(cfg(srv.base_url, max_retries=3)) as pool:
        with pytest.raises(InfrastructureError, match="4 attempt.*HTTP 502") as exc:
            await pool.complete_text(USER)
    assert exc.value.attempts == 4 and not exc.value.timed_out
    assert srv.n_requests == 4
    c = pool.counters()
    assert (c["retries"], c["failures"], c["successes"]) == (3, 1, 0)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
async def test_configuration_errors_abort_without_retry(fake_openai, replies, status) -> None:
    srv = fake_openai(replies.script(replies.error(status, "The model `judge` does not exist.")))
    async with LLMPool(cfg(srv.base_url, max_retries=5)) as pool:
        with pytest.raises(ConfigurationError, match=f"HTTP {status}.*does not exist") as exc:
            await pool.complete_text(USER)
    assert exc.value.status_code == status and exc.value.base_url == srv.base_url
    assert srv.n_requests == 1
    c = pool.counters()
    assert (c["requests"], c["retries"], c["config_errors"], c["failures"]) == (1, 0, 1, 1)


async def test_model_not_found_404_names_model_and_hint(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.error(404, "The model `judge` does not exist.")))
    async with LLMPool(cfg(srv.base_url)) as pool:
        with pytest.raises(ConfigurationError, match=r"model 'judge'.*base URL end in /v1"):
            await pool.complete_text(USER)


async def test_timeout_raises_infrastructure_error_after_retries(fake_openai, replies) -> None:
    slow = replies.chat("late")
    slow.delay = 1.0
    srv = fake_openai(replies.script(slow))
    async with LLMPool(cfg(srv.base_url, timeout_s=0.2, max_retries=2)) as pool:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(InfrastructureError, match="no reply within 0.2s") as exc:
            await pool.complete_text(USER)
        elapsed = loop.time() - start
    assert exc.value.timed_out and exc.value.attempts == 3
    assert 0.55 < elapsed < 1.5
    c = pool.counters()
    assert (c["timeouts"], c["retries"], c["requests"], c["failures"]) == (3, 2, 3, 1)


async def test_malformed_body_is_infrastructure(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.Reply(200, {"object": "chat.completion", "choices": []})))
    async with LLMPool(cfg(srv.base_url, max_retries=1)) as pool:
        with pytest.raises(InfrastructureError, match="no choices"):
            await pool.complete_text(USER)
    assert srv.n_requests == 2


# -- routing and concurrency ----------------------------------------------------------------------------
async def test_one_base_url_down_requests_go_to_live_one(fake_openai, replies, dead_url) -> None:
    live = fake_openai(replies.script(replies.chat("ok")))
    async with LLMPool(cfg(dead_url, live.base_url, concurrency=2, unhealthy_cooldown_s=60)) as pool:
        texts = await asyncio.gather(*(pool.complete_text(USER) for _ in range(10)))
    assert texts == ["ok"] * 10
    assert live.n_requests == 10
    stats = {s["base_url"]: s for s in pool.endpoint_stats()}
    assert stats[dead_url]["failures"] >= 1 and not stats[dead_url]["healthy"]
    assert stats[live.base_url]["requests"] == 10 and stats[live.base_url]["healthy"]
    c = pool.counters()
    assert c["failures"] == 0 and 1 <= c["connection_errors"] == c["retries"] <= 2


async def test_all_base_urls_down_is_infrastructure_error(dead_url) -> None:
    async with LLMPool(cfg(dead_url, max_retries=1)) as pool:
        with pytest.raises(InfrastructureError, match="connection failed"):
            await pool.complete_text(USER)
    assert pool.counters()["connection_errors"] == 2


async def test_round_robin_spreads_over_live_urls(fake_openai, replies) -> None:
    a = fake_openai(replies.script(replies.chat("a")))
    b = fake_openai(replies.script(replies.chat("b")))
    async with LLMPool(cfg(a.base_url, b.base_url, routing="round_robin")) as pool:
        texts = [await pool.complete_text(USER) for _ in range(6)]
    assert texts == ["a", "b"] * 3
    assert (a.n_requests, b.n_requests) == (3, 3)


async def test_least_busy_uses_both_urls_under_load(fake_openai, replies) -> None:
    slow_a, slow_b = replies.chat("a"), replies.chat("b")
    slow_a.delay = slow_b.delay = 0.1
    a, b = fake_openai(replies.script(slow_a)), fake_openai(replies.script(slow_b))
    async with LLMPool(cfg(a.base_url, b.base_url, concurrency=4)) as pool:
        await asyncio.gather(*(pool.complete_text(USER) for _ in range(8)))
    assert (a.n_requests, b.n_requests) == (4, 4)
    assert (a.max_in_flight, b.max_in_flight) == (2, 2)


async def test_concurrency_limit_is_respected(fake_openai, replies) -> None:
    slow = replies.chat("ok")
    slow.delay = 0.1
    srv = fake_openai(replies.script(slow))
    async with LLMPool(cfg(srv.base_url, concurrency=3)) as pool:
        texts = await asyncio.gather(*(pool.complete_text(USER) for _ in range(12)))
    assert texts == ["ok"] * 12
    assert srv.max_in_flight == 3  # the server saw the limit reached, never exceeded
    assert pool.counters()["max_in_flight"] == 3


def test_pool_survives_a_new_event_loop(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.chat("ok")))
    pool = LLMPool(cfg(srv.base_url))
    assert asyncio.run(pool.complete_text(USER)) == "ok"
    assert asyncio.run(pool.complete_text(USER)) == "ok"  # clients + semaphore rebuilt for the new loop
    assert pool.counters()["successes"] == 2


# -- JSON -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        '{"reasoning": "r", "answer": true}',
        '<think>hmm {"answer": false}</think>\n{"reasoning": "r", "answer": true}',
        'Sure.\n```json\n{"reasoning": "r", "answer": true}\n```\n',
        '</think>```\n{"reasoning": "r", "answer": true}\n```',
        'Verdict: {"reasoning": "r", "answer": true} -- done',
    ],
)
def test_extract_json_object_tolerates_think_fences_and_prose(text) -> None:
    assert extract_json_object(text) == {"reasoning": "r", "answer": True}


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        (None, "empty"),
        ("<think>still thinking", "unterminated <think>"),
        ("<think>x</think>   ", "no text after"),
        ("[1, 2]", "not a JSON object"),
        ("answer: yes", "no JSON object"),
    ],
)
def test_extract_json_object_errors(text, reason) -> None:
    with pytest.raises(ValueError, match=reason):
        extract_json_object(text)


async def test_complete_json_success(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.chat('```json\n{"reasoning": "fine", "answer": false}\n```')))
    async with LLMPool(cfg(srv.base_url)) as pool:
        v = await pool.complete_json(USER, Verdict)
    assert v == Verdict(reasoning="fine", answer=False)
    assert "response_format" not in srv.bodies[0]
    assert pool.counters()["repairs"] == 0


async def test_complete_json_invalid_then_repaired(fake_openai, replies) -> None:
    srv = fake_openai(
        replies.script(replies.chat('{"reasoning": "r", "answer": "yes"}'), replies.verdict(True, "fixed"))
    )
    async with LLMPool(cfg(srv.base_url)) as pool:
        v = await pool.complete_json(USER, Verdict, repair_rounds=1)
    assert v.answer is True and v.reasoning == "fixed"
    assert srv.n_requests == 2
    repair = srv.bodies[1]["messages"]
    assert repair[:1] == USER
    assert repair[1] == {"role": "assistant", "content": '{"reasoning": "r", "answer": "yes"}'}
    assert repair[2]["role"] == "user" and "answer: Input should be a valid boolean" in repair[2]["content"]
    assert '"answer"' in repair[2]["content"]  # the schema is shown
    c = pool.counters()
    assert (c["repairs"], c["format_errors"], c["calls"]) == (1, 0, 2)


async def test_complete_json_permanent_garbage_raises_judge_format_error(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.chat("I think the answer is yes.")))
    async with LLMPool(cfg(srv.base_url)) as pool:
        with pytest.raises(JudgeFormatError, match="no valid Verdict JSON after 3 request") as exc:
            await pool.complete_json(USER, Verdict, repair_rounds=2)
    assert isinstance(exc.value, ModelOutputError) and exc.value.text == "I think the answer is yes."
    assert srv.n_requests == 3
    assert pool.counters()["format_errors"] == 1


async def test_complete_json_truncated_reply_reason_mentions_length(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.chat('{"reasoning": "long', finish_reason="length")))
    async with LLMPool(cfg(srv.base_url)) as pool:
        with pytest.raises(JudgeFormatError, match="cut off at max_tokens"):
            await pool.complete_json(USER, Verdict, repair_rounds=0)
    assert srv.n_requests == 1


async def test_complete_json_schema_pass_through(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.verdict(True)))
    async with LLMPool(cfg(srv.base_url, use_json_schema=True)) as pool:
        await pool.complete_json(USER, Verdict)
        await pool.complete_json(USER, Verdict, use_json_schema=False)
    rf = srv.bodies[0]["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["name"] == "Verdict"
    assert set(rf["json_schema"]["schema"]["properties"]) == {"reasoning", "answer"}
    assert "response_format" not in srv.bodies[1]


async def test_extra_body_is_merged(fake_openai, replies) -> None:
    srv = fake_openai(replies.script(replies.chat("ok")))
    pool = LLMPool(cfg(srv.base_url, extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    async with pool:
        await pool.complete_text(USER, extra_body={"top_k": 5}, max_tokens=None)
    body = srv.bodies[0]
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["top_k"] == 5
    assert "max_tokens" not in body
    assert json.dumps(body)  # plain JSON
