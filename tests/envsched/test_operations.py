"""Operation descriptions (``envsched/operations.py``, App. E): the abstraction of identifiers, fields and
literals, tool operation types, the deterministic extractor (and its unvalidated texts, equal to its validated
description's), and the LLM extractor (fake client, schema failures, cache, and the real openai client against a
local stdlib HTTP server)."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest

from envllm import ConfigurationError, InfrastructureError, ModelOutputError
from envsched import (
    EnvSchedConfig,
    LLMExtractor,
    LLMExtractorConfig,
    OperationExtractionError,
    TaskPool,
    abstract_text,
    build_static_graph,
)
from envsched.config import ConfigError
from envsched.operations import DeterministicExtractor, OperationDescription, concrete_text, tool_operation_type
from envsched.pool import Action, Task, Tool
from envsched.synthetic import synthetic_records


def test_abstraction_removes_identifiers_fields_and_literals():
    def task(tool_a, tool_b, field, name, value):
        return TaskPool.from_records([{
            "task_id": "t", "env_id": "e", "instruction": f"Set status of {name} to {value}",
            "tools": [{"name": tool_a, "parameters": {"properties": {"name": {}}}}, {"name": tool_b, "parameters": {"properties": {field: {}}}}],
            "verifier_checks": [f"{field} is {value}"],
            "gold_actions": [{"name": tool_a, "arguments": {"name": name}}, {"name": tool_b, "arguments": {"user_id": "U-1234", field: value}}],
        }])[0]

    ext = DeterministicExtractor()
    a = ext.describe(task("get_user_by_name", "update_user_status", "status", "Alice", "active"))
    b = ext.describe(task("find_patient_by_name", "update_bed_status", "occupancy", "Bob Stone", "occupied"))
    ta, tb = abstract_text(a), abstract_text(b)
    assert ta == tb
    for word in ("user", "alice", "u-1234", "active", "occupancy", "get_", "update_"):
        assert word not in ta.lower()
    assert "op:lookup(entity_by_name)" in ta and "<id>" in ta and "<string>" in ta
    assert "dep:lookup(entity_by_name)>update(status)" in ta


def test_tool_operation_types():
    assert [tool_operation_type(n) for n in ("get_user_by_name", "update_user_status", "createReservation", "remove_exclusion", "verify_eligibility", "is_authorized_user_for_policy", "frobnicate")] == [
        "lookup", "update", "create", "delete", "validate", "authorize", "update"]


def test_deterministic_description_is_valid_and_structured():
    pool = TaskPool.from_records(synthetic_records(2, 3, seed=1))
    for t in pool.tasks:
        d = DeterministicExtractor().describe(t)
        OperationDescription.model_validate(d.model_dump())  # round-trips through the schema
        assert len(d.operations) == len(t.gold_actions)
        assert sum(len(r.checks) for r in d.reward_groups) == len(t.verifier_checks)


# -- LLM operation extraction (App. E): fake client, schema failures, cache, a local HTTP server ----------------------

GOOD = {
    "operations": [
        {"id": "a", "type": "lookup", "tool": "get_user_by_name", "target_kind": "entity_by_name", "arguments": {"name": "<string>"}},
        {"id": "b", "type": "update", "tool": "set_user_status", "target_kind": "status", "depends_on": ["a"], "arguments": {"status": "<string>"}},
    ],
    "gates": [{"id": "g", "type": "identifier_resolution", "provenance": "unique_lookup", "blocks": ["b"]}],
    "dependencies": [{"source": "a", "target": "b"}],
    "reward_groups": [{"checks": [0], "relation": "shared_operation", "controlled_by": ["b"]}],
    "conflicts": [],
}


RECORD = {
    "task_id": "t1", "env_id": "users", "instruction": "Update user Alice's status to active",
    "tools": [{"name": "get_user_by_name", "description": "find a user"}, {"name": "set_user_status"}],
    "verifier_checks": ["user status is active"],
    "gold_actions": [{"name": "get_user_by_name", "arguments": {"name": "Alice"}}, {"name": "set_user_status", "arguments": {"user_id": "U-7", "status": "active"}}],
}


class FakeClient:
    """Minimal object with the openai client's chat.completions.create shape."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.calls = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    def _create(self, **kw):
        self.calls.append(kw)
        content = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=content))])


def _task():
    return TaskPool.from_records([RECORD])[0]


def _extractor(client, **kw) -> LLMExtractor:
    """An extractor over ``client`` (no on-disk cache unless ``cache_dir`` is given)."""
    return LLMExtractor(LLMExtractorConfig(**{"base_urls": "http://unused/v1", "model": "m", "cache_dir": None, **kw}), client)


