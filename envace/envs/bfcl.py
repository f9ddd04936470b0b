"""BFCL v4 multi-turn as an :class:`~envace.envs.base.EnvironmentPool` (``"bfcl_multi_turn"``).

Source: the ``bfcl-eval`` wheel (data, executable backends and the official checker all ship in it;
everything runs offline). The pool covers the 800 tasks of ``multi_turn_base``, ``multi_turn_miss_func``,
``multi_turn_miss_param`` and ``multi_turn_long_context`` (200 each).

Environment
    Each episode owns fresh instances of the task's ``involved_classes`` (``GorillaFileSystem``,
    ``TradingBot``, ...), loaded with the task's ``initial_config`` (``long_context=True`` for the
    long-context category), exactly as BFCL's own executor builds them. A :class:`ToolCall` runs by
    calling the bound method with keyword arguments — model text is never ``eval``-ed. Unknown tools,
    argument names that do not fit the method's signature, non-JSON values and
    exceptions raised by the method all come back as an error observation that states the reason.

Tools
    BFCL's function docs use non-JSON-schema types (``dict``, ``float``, ``tuple``, ``any``); they are
    converted to OpenAI function schemas whose ``parameters`` are valid JSON Schema (Draft 2020-12),
    see :func:`convert_bfcl_function_doc`. Tool names are BFCL's plain method names (``cd``, ``mv``),
    the names the multi-turn checker resolves; :attr:`BFCLMultiTurnPool.tool_owner` maps each name to
    its class. In ``miss_func`` the held-out functions join the tool list at the turn the benchmark
    names (``missed_function``); that turn's user message is BFCL's own
    ``DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC``, as in ``bfcl_eval``'s inference loop. A held-out
    function is *listed* only from that turn but, as in BFCL's executor, it executes if called earlier.

Verifier
    :meth:`BFCLEpisode.verify` renders the episode's accepted calls as ``name(arg=<literal>, ...)``
    and runs the official ``multi_turn_checker`` (per-turn state and response checks against the
    ground truth). Turns whose ground truth is empty (``miss_func``/``miss_param``, and three tasks of
    ``base``/``long_context``) expect *no* call; they are checked with the benchmark's
    ``multi_turn_irrelevance_checker`` (``check_irrelevance=True``, the default). Note that
    ``bfcl_eval`` 2026.3.23's ``eval_runner`` imports but never calls that checker, so with
    ``check_irrelevance=False`` the verdict equals the leaderboard's.

    The checker caches backend instances in ``multi_turn_utils``' module globals keyed by model name
    and never evicts them. Every verification therefore uses a fresh ``model_name`` (a uuid) and
    deletes its cached ``*_instance`` globals afterwards, under a lock: verifications are independent
    and may run concurrently from threads.

Splits
    The four categories are variants of the same 200 scenarios (``multi_turn_base_17`` and
    ``multi_turn_miss_func_17`` share initial state and most questions). The train/test split is
    therefore made per *scenario*: ``sha256(f"{split_seed}:bfcl_mt_scenario_{n}")`` mapped to [0, 1)
    is compared with ``test_fraction`` (default 0.2, seed 0), so all variants of a scenario land in
    the same split and no scenario leaks from train to test.

``BFCL_PROJECT_ROOT`` is pointed at a scratch directory (``$ENVACE_CACHE/bfcl``, default
``~/.cache/envace/bfcl``) before ``bfcl_eval`` is imported; otherwise it creates ``result/``,
``score/`` and ``.file_locks/`` inside site-packages.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import importlib
import inspect
import json
import math
import os
import re
import sys
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envace.cache import cache_dir
from envace.envs.base import EnvironmentPool, Episode, TaskSpec, ToolCall, ToolCallError, Verdict, register_pool


def _bfcl_project_root() -> Path:
    return cache_dir() / "bfcl"


if "BFCL_PROJECT_ROOT" not in os.environ:
    if "bfcl_eval.constants.eval_config" in sys.modules:  # pragma: no cover - depends on import order
        import warnings

        warnings.warn(
            "bfcl_eval was imported before envace.envs.bfcl; BFCL_PROJECT_ROOT could not be redirected "
            "and bfcl_eval may write result/score folders into site-packages",
            RuntimeWarning,
            stacklevel=2,
        )
    else:
        _root = _bfcl_project_root()
        _root.mkdir(parents=True, exist_ok=True)
        os.environ["BFCL_PROJECT_ROOT"] = str(_root)

from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
from bfcl_eval.constants.executable_backend_config import (
    CLASS_FILE_PATH_MAPPING,
    STATELESS_CLASSES,
)
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
    multi_turn_checker,
    multi_turn_irrelevance_checker,
)
from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

__all__ = [
    "MULTI_TURN_CATEGORIES",
    "POOL_NAME",
    "BFCLEpisode",
    "BFCLMultiTurnPool",
    "SchemaConversionError",
    "convert_bfcl_function_doc",
    "convert_bfcl_schema",
    "parse_call_string",
    "render_call",
    "render_literal",
]

POOL_NAME = "bfcl_multi_turn"
MULTI_TURN_CATEGORIES: tuple[str, ...] = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)

# Rendered in place of a call the episode rejected (unknown tool, bad argument names, non-JSON value).
# Evaluating it in the checker raises NameError, so the checker sees a call that failed without side
# effects — exactly what the episode did — and it still counts as "a call" for the irrelevance check.
_REJECTED_CALL = "_envace_rejected_tool_call()"

# Names bfcl_eval's executor refuses to evaluate; a tool with one of these names could never pass.
_BFCL_BLOCKED_NAMES = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})


# --------------------------------------------------------------------------------------------------
# Schema conversion
# --------------------------------------------------------------------------------------------------


class SchemaConversionError(ValueError):
    """A BFCL function doc that cannot be converted to JSON Schema (names the offending path)."""


# BFCL type name -> JSON Schema type (None: no type constraint, i.e. any JSON value).
_TYPE_MAP: dict[str, str | None] = {
    "dict": "object",
    "object": "object",
    "HashMap": "object",
    "Hashtable": "object",
    "float": "number",
    "double": "number",
    "number": "number",
    "integer": "integer",
    "int": "integer",
    "long": "integer",
    "short": "integer",
    "byte": "integer",
    "Bigint": "integer",
    "string": "string",
    "str": "string",
    "String": "string",
    "char": "string",
    "boolean": "boolean",
    "bool": "boolean",
    "array": "array",
    "list": "array",
    "tuple": "array",
    "ArrayList": "array",
    "Array": "array",
    "Queue": "array",
    "Stack": "array",
    "any": None,
    "Any": None,
}
# Annotation / validation keywords copied through unchanged.
_PASSTHROUGH_KEYS = frozenset(
    {"description", "enum", "title", "format", "pattern", "minimum", "maximum", "minItems", "maxItems", "examples"}
)


def convert_bfcl_schema(node: Mapping[str, Any], path: str = "$") -> dict[str, Any]:
    """Convert one BFCL parameter schema node to JSON Schema.

    Rules: ``type`` goes through :data:`_TYPE_MAP` (``dict``→``object``, ``float``→``number``,
    ``tuple``/``list``→``array``, ``any``→ no ``type`` keyword); ``properties``, ``items`` and
    ``additionalProperties`` are converted recursively; ``required`` keeps only its list (every name must
    be a declared property); the Python-style default ``"None"`` becomes JSON ``null``; description,
    enum and other plain annotation keywords are copied. Anything else raises
    :class:`SchemaConversionError` naming ``path`` — nothing is dropped or guessed silently.
    """
    if not isinstance(node, Mapping):
        raise SchemaConversionError(f"{path}: schema must be an object, got {type(node).__name__}")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "type":
            if not isinstance(value, str) or value not in _TYPE_MAP:
                raise SchemaConversionError(f"{path}.type: unknown BFCL type {value!r}")
            mapped = _TYPE_MAP[value]
            if mapped is not None:
                out["type"] = mapped
        elif key == "properties":
            if not isinstance(value, Mapping):
                raise SchemaConversionError(f"{path}.properties: must be an object")
            out["properties"] = {
                str(name): convert_bfcl_schema(sub, f"{path}.properties.{name}") for name, sub in value.items()
            }
        elif key in ("items", "additionalProperties"):
            out[key] = value if isinstance(value, bool) else convert_bfcl_schema(value, f"{path}.{key}")
        elif key == "required":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise SchemaConversionError(f"{path}.required: must be a list of strings")
            out["required"] = list(value)
        elif key == "default":
            out["default"] = None if value == "None" else copy.deepcopy(value)
        elif key in _PASSTHROUGH_KEYS:
            out[key] = copy.deepcopy(value)
        else:
            raise SchemaConversionError(f"{path}: unsupported schema keyword {key!r}")
    missing = [r for r in out.get("required", []) if r not in out.get("properties", {})]
    if missing:
        raise SchemaConversionError(f"{path}.required: names undeclared properties {missing}")
    return out


def convert_bfcl_function_doc(doc: Mapping[str, Any]) -> dict[str, Any]:
    """BFCL function doc → OpenAI tool ``{"type": "function", "function": {name, description, parameters}}``.

    The ``response`` schema BFCL attaches (documentation of the return value) is not part of an
    OpenAI function schema and is left out. ``parameters`` is always an object schema.
    """
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise SchemaConversionError("$.name: function doc has no name")
    params = doc.get("parameters", {"type": "dict", "properties": {}})
    converted = convert_bfcl_schema(params, path=f"{name}.parameters")
    if converted.get("type", "object") != "object":
        raise SchemaConversionError(f"{name}.parameters: must be an object schema, got {converted.get('type')!r}")
    converted["type"] = "object"
    converted.setdefault("properties", {})
    return {
        "type": "function",
        "function": {"name": name, "description": str(doc.get("description", "")), "parameters": converted},
    }


# --------------------------------------------------------------------------------------------------
# Call rendering / parsing
# --------------------------------------------------------------------------------------------------


class _UnrenderableValue(TypeError):
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
                raise _UnrenderableValue(f"{path} has a non-string key {k!r}")
            parts.append(f"{render_literal(k)}: {render_literal(v, f'{path}[{k!r}]')}")
        return "{" + ", ".join(parts) + "}"
    raise _UnrenderableValue(f"{path} has unsupported type {type(value).__name__} (JSON values only)")


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


def _format_result(result: Any) -> str:
    """Observation text for a return value, formatted exactly as bfcl_eval's executor does."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


