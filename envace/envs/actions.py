"""The action-sequence format the ``verify`` command reads, and the errors that name its mistakes.

:func:`parse_actions` / :func:`load_actions` read an action sequence: a JSON list of turns, each a list of
``{"name", "arguments"}`` calls (OpenAI ``{"function": {...}}`` form and JSON-string arguments are accepted too), or a
flat list of calls meaning a single turn. Pools replay what they return (:meth:`EnvironmentPool.replay`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envace.envs.base import ToolCall, ToolCallError

__all__ = ["ActionsFormatError", "load_actions", "parse_actions"]


class ActionsFormatError(ValueError):
    """An action sequence that does not follow the actions-file format; the message names the spot."""


def _is_call(obj: Any) -> bool:
    return isinstance(obj, Mapping)


def parse_actions(obj: Any) -> list[list[ToolCall]]:
    """Actions from decoded JSON: a list of turns (lists of calls), or a flat list of calls (one turn).

    ``[]`` means zero turns. Raises :class:`ActionsFormatError` naming the turn/call and the problem.
    """
    if not isinstance(obj, list):
        raise ActionsFormatError(f"actions must be a JSON list (of turns or of calls), got {type(obj).__name__}")
    if not obj:
        return []
    if all(_is_call(x) for x in obj):
        turns: list[Any] = [obj]
        flat = True
    elif all(isinstance(x, list) for x in obj):
        turns = obj
        flat = False
    else:
        kinds = sorted({type(x).__name__ for x in obj})
        raise ActionsFormatError(
            f"actions must be a list of turns (each a list of calls) or a flat list of calls; got a mix of {kinds}"
        )
    parsed: list[list[ToolCall]] = []
    for t, turn in enumerate(turns):
        calls = []
        for c, call in enumerate(turn):
            where = f"call {c}" if flat else f"turn {t}, call {c}"
            if not _is_call(call):
                raise ActionsFormatError(
                    f"{where}: a call must be an object with 'name' and 'arguments', got {type(call).__name__}"
                )
            try:
                calls.append(ToolCall.from_dict(dict(call)))
            except ToolCallError as exc:
                raise ActionsFormatError(f"{where}: {exc}") from None
        parsed.append(calls)
    return parsed


def load_actions(path: str | Path) -> list[list[ToolCall]]:
    """:func:`parse_actions` of a JSON file; a missing file or invalid JSON is an :class:`ActionsFormatError`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ActionsFormatError(f"{path}: cannot read actions file: {exc.strerror or exc}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ActionsFormatError(f"{path}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    try:
        return parse_actions(obj)
    except ActionsFormatError as exc:
        raise ActionsFormatError(f"{path}: {exc}") from None