class StatusError(Exception):
    """What the openai client raises for an HTTP error answer: the status on ``status_code``."""

    def __init__(self, status_code):
        super().__init__(f"Error code: {status_code}")
        self.status_code = status_code


class FailingClient(FakeClient):
    """A client whose every request raises ``exc``."""

    def __init__(self, exc):
        super().__init__([""])
        self.exc = exc

    def _create(self, **kw):
        self.calls.append(kw)
        raise self.exc


def test_deterministic_texts_equal_the_validated_descriptions_texts():
    """DeterministicExtractor.texts (what a graph build keeps, made without the pydantic models) equals the texts of
    describe's validated description, with and without gold calls; pool values the schema refuses fail as in
    describe, and values it coerces are taken from the validated description."""
    recs = synthetic_records(8, 30, seed=5)
    bare = [{k: v for k, v in r.items() if k != "gold_actions"} for r in recs]
    ext = DeterministicExtractor()
    for pool in (TaskPool.from_records(recs), TaskPool.from_records(bare)):
        for t in pool.tasks:
            d = ext.describe(t)
            assert OperationDescription.model_validate(d.model_dump()) == d
            assert ext.texts(t) == (concrete_text(d), abstract_text(d))
    bad = Task(task_id="t", env_id="e", instruction="get it", tools=(Tool(name="get_it", description=None),),  # type: ignore[arg-type]
               gold_actions=(Action(name="get_it", arguments={"id": "A-12"}),))
    with pytest.raises(ValueError, match="description"):
        ext.describe(bad)
    with pytest.raises(ValueError, match="description"):
        ext.texts(bad)
    coerced = Task(task_id="t", env_id="e", instruction="get it", tools=(Tool(name="get_it", description=b"raw bytes"),),  # type: ignore[arg-type]
                   gold_actions=(Action(name="get_it", arguments={"id": "A-12"}),))
    d = ext.describe(coerced)
    assert d.operations[0].description == "raw bytes" and ext.texts(coerced) == (concrete_text(d), abstract_text(d))


def test_valid_answer_is_validated_and_cached(tmp_path):
    client = FakeClient([json.dumps(GOOD)])
    ext = _extractor(client, cache_dir=str(tmp_path))
    r = ext.extract(_task())
    assert r.extractor == "llm" and r.description.operations[1].depends_on == ["a"]
    kw = client.calls[0]
    assert kw["response_format"] == {"type": "json_object"} and kw["model"] == "m"
    user = json.loads(kw["messages"][1]["content"])
    assert user["shared_environment"]["environment_id"] == "users" and user["task"]["verifier_checks"][0]["index"] == 0
    r2 = _extractor(FakeClient(["unused"]), cache_dir=str(tmp_path)).extract(_task())
    assert r2.extractor == "llm-cache" and r2.description == r.description
    # a different model is a different cache key
    assert _extractor(FakeClient([json.dumps(GOOD)]), model="other", cache_dir=str(tmp_path)).extract(_task()).extractor == "llm"


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("not json at all", "not JSON"),
        (json.dumps({**GOOD, "operations": [{"id": "a", "type": "teleport"}]}), "operations.0.type"),
        (json.dumps({**GOOD, "dependencies": [{"source": "a", "target": "zzz"}]}), "unknown operation 'zzz'"),
        (json.dumps({**GOOD, "reward_groups": [{"checks": [5], "relation": "shared_gate"}]}), "check index [5]"),
        (json.dumps([1, 2]), "expected an object"),
    ],
)
def test_invalid_answer_falls_back_with_logged_reason(tmp_path, caplog, bad, reason):
    client = FakeClient([bad])
    ext = _extractor(client, cache_dir=str(tmp_path), repair_rounds=1)
    with caplog.at_level(logging.WARNING, logger="envsched.operations"):
        r = ext.extract(_task())
    assert r.extractor == "deterministic-fallback"
    assert reason in r.reason
    assert reason in caplog.text and "falling back" in caplog.text
    assert len(client.calls) == 2  # one retry with the error fed back
    assert "invalid" in client.calls[1]["messages"][-1]["content"]
    assert not list(tmp_path.rglob("*.json"))  # nothing invalid is cached


def test_invalid_answer_raises_when_configured():
    ext = _extractor(FakeClient(['{"operations": []}']), repair_rounds=0, on_invalid="raise")
    with pytest.raises(OperationExtractionError, match="t1.*operations") as err:
        ext.extract(_task())
    assert isinstance(err.value, ModelOutputError)  # the shared taxonomy's model-output failure


