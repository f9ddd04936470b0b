"""Parse (and render) Qwen3 / Hermes-style tool calls in generated assistant text.

Qwen3 writes a turn as::

    <think>
    ...reasoning...
    </think>

    optional text
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    ...
    </tool_call>

:func:`parse_tool_calls` splits that into reasoning, content and :class:`~envace.envs.base.ToolCall`
objects. It never raises on any string: each malformed block (bad JSON, not an object, no name,
non-object arguments, unterminated block, stray closing tag) becomes one entry of
``ParseResult.errors`` and is dropped from the content, so the environment can show the model its
mistake. :func:`render_tool_call` is the inverse and matches the envace/Qwen3 chat template's
rendering byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from envace.envs.base import ToolCall, ToolCallError

__all__ = [
    "THINK_END",
    "THINK_START",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "ParseResult",
    "parse_tool_calls",
    "render_assistant_text",
    "render_tool_call",
]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
THINK_START = "<think>"
THINK_END = "</think>"

_JSON = json.JSONDecoder()
_WS = " \t\n\r"
_SNIPPET = 80


@dataclass
class ParseResult:
    """What one generated assistant turn contains."""

    content: str  # the text with reasoning and every tool-call block (good or bad) removed, stripped
    calls: list[ToolCall] = field(default_factory=list)  # well-formed calls, in order
    errors: list[str] = field(default_factory=list)  # one message per malformed block
    reasoning: str | None = None  # text of the <think> block; None when there is none

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_message(self) -> dict[str, Any]:
        """The assistant message in OpenAI / chat-template form (what the template renders back)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = [
                {
                    "type": "function",
                    **({"id": c.id} if c.id else {}),
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.calls
            ]
        return msg


def _snippet(s: str) -> str:
    s = s.strip()
    return repr(s if len(s) <= _SNIPPET else s[:_SNIPPET] + "...")


def _split_reasoning(text: str) -> tuple[str | None, str, str | None]:
    """(reasoning, rest, error). Mirrors the template: reasoning is what precedes ``</think>``."""
    stripped = text.lstrip()
    opened = stripped.startswith(THINK_START)
    end = text.find(THINK_END)
    if end >= 0:
        first_call = text.find(TOOL_CALL_START)
        # A </think> after a tool call, with no leading <think>, is inside the call (e.g. a JSON string).
        if opened or first_call < 0 or end < first_call:
            head = text[:end]
            start = head.find(THINK_START)
            reasoning = head[start + len(THINK_START) :] if start >= 0 else head
            return reasoning.strip("\n"), text[end + len(THINK_END) :], None
    if opened:
        reasoning = stripped[len(THINK_START) :]
        return reasoning.strip("\n"), "", "unterminated <think> block: reasoning has no </think> (truncated output?)"
    return None, text, None


def _decode_call(obj: Any, index: int) -> tuple[ToolCall | None, str | None]:
    if not isinstance(obj, dict):
        return None, f"tool call {index}: body must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, f"tool call {index}: missing or non-string 'name' (keys: {sorted(map(str, obj))[:8]})"
    try:
        return ToolCall.from_dict({k: v for k, v in obj.items() if k in ("name", "arguments", "id")}), None
    except ToolCallError as exc:
        return None, f"tool call {index} ({name!r}): {exc}"
    except Exception as exc:  # noqa: BLE001 - never raise (e.g. RecursionError: string arguments holding very deep JSON)
        return None, f"tool call {index} ({name!r}): {type(exc).__name__}: {exc}"


def _collect(result: tuple[ToolCall | None, str | None], calls: list[ToolCall], errors: list[str]) -> None:
    call, err = result
    if call is not None:
        calls.append(call)
    else:
        errors.append(err or "tool call: malformed")


def _scan(text: str) -> tuple[list[str], list[ToolCall], list[str]]:
    """Split ``text`` into content segments, calls and errors."""
    segments: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    index = 0  # 1-based number of the block, for messages
    n = len(text)
    while pos < n:
        start = text.find(TOOL_CALL_START, pos)
        stray = text.find(TOOL_CALL_END, pos)
        if 0 <= stray and (start < 0 or stray < start):
            segments.append(text[pos:stray])
            errors.append(f"stray {TOOL_CALL_END} without an opening {TOOL_CALL_START}")
            pos = stray + len(TOOL_CALL_END)
            continue
        if start < 0:
            segments.append(text[pos:])
            break
        segments.append(text[pos:start])
        index += 1
        body_start = start + len(TOOL_CALL_START)

        # 1) The JSON value itself decides where it ends, so strings may contain the tags.
        j = body_start
        while j < n and text[j] in _WS:
            j += 1
        try:
            obj, after = _JSON.raw_decode(text, j)
        except Exception:  # noqa: BLE001  (JSONDecodeError, RecursionError on absurd nesting, ...)
            obj, after = None, -1
        if after >= 0:
            k = after
            while k < n and text[k] in _WS:
                k += 1
            if text.startswith(TOOL_CALL_END, k):
                _collect(_decode_call(obj, index), calls, errors)
                pos = k + len(TOOL_CALL_END)
                continue

        # 2) Malformed: the block runs to the next closing tag, unless another block opens first.
        end = text.find(TOOL_CALL_END, body_start)
        reopen = text.find(TOOL_CALL_START, body_start)
        if end < 0 or (0 <= reopen < end):
            stop = reopen if reopen >= 0 else n
            errors.append(
                f"tool call {index}: unterminated {TOOL_CALL_START} block (no {TOOL_CALL_END}): "
                f"{_snippet(text[body_start:stop])}"
            )
            pos = stop
            continue
        body = text[body_start:end]
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            errors.append(f"tool call {index}: invalid JSON ({exc.msg} at char {exc.pos}): {_snippet(body)}")
        except Exception as exc:  # noqa: BLE001  (RecursionError on absurd nesting)
            errors.append(f"tool call {index}: invalid JSON ({type(exc).__name__}): {_snippet(body)}")
        else:
            _collect(_decode_call(obj, index), calls, errors)
        pos = end + len(TOOL_CALL_END)
    return segments, calls, errors


def parse_tool_calls(text: str | None) -> ParseResult:
    """Extract reasoning, content and every ``<tool_call>`` block from generated text. Never raises.

    Content is the non-call text with surrounding whitespace stripped (segments between blocks are
    joined with ``"\\n"``). Tool calls inside the reasoning are not executed.
    """
    if text is None:
        text = ""
    if not isinstance(text, str):
        return ParseResult(content="", errors=[f"expected text, got {type(text).__name__}"])
    reasoning, rest, think_error = _split_reasoning(text)
    segments, calls, errors = _scan(rest)
    if think_error:
        errors.insert(0, think_error)
    content = "\n".join(s.strip() for s in segments if s.strip())
    return ParseResult(content=content, calls=calls, errors=errors, reasoning=reasoning)


def _call_parts(call: ToolCall | dict[str, Any]) -> tuple[str, Any]:
    if isinstance(call, ToolCall):
        return call.name, call.arguments
    if isinstance(call, dict):
        fn = call.get("function") if isinstance(call.get("function"), dict) else call
        return fn["name"], fn.get("arguments", {})
    raise TypeError(f"expected ToolCall or dict, got {type(call).__name__}")


def render_tool_call(call: ToolCall | dict[str, Any]) -> str:
    """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, exactly as the chat template renders it.

    Arguments are ``json.dumps(..., ensure_ascii=False)`` (the template's ``tojson``); a string
    ``arguments`` is inserted verbatim like the template does. The name is JSON-escaped, which is
    the template's raw ``"name"`` for any name without quotes, backslashes or control characters.
    """
    name, arguments = _call_parts(call)
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return (
        f'{TOOL_CALL_START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{TOOL_CALL_END}'
    )


def render_assistant_text(
    content: str = "",
    calls: Sequence[ToolCall | dict[str, Any]] | Iterable[ToolCall | dict[str, Any]] = (),
    reasoning: str | None = None,
) -> str:
    """The assistant turn body as the template renders it (reasoning block, content, ``\\n``-joined calls)."""
    if reasoning is not None:
        out = f"{THINK_START}\n{reasoning.strip(chr(10))}\n{THINK_END}\n\n" + content.lstrip("\n")
    else:
        out = content
    for i, call in enumerate(calls):
        if i > 0 or content:
            out += "\n"
        out += render_tool_call(call)
    return out