# --------------------------------------------------------------------------------------------------
# Backend classes
# --------------------------------------------------------------------------------------------------


@functools.cache
def _backend_class(class_name: str) -> type:
    try:
        module_path = CLASS_FILE_PATH_MAPPING[class_name]
    except KeyError:
        raise KeyError(f"BFCL backend class {class_name!r} is unknown to bfcl_eval") from None
    return getattr(importlib.import_module(module_path), class_name)


@functools.cache
def _public_signatures(class_name: str) -> dict[str, inspect.Signature]:
    """Public method name → signature without ``self`` (what the checker exposes as functions)."""
    cls = _backend_class(class_name)
    out: dict[str, inspect.Signature] = {}
    for name, func in inspect.getmembers(cls, predicate=inspect.isfunction):
        if name.startswith("_"):
            continue
        sig = inspect.signature(func)
        out[name] = sig.replace(parameters=list(sig.parameters.values())[1:])
    return out


def _new_instances(entry: Mapping[str, Any], long_context: bool) -> dict[str, Any]:
    """Fresh backend instances in the task's initial state (same recipe as bfcl_eval's executor)."""
    instances: dict[str, Any] = {}
    for class_name in entry["involved_classes"]:
        inst = _backend_class(class_name)()
        if class_name not in STATELESS_CLASSES:
            inst._load_scenario(copy.deepcopy(entry["initial_config"].get(class_name, {})), long_context=long_context)
        instances[class_name] = inst
    return instances


