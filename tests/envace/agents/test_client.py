"""Tool-call parsing and the chat client (against a stdlib OpenAI-compatible stub server)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace.agents.client import ChatClient, EndpointConfig, is_context_too_long, parse_assistant_output
from envace.agents.engine import ModelError
from envace.rewards.llm import ConfigurationError, InfrastructureError


def block(obj: Any) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


def test_plain_text() -> None:
    r = parse_assistant_output("Hello there.")
    assert (r.content, r.tool_calls, r.malformed, r.wants_tools) == ("Hello there.", [], [], False)
    assert r.assistant_message() == {"role": "assistant", "content": "Hello there."}


def test_qwen_blocks_parsed_from_content() -> None:
    text = (
        "Let me check.\n"
        + block({"name": "ls", "arguments": {"a": 1}})
        + "\n"
        + block({"name": "cd", "arguments": '{"folder": "x"}'})
    )
    r = parse_assistant_output(text)
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("ls", {"a": 1}), ("cd", {"folder": "x"})]
    assert r.content == "Let me check." and r.wants_tools
    ids = [c.id for c in r.tool_calls]
    assert all(ids) and len(set(ids)) == 2
    msg = r.assistant_message()
    assert [tc["id"] for tc in msg["tool_calls"]] == ids
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"a": 1}


def test_malformed_blocks_become_error_observations() -> None:
    text = (
        block({"name": "ok", "arguments": {}})
        + "<tool_call>{not json}</tool_call>"
        + block({"arguments": {}})
        + block(["x"])
        + '<tool_call>{"name": "cut", "argu'
    )
    r = parse_assistant_output(text)
    assert [c.name for c in r.tool_calls] == ["ok"]
    errors = [m.error for m in r.malformed]
    assert len(errors) == 4
    assert errors[0].startswith("tool call 2: invalid JSON") and "missing or non-string 'name'" in errors[1]
    assert "must be a JSON object" in errors[2] and errors[3].startswith("tool call 5: unterminated <tool_call> block")
    assert all("could not be parsed" in m.observation() for m in r.malformed)
    assert "{not json}" in r.malformed[0].observation()  # the model sees what it wrote
    msg = r.assistant_message()
    assert "<tool_call>" not in msg["content"] and [tc["function"]["name"] for tc in msg["tool_calls"]] == ["ok"]
    assert r.raw_content == text  # transcripts keep the untouched text


@pytest.mark.parametrize(
    "text,error",
    [
        ("<tool_call>{not json}</tool_call>", "tool call 1: invalid JSON (Expecting property name"),
        ("<tool_call></tool_call>", "tool call 1: invalid JSON (Expecting value at char 0): ''"),
        (block(["x"]), "tool call 1: body must be a JSON object, got list"),
        (block({"arguments": {}}), "tool call 1: missing or non-string 'name' (keys: ['arguments'])"),
        (block({"name": "x", "arguments": [1]}), "tool call 1 ('x'): arguments of 'x' must be a JSON object, got list"),
        (block({"name": "x", "arguments": "{bad"}), "tool call 1 ('x'): arguments of 'x' are not valid JSON"),
        ('<tool_call>{"name": "cut", "argu', "tool call 1: unterminated <tool_call> block (no </tool_call>)"),
        ("done</tool_call>", "stray </tool_call> without an opening <tool_call>"),
    ],
)
def test_each_malformed_block_kind(text: str, error: str) -> None:
    r = parse_assistant_output(text)
    assert not r.tool_calls and len(r.malformed) == 1 and r.wants_tools
    assert r.malformed[0].error.startswith(error)
    assert r.malformed[0].raw == "" and "<tool_call>" not in r.assistant_message()["content"]


def test_unterminated_but_valid_block_is_malformed() -> None:
    r = parse_assistant_output('<tool_call>{"name": "ls", "arguments": {}}')
    assert not r.tool_calls and len(r.malformed) == 1
    assert r.malformed[0].error == (
        'tool call 1: unterminated <tool_call> block (no </tool_call>): \'{"name": "ls", "arguments": {}}\''
    )


def test_no_parameters_alias_and_think() -> None:
    # "parameters" is not an alias of "arguments": a call without "arguments" has none
    r = parse_assistant_output("<think>plan: call ls</think>\n" + block({"name": "ls", "parameters": {"p": 2}}))
    assert r.tool_calls[0].arguments == {} and r.reasoning == "plan: call ls" and r.content == ""
    # tool calls inside <think> are thoughts, not calls
    r = parse_assistant_output("<think>" + block({"name": "ls", "arguments": {}}) + "</think>Done.")
    assert not r.tool_calls and r.content == "Done."


@pytest.mark.parametrize(
    "text,visible,reasoning",
    [
        ("a</think>b", "b", "a"),  # template prefilled <think>
        ("<think>never closed", "", "never closed"),  # budget spent while thinking: not a malformed call
        ("<think>y</think>\n\nz", "z", "y"),
        ("x<think>y</think>z", "z", "y"),  # like the chat template: reasoning is what precedes </think>
        ("no thinking", "no thinking", None),
    ],
)
def test_think_split(text: str, visible: str, reasoning: str | None) -> None:
    r = parse_assistant_output(text)
    assert (r.content, r.reasoning, r.tool_calls, r.malformed) == (visible, reasoning, [], [])


def test_server_tool_calls_are_authoritative() -> None:
    api = [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "cd", "arguments": "{bad"}},
    ]
    r = parse_assistant_output(block({"name": "ls", "arguments": {"a": 1}}) + " trailing", api)
    assert [(c.id, c.name) for c in r.tool_calls] == [("c1", "ls")]
    assert len(r.malformed) == 1 and "not valid JSON" in r.malformed[0].error
    assert r.content == "trailing"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>/{}":,[] abtool_call\nthink')), max_size=120))
def test_parser_never_raises(text: str) -> None:
    r = parse_assistant_output(text)
    assert isinstance(r.content, str)
    r.assistant_message()


# -- HTTP ----------------------------------------------------------------------------------------


class _Stub(BaseHTTPRequestHandler):
    responses: ClassVar[list[tuple[int, dict[str, Any]]]] = []
    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        status, payload = type(self).responses.pop(0)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def stub() -> Iterator[str]:
    _Stub.responses, _Stub.bodies = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def completion(content: str | None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": content, "tool_calls": tool_calls},
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }


def test_client_transformers_serve_style_reply(stub: str) -> None:
    raw = block({"name": "ls", "arguments": {"a": 1}})
    _Stub.responses = [
        (
            200,
            completion(
                raw, [{"id": "r_tool_call_0", "type": "function", "function": {"name": "ls", "arguments": '{"a": 1}'}}]
            ),
        )
    ]
    client = ChatClient(
        EndpointConfig(
            base_urls=stub,
            model="m",
            temperature=0.6,
            top_p=0.95,
            max_tokens=32,
            max_retries=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
    )
    r = client.complete([{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": "ls"}}])
    assert [(c.id, c.name, c.arguments) for c in r.tool_calls] == [("r_tool_call_0", "ls", {"a": 1})]
    assert r.content == "" and r.usage == {"prompt_tokens": 7, "completion_tokens": 3}
    sent = _Stub.bodies[0]
    assert (sent["model"], sent["temperature"], sent["top_p"], sent["max_tokens"]) == ("m", 0.6, 0.95, 32)
    assert sent["chat_template_kwargs"] == {"enable_thinking": False} and sent["tools"]


@pytest.mark.parametrize(
    ("status", "message", "kind"),
    [
        # the conversation outgrew the model: the model's failure, scored
        (400, "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens.", ModelError),
        (400, "context too long", ModelError),
        # a request that can never succeed as configured: abort the run (old: scored as a failed task, or
        # logged and retried on every rerun)
        (404, "The model `qwen-typo` does not exist.", ConfigurationError),
        (401, "invalid api key", ConfigurationError),
        (400, "temperature must be >= 0", ConfigurationError),
        # the server may answer later: retried
        (500, "boom", InfrastructureError),
        (503, "overloaded", InfrastructureError),
        (429, "slow down", InfrastructureError),
    ],
)
def test_client_errors_follow_the_one_taxonomy(stub: str, status: int, message: str, kind: type) -> None:
    client = ChatClient(EndpointConfig(base_urls=stub, model="m", max_retries=0))
    _Stub.responses = [(status, {"error": {"message": message}})]
    with pytest.raises(kind):
        client.complete([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("status", "message", "expected"),
    [
        # vLLM
        (400, "This model's maximum context length is 1024 tokens. However, you requested 1500 tokens.", True),
        # OpenAI
        (400, "This model's maximum context length is 8192 tokens; your messages resulted in 9000 tokens.", True),
        # transformers serve / generic wording
        (422, "Input is too long for the model", True),
        (413, "prompt is too long", True),
        # the same words with a status that is not a rejection of the request's size
        (500, "maximum context length exceeded", False),
        (404, "context length", False),
        (None, "context length", False),
        # a 400 about something else
        (400, "temperature must be >= 0", False),
        (400, "the tool list is too large", False),
    ],
)
def test_is_context_too_long(status: int | None, message: str, expected: bool) -> None:
    """The one context-overflow predicate (client taxonomy and test-time rehearsal's masking share it)."""
    assert is_context_too_long(status, message) is expected


def test_unreachable_endpoint_is_infrastructure(dead_url: str) -> None:
    client = ChatClient(EndpointConfig(base_urls=dead_url, model="m", max_retries=0, timeout_s=5))
    with pytest.raises(InfrastructureError):
        client.complete([{"role": "user", "content": "hi"}])


def test_lone_surrogates_from_the_server_never_reach_the_conversation() -> None:
    """A ``\\ud800`` escape in the server's JSON (content or tool-call arguments) used to survive as a lone
    surrogate: the result store then raised UnicodeEncodeError and the task was retried as an
    infrastructure error on every rerun."""
    raw = json.loads('"text \\ud800 <tool_call>{\\"name\\": \\"cd\\", \\"arguments\\": {\\"folder\\": \\"\\\\udc00x\\"}}</tool_call>"')
    api = [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"a": "\\ud83d"}'}}]
    for reply in (parse_assistant_output(raw), parse_assistant_output(raw, api)):
        message = reply.assistant_message()
        json.dumps(message, ensure_ascii=False).encode("utf-8")  # raised UnicodeEncodeError before
        for call in reply.tool_calls:
            json.dumps(call.arguments, ensure_ascii=False).encode("utf-8")
    assert parse_assistant_output(raw).tool_calls[0].arguments == {"folder": "\ufffdx"}
