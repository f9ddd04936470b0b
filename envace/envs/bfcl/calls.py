"""Calls as BFCL's checker reads them: ``name(arg=<literal>, ...)`` rendered from and parsed to Python values."""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping
from typing import Any

# Rendered in place of a call the episode rejected (unknown tool, bad argument names, non-JSON value).
# Evaluating it in the checker raises NameError, so the checker sees a call that failed without side
# effects — exactly what the episode did — and it still counts as "a call" for the irrelevance check.
REJECTED_CALL = "_envace_rejected_tool_call()"


class UnrenderableValue(TypeError):
    pass


def render_literal(value: Any, path: str = "value") -> str:
    """A Python literal for a JSON-like ``value`` that evaluates back to an equal value.

    Only ``None``, ``bool``, ``int``, ``float``, ``str`` and lists / tuples / string-keyed dicts of
    those are accepted (anything else raises ``TypeError``), so a rendered call can never contain
    executable code. ``(`` inside strings is written as ``\\x28``: the checker prefixes every
    ``identifier(`` in a call string with an instance name, which would otherwise corrupt string
    arguments that look like calls.
    """
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(int(value))
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return f"float({str(value)!r})"
        return repr(float(value))
    if isinstance(value, str):
        return repr(str(value)).replace("(", "\\x28")
    if isinstance(value, list):
        return "[" + ", ".join(render_literal(v, f"{path}[{i}]") for i, v in enumerate(value)) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(render_literal(v, f"{path}[{i}]") for i, v in enumerate(value))
        return "(" + inner + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, dict):
        parts = []
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnrenderableValue(f"{path} has a non-string key {k!r}")
            parts.append(f"{render_literal(k)}: {render_literal(v, f'{path}[{k!r}]')}")
        return "{" + ", ".join(parts) + "}"
    raise UnrenderableValue(f"{path} has unsupported type {type(value).__name__} (JSON values only)")


def render_call(name: str, arguments: Mapping[str, Any]) -> str:
    """``name(k1=<literal>, k2=<literal>)`` as the BFCL multi-turn checker executes it."""
    if not name.isidentifier():
        raise ValueError(f"tool name {name!r} is not an identifier")
    parts = []
    for key, value in arguments.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"argument name {key!r} is not an identifier")
        parts.append(f"{key}={render_literal(value, key)}")
    return f"{name}({', '.join(parts)})"


def parse_call_string(text: str) -> tuple[str, list[Any], dict[str, Any]]:
    """Parse a BFCL ground-truth call string ``f(1, x='a')`` into (name, positional, keyword) literals."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"not a call expression: {text!r}: {exc}") from exc
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {text!r}")  # noqa: TRY004 - a bad value, not a bad type
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    except ValueError as exc:
        raise ValueError(f"non-literal argument in {text!r}: {exc}") from exc
    if any(kw.arg is None for kw in node.keywords):
        raise ValueError(f"**kwargs unpacking in {text!r}")
    return node.func.id, args, kwargs


def split_call_list(text: str) -> list[str]:
    """``"[f(1), g(x='a')]"`` (BFCL's decoded prompting output) → ``["f(1)", "g(x='a')"]``; one call → itself."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"not a call expression: {text!r}: {exc.msg}") from None
    if isinstance(node, (ast.List, ast.Tuple)):
        return [ast.unparse(e) for e in node.elts]
    return [text]


def format_result(result: Any) -> str:
    """Observation text for a return value, formatted exactly as bfcl_eval's executor does."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