def _method_owner(involved_classes: Sequence[str]) -> dict[str, str]:
    """Tool name → owning class, later classes winning as in the checker's name mapping."""
    owner: dict[str, str] = {}
    for class_name in involved_classes:
        for name in _public_signatures(class_name):
            owner[name] = class_name
    return owner


# --------------------------------------------------------------------------------------------------
# Official checker, isolated
# --------------------------------------------------------------------------------------------------

_CHECKER_CACHE_LOCK = threading.Lock()
_DROP_DETAIL_KEYS = frozenset(
    {
        "execution_result",
        "model_instance_state",
        "ground_truth_instance_state",
        "model_response (including all previous turns)",
    }
)


def _evict_checker_cache(model_name: str) -> None:
    """Delete the ``*_instance`` globals the checker cached for ``model_name`` (both model and GT)."""
    namespace = vars(multi_turn_utils)
    prefix = re.sub(r"[-./:]", "_", model_name) + "_"
    with _CHECKER_CACHE_LOCK:
        for key in [k for k in list(namespace) if k.startswith(prefix) and k.endswith("_instance")]:
            namespace.pop(key, None)


def _compact(value: Any, limit: int = 2000) -> Any:
    """JSON-able, size-bounded copy of checker details (instance states can be megabytes)."""
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if k not in _DROP_DETAIL_KEYS}
    try:
        text = json.dumps(value, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) <= limit:
        return json.loads(text) if text.startswith(("{", "[")) else text
    return text[:limit] + f"... [{len(text) - limit} more chars]"