def test_the_endpoints_sampling_fields_are_sent():
    client = FakeClient([json.dumps(GOOD)])
    _extractor(client, temperature=None, top_p=0.9, max_tokens=4096, seed=7, extra_body={"k": 1}).extract(_task())
    kw = client.calls[0]
    assert (kw["top_p"], kw["max_tokens"], kw["seed"], kw["extra_body"]) == (0.9, 4096, 7, {"k": 1})
    assert "temperature" not in kw  # null: the server's default, nothing sent


@pytest.mark.parametrize("on_invalid", ["fallback", "raise"])
def test_a_request_refused_as_configured_raises_at_once(on_invalid):
    client = FailingClient(StatusError(404))
    with pytest.raises(ConfigurationError, match="unused/v1.*base URL end in /v1") as err:
        _extractor(client, repair_rounds=2, on_invalid=on_invalid).extract(_task())
    assert err.value.status_code == 404 and len(client.calls) == 1  # never retried, never a fallback


def test_an_endpoint_failure_uses_up_the_rounds_then_falls_back_or_raises():
    client = FailingClient(StatusError(503))
    r = _extractor(client, repair_rounds=1).extract(_task())
    assert r.extractor == "deterministic-fallback" and "request failed" in r.reason and len(client.calls) == 2
    with pytest.raises(InfrastructureError, match="t1.*request failed.*ConnectionError"):
        _extractor(FailingClient(ConnectionError("refused")), repair_rounds=0, on_invalid="raise").extract(_task())


def test_extractor_config_keys():
    cfg = EnvSchedConfig.from_dict({"operation_extractor": "llm", "llm": {"base_urls": "http://h/v1", "model": "m"}})
    assert cfg.llm.base_urls == ["http://h/v1"] and cfg.replace(seed=1).llm == cfg.llm
    assert (cfg.llm.concurrency, cfg.llm.max_tokens) == (8, None)  # the extractor's own defaults, as before
    for old, new in (("base_url", "base_urls"), ("max_workers", "concurrency")):
        with pytest.raises(ConfigError, match=f"unknown endpoint key '{old}' \\(renamed '{new}'\\)"):
            EnvSchedConfig.from_dict({"llm": {"base_urls": "http://h/v1", "model": "m", old: 1}})
    with pytest.raises(ConfigError, match="operation_extractor: llm needs the llm endpoint"):
        EnvSchedConfig.from_dict({"operation_extractor": "llm"})
    with pytest.raises(ConfigError, match="on_invalid"):
        EnvSchedConfig.from_dict({"llm": {"base_urls": "http://h/v1", "model": "m", "on_invalid": "ignore"}})


def test_retry_recovers():
    client = FakeClient(["{bad", json.dumps(GOOD)])
    assert _extractor(client, repair_rounds=1).extract(_task()).extractor == "llm"


def test_graph_report_names_extractor(tmp_path):
    pool = TaskPool.from_records([RECORD, {**RECORD, "task_id": "t2", "instruction": "Update user Bob to inactive"}])
    g = build_static_graph(pool, EnvSchedConfig(), extractor=_extractor(FakeClient([json.dumps(GOOD)]), cache_dir=str(tmp_path), concurrency=2))
    assert g.report()["extractors"] == {"llm": 2}


class _Handler(BaseHTTPRequestHandler):
    answer = json.dumps(GOOD)
    seen: list = []  # noqa: RUF012 - shared across handler instances on purpose

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.path, body, self.headers.get("Authorization")))
        payload = {
            "id": "cmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": type(self).answer}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_real_openai_client_against_local_server(tmp_path, monkeypatch):
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("ENVSCHED_TEST_KEY", "sk-local")
        cfg = EnvSchedConfig.from_dict({"operation_extractor": "llm", "llm": {
            "base_urls": [f"http://127.0.0.1:{server.server_port}/v1"], "model": "local-model", "seed": 3,
            "api_key_env": "ENVSCHED_TEST_KEY", "cache_dir": str(tmp_path), "concurrency": 1, "timeout_s": 10}})
        pool = TaskPool.from_records([RECORD])
        g = build_static_graph(pool, cfg)  # builds openai.OpenAI(base_url=...) from the config
        assert g.report()["extractors"] == {"llm": 1}
        path, body, auth = _Handler.seen[-1]
        assert path == "/v1/chat/completions" and body["model"] == "local-model"
        assert body["response_format"] == {"type": "json_object"} and body["seed"] == 3
        assert auth == "Bearer sk-local"  # the key from api_key_env
    finally:
        server.shutdown()
        server.server_close()
