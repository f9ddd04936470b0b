"""A BFCL multi-turn episode: tool calls executed on the task's backend instances, verified by the official
checker."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envace.envs.base import Episode, TaskSpec, ToolCall, ToolCallError, Verdict
from envace.envs.bfcl.backend import method_owner, new_instances, public_signatures
from envace.envs.bfcl.calls import REJECTED_CALL, UnrenderableValue, format_result, render_call, render_literal
from envace.envs.bfcl.checker import compact, run_official_checker

if TYPE_CHECKING:
    from envace.envs.bfcl.pool import BFCLMultiTurnPool


@dataclass
class TaskRecord:
    entry: dict[str, Any]
    ground_truth: list[list[str]]
    category: str
    split: str
    tools: dict[str, dict[str, Any]]  # tool name -> converted schema (initial + held-out)
    initial_tool_names: list[str]
    missed: dict[int, list[str]]  # turn index -> tool names revealed at that turn


class BFCLEpisode(Episode):
    """One live BFCL multi-turn task: its own backend instances, turn pointer and call record."""

    def __init__(self, pool: BFCLMultiTurnPool, record: TaskRecord, spec: TaskSpec) -> None:
        self.spec = spec
        self._pool = pool
        self._record = record
        self._long_context = "long_context" in record.category
        self._instances = new_instances(record.entry, self._long_context)
        self._owner = method_owner(record.entry["involved_classes"])
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
            self._calls[self._turn].append(REJECTED_CALL)
            return f"Error: {reason}"

        rendered = render_call(name, arguments)  # validated above; cannot fail
        self._calls[self._turn].append(rendered)
        method = getattr(self._instances[self._owner[name]], name)
        try:
            result = method(**copy.deepcopy(dict(arguments)))
        except Exception as exc:  # noqa: BLE001 - the model must read its mistake; formatted as BFCL does
            return f"Error during execution: {exc}"
        return format_result(result)

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
        sig = public_signatures(self._owner[name])[name]
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
        except UnrenderableValue as exc:
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
            details["checker_details"] = compact(result["details"])
    return Verdict(reward=1.0 if passed else 0.0, passed=passed, details=details)