def run_official_checker(
    decoded: list[list[list[str]]],
    ground_truth: list[list[str]],
    entry: Mapping[str, Any],
    category: str,
    check_irrelevance: bool = True,
) -> dict[str, Any]:
    """Run ``multi_turn_checker`` (then ``multi_turn_irrelevance_checker``) with an isolated cache.

    ``decoded`` is turns → steps → call strings. Returns the checker's result dict plus ``"checker"``
    (which checker produced it). Thread-safe.
    """
    model_name = f"envace_{uuid.uuid4().hex}"
    checker_entry = {
        "id": entry["id"],
        "initial_config": entry["initial_config"],
        "involved_classes": entry["involved_classes"],
    }
    try:
        result = multi_turn_checker(decoded, ground_truth, checker_entry, category, model_name)
        result["checker"] = "multi_turn_checker"
        if result.get("valid") and check_irrelevance and any(len(turn) == 0 for turn in ground_truth):
            result = multi_turn_irrelevance_checker(decoded, ground_truth)
            result["checker"] = "multi_turn_irrelevance_checker"
    finally:
        _evict_checker_cache(model_name)
    return result


# --------------------------------------------------------------------------------------------------
# Episode
# --------------------------------------------------------------------------------------------------


@dataclass
class _TaskRecord:
    entry: dict[str, Any]
    ground_truth: list[list[str]]
    category: str
    split: str
    tools: dict[str, dict[str, Any]]  # tool name -> converted schema (initial + held-out)
    initial_tool_names: list[str]
    missed: dict[int, list[str]]  # turn index -> tool names revealed at that turn


class BFCLEpisode(Episode):
    """One live BFCL multi-turn task: its own backend instances, turn pointer and call record."""

    def __init__(self, pool: BFCLMultiTurnPool, record: _TaskRecord, spec: TaskSpec) -> None:
        self.spec = spec
        self._pool = pool
        self._record = record
        self._long_context = "long_context" in record.category
        self._instances = _new_instances(record.entry, self._long_context)
        self._owner = _method_owner(record.entry["involved_classes"])
        self._visible: list[str] = list(record.initial_tool_names)
        self._turn = 0
        self._finished = False
        # Per turn: the call strings the checker will execute (accepted calls rendered faithfully,
        # rejected ones as a side-effect-free failing call).
        self._calls: list[list[str]] = [[]]
        self._assistant_texts: list[str] = []

    # -- protocol -----------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._finished

    @property
    def turn(self) -> int:
        """Index of the current user turn (0-based)."""
        return self._turn

    @property
    def num_turns(self) -> int:
        return len(self._record.ground_truth)

    def tools(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(self._record.tools[name]) for name in self._visible]

    def execute(self, call: ToolCall | Mapping[str, Any]) -> str:
        """Run one call against this episode's instances; errors come back as observation text."""
        if self._finished:
            return "Error: the episode is over; no more tool calls are accepted."
        try:
            call = self._coerce(call)
        except ToolCallError as exc:
            return f"Error: malformed tool call: {exc}"
        name, arguments = call.name, call.arguments

        reason = self._reject_reason(name, arguments)
        if reason is not None:
            self._calls[self._turn].append(_REJECTED_CALL)
            return f"Error: {reason}"

        rendered = render_call(name, arguments)  # validated above; cannot fail
        self._calls[self._turn].append(rendered)
        method = getattr(self._instances[self._owner[name]], name)
        try:
            result = method(**copy.deepcopy(dict(arguments)))
        except Exception as exc:  # noqa: BLE001 - the model must read its mistake; formatted as BFCL does
            return f"Error during execution: {exc}"
        return _format_result(result)

    def end_turn(self, assistant_text: str) -> str | None:
        if self._finished:
            return None
        self._assistant_texts.append(assistant_text)
        if self._turn + 1 >= self.num_turns:
            self._finished = True
            return None
        self._turn += 1
        self._calls.append([])
        revealed = self._record.missed.get(self._turn, [])
        for name in revealed:
            if name not in self._visible:
                self._visible.append(name)
        return self._pool._user_message(self._record, self._turn)

    def verify(self) -> Verdict:
        gt = self._record.ground_truth
        reached = self._turn + 1
        base = {"task_id": self.spec.task_id, "num_turns": len(gt), "turns_reached": reached}
        if reached < len(gt):
            return Verdict(
                reward=0.0,
                passed=False,
                details={
                    **base,
                    "checker": "envace",
                    "error_type": "multi_turn:force_terminated",
                    "reason": f"the episode reached user turn {reached} of {len(gt)}; every turn must be played",
                },
            )
        decoded = [[list(calls)] if calls else [] for calls in self._calls]
        return _verdict_from_result(
            run_official_checker(decoded, gt, self._record.entry, self._record.category, self._pool.check_irrelevance),
            base,
        )

    def fork(self) -> BFCLEpisode:
        clone = copy.copy(self)
        clone._instances = copy.deepcopy(self._instances)
        clone._visible = list(self._visible)
        clone._calls = [list(turn) for turn in self._calls]
        clone._assistant_texts = list(self._assistant_texts)
        return clone

    # -- introspection --------------------------------------------------------------------------------

    def checker_input(self) -> list[list[list[str]]]:
        """What :meth:`verify` hands the checker: turns → steps → call strings."""
        return [[list(calls)] if calls else [] for calls in self._calls]

    def state(self) -> dict[str, dict[str, Any]]:
        """Public attributes of every backend instance (what the checker's state check compares)."""
        return {
            cls: {k: copy.deepcopy(v) for k, v in vars(inst).items() if not k.startswith("_")}
            for cls, inst in self._instances.items()
        }

    # -- helpers --------------------------------------------------------------------------------------

    @staticmethod
    def _coerce(call: Any) -> ToolCall:
        if isinstance(call, ToolCall):
            if not isinstance(call.name, str) or not call.name:
                raise ToolCallError(f"tool name must be a non-empty string, got {call.name!r}")
            if not isinstance(call.arguments, Mapping):
                raise ToolCallError(
                    f"arguments of {call.name!r} must be a JSON object, got {type(call.arguments).__name__}"
                )
            return call
        if isinstance(call, Mapping):
            return ToolCall.from_dict(dict(call))
        raise ToolCallError(f"expected a ToolCall or a dict, got {type(call).__name__}")

    def _reject_reason(self, name: str, arguments: Mapping[str, Any]) -> str | None:
        # Any function of the task executes, even a held-out one before its reveal turn: BFCL's executor
        # resolves every public method, and BFCL's own ground truth relies on it (multi_turn_miss_func_49
        # calls ``tail`` two turns before the turn that reveals it).
        if name not in self._record.tools:
            shown = ", ".join(self._visible)
            return f"unknown tool {name!r}; available tools: {shown}"
        sig = _public_signatures(self._owner[name])[name]
        bad_keys = [k for k in arguments if not isinstance(k, str) or not k.isidentifier()]
        if bad_keys:
            return f"invalid argument name(s) {bad_keys!r} for {name}"
        try:
            sig.bind(**arguments)
        except TypeError as exc:
            expected = ", ".join(
                p.name + ("" if p.default is inspect.Parameter.empty else "?") for p in sig.parameters.values()
            )
            return f"invalid arguments for {name}: {exc}. Expected parameters: {expected}"
        try:
            for key, value in arguments.items():
                render_literal(value, key)
        except _UnrenderableValue as exc:
            return f"invalid arguments for {name}: {exc}"
        return None


def _verdict_from_result(result: Mapping[str, Any], base: dict[str, Any]) -> Verdict:
    passed = bool(result.get("valid"))
    details = {**base, "checker": result.get("checker", "multi_turn_checker")}
    if passed:
        details.update(error_type=None, reason="")
    else:
        details.update(
            error_type=result.get("error_type", "multi_turn:unknown"),
            reason=str(result.get("error_message", "")),
        )
        if result.get("details"):
            details["checker_details"] = _compact(result["details"])
    return Verdict(reward=1.0 if passed else 0.0, passed=passed, details=details)


# --------------------------------------------------------------------------------------------------
# Pool
# --------------------------------------------------------------------------------------------------


def scenario_key(task_id: str) -> str:
    """The scenario a task id belongs to: the four categories share scenario ``n`` of ``<cat>_<n>``."""
    suffix = task_id.rsplit("_", 1)[-1]
    return f"bfcl_mt_scenario_{suffix}"


def stable_fraction(key: str, seed: int | str = 0) -> float:
    """A deterministic value in [0, 1) from ``sha256(f"{seed}:{key}")`` (same on every machine)."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _summarize(value: Any, depth: int = 0, width: int = 6) -> str:
    """A short, lossy text view of an initial-config value (for TF-IDF style task descriptions)."""
    if isinstance(value, dict):
        if depth >= 3:
            return f"{{{len(value)} keys}}"
        items = list(value.items())
        text = ", ".join(f"{k}: {_summarize(v, depth + 1, width)}" for k, v in items[:width])
        more = f", +{len(items) - width} more" if len(items) > width else ""
        return "{" + text + more + "}"
    if isinstance(value, list):
        if not value:
            return "[]"
        head = ", ".join(_summarize(v, depth + 1, width) for v in value[:3])
        return f"[{head}{', ...' if len(value) > 3 else ''}] ({len(value)} items)"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@register_pool(POOL_NAME)
class BFCLMultiTurnPool(EnvironmentPool):
    """The 800 BFCL v4 multi-turn tasks (base, miss_func, miss_param, long_context).

    Args:
        categories: which multi-turn categories to load (default: all four).
        test_fraction: share of *scenarios* put in the ``"test"`` split (default 0.2).
        split_seed: seed of the stable scenario hash (default 0).
        check_irrelevance: also run ``multi_turn_irrelevance_checker`` (a call in an empty-ground-truth
            turn fails the task). ``False`` reproduces the leaderboard's eval_runner exactly.
    """

    name = POOL_NAME

    def __init__(
        self,
        categories: Sequence[str] = MULTI_TURN_CATEGORIES,
        test_fraction: float = 0.2,
        split_seed: int | str = 0,
        check_irrelevance: bool = True,
    ) -> None:
        unknown = [c for c in categories if c not in MULTI_TURN_CATEGORIES]
        if unknown:
            raise ValueError(f"unknown BFCL multi-turn categories {unknown}; choose from {list(MULTI_TURN_CATEGORIES)}")
        if not 0.0 <= test_fraction <= 1.0:
            raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
        self.categories = tuple(categories)
        self.test_fraction = float(test_fraction)
        self.split_seed = split_seed
        self.check_irrelevance = bool(check_irrelevance)
        self._records: dict[str, _TaskRecord] = {}
        self._specs: dict[str, TaskSpec] = {}
        self._gold: dict[str, list[list[ToolCall]]] = {}
        self._tool_cache: dict[str, dict[str, Any]] = {}
        for category in self.categories:
            self._load_category(category)

    # -- loading --------------------------------------------------------------------------------------

    def _convert_tool(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        name = doc["name"]
        if name not in self._tool_cache:
            self._tool_cache[name] = convert_bfcl_function_doc(doc)
        return self._tool_cache[name]

    def _load_category(self, category: str) -> None:
        entries = load_dataset_entry(category)
        truths = {g["id"]: g["ground_truth"] for g in load_ground_truth_entry(category)}
        for entry in entries:
            task_id = entry["id"]
            if task_id not in truths:
                raise ValueError(f"BFCL task {task_id} has no ground truth in bfcl_eval's possible_answer")
            gt = truths[task_id]
            if len(gt) != len(entry["question"]):
                raise ValueError(f"BFCL task {task_id}: {len(entry['question'])} user turns but {len(gt)} GT turns")
            owner = _method_owner(entry["involved_classes"])
            tools: dict[str, dict[str, Any]] = {}
            initial: list[str] = []
            for doc in entry["function"]:
                tools[doc["name"]] = self._convert_tool(doc)
                initial.append(doc["name"])
            missed: dict[int, list[str]] = {}
            for turn, docs in (entry.get("missed_function") or {}).items():
                missed[int(turn)] = []
                for doc in docs:
                    tools[doc["name"]] = self._convert_tool(doc)
                    missed[int(turn)].append(doc["name"])
            for name in tools:
                if name not in owner:
                    raise ValueError(f"BFCL task {task_id}: tool {name!r} has no method in {entry['involved_classes']}")
                if name in _BFCL_BLOCKED_NAMES:
                    raise ValueError(f"BFCL task {task_id}: tool {name!r} is blocked by bfcl_eval's executor")
            split = "test" if stable_fraction(scenario_key(task_id), self.split_seed) < self.test_fraction else "train"
            self._records[task_id] = _TaskRecord(
                entry=entry,
                ground_truth=gt,
                category=category,
                split=split,
                tools=tools,
                initial_tool_names=initial,
                missed=missed,
            )

    # -- protocol -------------------------------------------------------------------------------------

    def task_ids(self, split: str | None = None) -> list[str]:
        if split not in (None, "all", "train", "test"):
            raise ValueError(f"unknown split {split!r}; use 'train', 'test' or None")
        return [tid for tid, rec in self._records.items() if split in (None, "all") or rec.split == split]

    def _record(self, task_id: str) -> _TaskRecord:
        try:
            return self._records[task_id]
        except KeyError:
            raise KeyError(
                f"unknown {self.name} task {task_id!r} (loaded categories: {list(self.categories)})"
            ) from None

    def task(self, task_id: str) -> TaskSpec:
        spec = self._specs.get(task_id)
        if spec is None:
            spec = self._build_spec(self._record(task_id))
            self._specs[task_id] = spec
        return spec

    def start(self, task_id: str, **kwargs: Any) -> BFCLEpisode:
        if kwargs:
            raise TypeError(f"{self.name}.start() takes no options, got {sorted(kwargs)}")
        record = self._record(task_id)
        return BFCLEpisode(self, record, self.task(task_id))

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        gold = self._gold.get(task_id)
        if gold is None:
            gold = self.calls_from_strings(task_id, self._record(task_id).ground_truth, strict=True)
            self._gold[task_id] = gold
        return [[ToolCall(c.name, copy.deepcopy(c.arguments)) for c in turn] for turn in gold]

    def calls_from_strings(self, task_id: str, turns: Sequence[Any], *, strict: bool = False) -> list[list[ToolCall]]:
        """BFCL's native multi-turn format → tool calls: per turn a list of call strings (``"sort('a.pdf')"``),
        or per turn a list of steps, each a list of call strings (BFCL's decoded result layout); a string may
        hold a list of calls (``"[cd(folder='a'), ls()]"``). Positional arguments are mapped to their names
        through the task's method signatures.

        Raises ValueError naming the turn and call for anything that is not a list of turns of call strings. A
        call that names no method of the task, or whose arguments do not bind, is the model's mistake: with
        ``strict`` (the ground truth) it raises too; otherwise it is kept as a call the episode rejects (unknown
        tool / invalid arguments, a failed call as BFCL's executor has it), so the verdict scores it."""
        record = self._record(task_id)
        owner = _method_owner(record.entry["involved_classes"])
        if not isinstance(turns, (list, tuple)):
            raise ValueError(f"expected a list of turns, got {type(turns).__name__}")  # noqa: TRY004 - bad input
        out: list[list[ToolCall]] = []
        for t, turn in enumerate(turns):
            if not isinstance(turn, (list, tuple)):
                raise ValueError(  # noqa: TRY004
                    f"turn {t}: expected a list of call strings, got {type(turn).__name__}")
            texts: list[str] = []
            for step in turn:
                for text in step if isinstance(step, (list, tuple)) else [step]:
                    if not isinstance(text, str):
                        raise ValueError(  # noqa: TRY004 - bad input, reported as the caller's ValueError
                            f"turn {t}: expected call strings, got {type(text).__name__} {text!r}")
                    try:
                        texts.extend(split_call_list(text))
                    except ValueError as exc:
                        raise ValueError(f"turn {t}, call {len(texts)}: {exc}") from None
            calls = []
            for c, text in enumerate(texts):
                try:
                    name, args, kwargs = parse_call_string(text)
                except ValueError as exc:
                    raise ValueError(f"turn {t}, call {c}: {exc}") from None
                if name not in owner:
                    if strict:
                        raise ValueError(f"{task_id}: call {text!r} names no method of the task's classes")
                    calls.append(ToolCall(name=name, arguments={**kwargs, **({"*args": args} if args else {})}))
                    continue
                try:
                    bound = _public_signatures(owner[name])[name].bind(*args, **kwargs)
                except TypeError as exc:
                    if strict:
                        raise ValueError(f"{task_id}: call {text!r}: {exc}") from None
                    calls.append(ToolCall(name=name, arguments={**kwargs, **({"*args": args} if args else {})}))
                    continue
                calls.append(ToolCall(name=name, arguments=dict(bound.arguments)))
            out.append(calls)
        return out

    def replay(self, task_id: str, actions: Sequence[Sequence[ToolCall]]) -> Verdict:
        """Play ``actions`` (one list per user turn) and verify; the number of turns must match the task."""
        num_turns = len(self._record(task_id).ground_truth)
        if len(actions) != num_turns:
            return Verdict(
                reward=0.0,
                passed=False,
                details={
                    "task_id": task_id,
                    "num_turns": num_turns,
                    "turns_reached": min(len(actions), num_turns),
                    "checker": "envace",
                    "error_type": "multi_turn:force_terminated",
                    "reason": f"the action sequence has {len(actions)} turns but the task has {num_turns} user turns",
                },
            )
        return super().replay(task_id, actions)

    # -- extras ---------------------------------------------------------------------------------------

    def tool_owner(self, task_id: str) -> dict[str, str]:
        """Tool name → BFCL class for the task (e.g. ``{"cd": "GorillaFileSystem", ...}``)."""
        record = self._record(task_id)
        owner = _method_owner(record.entry["involved_classes"])
        return {name: owner[name] for name in record.tools}

    def ground_truth(self, task_id: str) -> list[list[str]]:
        """BFCL's raw ground-truth call strings, one list per turn."""
        return copy.deepcopy(self._record(task_id).ground_truth)

    def entry(self, task_id: str) -> dict[str, Any]:
        """A copy of bfcl_eval's dataset entry for the task."""
        return copy.deepcopy(self._record(task_id).entry)

    def _user_message(self, record: _TaskRecord, turn: int) -> str:
        if turn in record.missed and not record.entry["question"][turn]:
            return DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
        messages = record.entry["question"][turn]
        return "\n\n".join(str(m.get("content", "")) for m in messages if m.get("role", "user") == "user")

    def _build_spec(self, record: _TaskRecord) -> TaskSpec:
        entry = record.entry
        classes = list(entry["involved_classes"])
        gt = record.ground_truth
        empty_turns = [i for i, turn in enumerate(gt) if not turn]
        first_turn = entry["question"][0]
        system = "\n\n".join(str(m.get("content", "")) for m in first_turn if m.get("role") == "system") or None
        state_lines = []
        for cls in classes:
            config = entry["initial_config"].get(cls)
            state_lines.append(f"{cls}: {_summarize(config) if config else '(default state)'}")
        gt_funcs = sorted({c.split("(", 1)[0].strip() for turn in gt for c in turn})
        verifier = [
            (
                f"Official BFCL multi_turn_checker over {len(gt)} user turns: after every turn the public state of "
                f"{', '.join(classes)} must equal the state reached by the ground-truth calls "
                f"({sum(len(t) for t in gt)} calls using {', '.join(gt_funcs)}), and every ground-truth call's "
                "output must appear among the agent's call outputs so far."
            )
        ]
        if empty_turns:
            verifier.append(
                f"Turn(s) {empty_turns} have no ground truth: the request cannot be served, so the agent must make "
                "no call there (multi_turn_irrelevance_checker)"
                + ("." if self.check_irrelevance else "; not enforced in this pool configuration.")
            )
        for turn, names in sorted(record.missed.items()):
            verifier.append(f"Functions {names} are withheld until turn {turn}, when they are added to the tools.")
        metadata = {
            "involved_classes": classes,
            "num_turns": len(gt),
            "irrelevance_turns": empty_turns,
            "missed_function": {str(t): names for t, names in record.missed.items()},
            "excluded_function": list(entry.get("excluded_function") or []),
            "path": list(entry.get("path") or []),
            "long_context": "long_context" in record.category,
            "scenario": scenario_key(entry["id"]),
        }
        return TaskSpec(
            pool=self.name,
            task_id=entry["id"],
            env_id="bfcl:" + "+".join(sorted(classes)),
            category=record.category,
            split=record.split,
            system_prompt=system,
            first_user_message=self._user_message(record, 0),
            tools=[copy.deepcopy(record.tools[n]) for n in record.initial_tool_names],
            initial_state_summary="; ".join(state_lines),
            verifier_text=" ".join(verifier),
            metadata=metadata,
        )
