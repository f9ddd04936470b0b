"""Checklist-judge reward (CM2-style) over a multi-turn tool-use trajectory.

A CM2 task carries ``checklist_list[c][t] = [item, ...]``: ``C`` checklists, each with one list of
weighted binary criteria per user turn ``t`` (the format :mod:`envace.data.cm2` validates and stores as
``reward_model.ground_truth``). The judge asks an LLM, for every assistant *step* (assistant message) of
user turn ``t`` and every item of that turn, whether the step satisfies the item. The prompt shows the
criterion, the earlier turns and the current turn up to that step with its tool results (see
:mod:`envace.rewards.prompts`); the reply is ``{"reasoning": str, "answer": bool}``.

Aggregation:

* an item passes for its turn if ANY judged step of that turn passed it;
* the items' weights are normalised to sum to 1 per turn (equal weights if they sum to 0), and the turn
  score is the sum of the weights of the passed items (0 for a turn without items or never reached);
* an item that focuses on tool calls (``focus_on`` starting with one of
  :attr:`ChecklistJudgeConfig.tool_focus_prefixes`) scores 0 for a turn in which a tool response was an
  error (``tool_error_scope="turn"``, the default; ``"step"`` only fails the steps followed by an error,
  as the CM2 reference code does). Those items are not sent to the judge;
* reward = sum over checklists and turns of the turn scores / (C x T), T = turns of the checklist, so
  turns the agent never reached count as 0.

Failures are never a silent 0: if any judge call fails (infrastructure error after the pool's retries,
or no valid JSON after the repair rounds) the result is ``masked=True`` with ``reward=None`` and the
reason. A :class:`~envace.rewards.llm.ConfigurationError` (wrong model name, bad key) is raised.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from envace.rewards.llm import ConfigurationError, InfrastructureError, LLMPool, ModelOutputError
from envace.rewards.prompts import DEFAULT_CHECKLIST_PROMPT_VERSION, checklist_judge_template
from envllm import clip_middle

__all__ = [
    "ChecklistItem",
    "ChecklistJudge",
    "ChecklistJudgeConfig",
    "Checklists",
    "Evidence",
    "JudgeResult",
    "JudgeVerdict",
    "aggregate_checklist",
    "default_is_tool_error",
    "parse_checklists",
    "render_messages",
    "split_turns",
]


# -- checklist data model ---------------------------------------------------------------------------------
# envace.data.cm2 validates raw records with a JSON Schema (CM2_RECORD_SCHEMA) and has no typed item model;
# these pydantic models mirror its item schema field for field (extra keys are kept, as cm2 keeps them).
class Evidence(BaseModel):
    """Where the reference dialogue shows the expected behaviour."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    turn: int = Field(ge=0)
    step: int = Field(ge=0)
    from_: str = Field(alias="from")
    snippet: str


class ChecklistItem(BaseModel):
    """One weighted binary criterion of one user turn."""

    model_config = ConfigDict(extra="allow")

    id: str = Field(min_length=1)
    question: str = Field(min_length=1)
    focus_on: str = Field(min_length=1)  # e.g. "assistant.tool_calls", "assistant.content", "tool.content"
    pass_condition: str = Field(min_length=1)
    weight: float = Field(ge=0)
    failure_examples: list[str] = Field(default_factory=list)
    evidence: list[Evidence] = Field(default_factory=list)
    required_for_next_turn: bool = False
    dependence: str | list[str] | None = None


#: ``[checklist][user turn][item]``
Checklists = list[list[list[ChecklistItem]]]
_CHECKLISTS = TypeAdapter(Checklists)


def parse_checklists(obj: Any) -> Checklists:
    """Validate ``checklist_list`` (nested lists, or their JSON string as stored in the parquet ground truth).

    Raises :class:`ValueError` naming the first problems.
    """
    if isinstance(obj, str | bytes):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError as exc:
            raise ValueError(f"checklist_list is not valid JSON: {exc.msg}") from None
    try:
        checklists = _CHECKLISTS.validate_python(obj)
    except ValidationError as exc:
        problems = "; ".join(f"$[{']['.join(str(p) for p in e['loc'])}]: {e['msg']}" for e in exc.errors()[:5])
        raise ValueError(f"invalid checklist_list: {problems}") from None
    if not checklists or not all(checklists):
        raise ValueError("checklist_list needs at least one checklist with at least one user turn")
    return checklists


class JudgeVerdict(BaseModel):
    """What the judge must answer (strict: ``"answer": "true"`` is rejected and repaired)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    reasoning: str
    answer: bool


# -- transcript -------------------------------------------------------------------------------------------
_ERROR_TEXT_RE = re.compile(r"^\s*(?:\[?error\b|traceback \(most recent call last\))", re.IGNORECASE)
_THINK_RE = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.DOTALL)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content if p is not None)
    return str(content)


def default_is_tool_error(message: Mapping[str, Any]) -> bool:
    """Whether a ``tool`` message reports an error.

    True for an explicit ``is_error``/``error`` flag, text starting with ``Error`` (envace's environments
    and env loop write ``"Error: ..."``) or a Python traceback, and a JSON object whose ``error`` or
    ``error_tool_call`` key is set (CM2's simulated tools).
    """
    if message.get("is_error") is True or message.get("error") is True:
        return True
    content = _text(message.get("content"))
    if _ERROR_TEXT_RE.match(content):
        return True
    stripped = content.strip()
    if stripped.startswith("{"):
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError:
            return False
        if isinstance(obj, dict):
            return any(obj.get(k) not in (None, False, "", [], {}) for k in ("error", "error_tool_call"))
    return False


@dataclass
class Step:
    """One assistant message of a user turn and the tool messages answering it."""

    turn: int  # user-turn index
    step: int  # index of this assistant message within its turn
    index: int  # position of the assistant message in the trajectory
    end: int  # position after its tool messages
    tool_error: bool  # one of its tool messages is an error


@dataclass
class Turn:
    """A user message and the assistant steps until the next user message."""

    index: int
    start: int  # position of the user message in the trajectory
    steps: list[Step] = field(default_factory=list)

    @property
    def tool_error(self) -> bool:
        return any(s.tool_error for s in self.steps)


def split_turns(
    messages: Sequence[Mapping[str, Any]], is_tool_error: Callable[[Mapping[str, Any]], bool] = default_is_tool_error
) -> list[Turn]:
    """The user turns of an OpenAI-format trajectory (messages before the first user message are context)."""
    turns: list[Turn] = []
    current: Step | None = None
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role == "user":
            turns.append(Turn(index=len(turns), start=i))
            current = None
        elif role == "assistant" and turns:
            turn = turns[-1]
            current = Step(turn=turn.index, step=len(turn.steps), index=i, end=i + 1, tool_error=False)
            turn.steps.append(current)
        elif role in ("tool", "observation") and current is not None:
            current.end = i + 1
            current.tool_error = current.tool_error or is_tool_error(msg)
    return turns


def _tool_call_line(call: Any) -> tuple[str | None, str]:
    if not isinstance(call, Mapping):
        return None, f"- {call}"
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
    name = fn.get("name", "?")
    args = fn.get("arguments", {})
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return call.get("id"), f"- {name}({args})"


def render_messages(messages: Sequence[Mapping[str, Any]], *, include_reasoning: bool = True) -> list[str]:
    """One plain-text block per message, labelled with user turn and assistant step numbers."""
    out: list[str] = []
    turn, step = -1, 0
    call_names: dict[str, str] = {}
    for msg in messages:
        role = msg.get("role")
        content = _text(msg.get("content"))
        if role == "system":
            out.append(f"SYSTEM:\n{content}")
        elif role == "user":
            turn, step = turn + 1, 0
            out.append(f"=== User turn {turn} ===\nUSER:\n{content}")
        elif role == "assistant":
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
            m = _THINK_RE.match(content) if "</think>" in content else None
            if m:
                reasoning, content = reasoning or m.group(1).strip(), content[m.end() :]
            lines = [f"ASSISTANT (turn {turn}, step {step}):"]
            if include_reasoning and str(reasoning).strip():
                lines.append(f"[private reasoning]\n{str(reasoning).strip()}")
            lines.append(f"[reply to the user]\n{content.strip() or '(none)'}")
            calls = msg.get("tool_calls") or []
            if calls:
                lines.append("[tool calls]")
                for call in calls:
                    call_id, line = _tool_call_line(call)
                    if call_id:
                        call_names[call_id] = line[2:].split("(", 1)[0]
                    lines.append(line)
            else:
                lines.append("[tool calls] (none)")
            out.append("\n".join(lines))
            step += 1
        elif role in ("tool", "observation"):
            name = msg.get("name") or call_names.get(str(msg.get("tool_call_id")), "")
            out.append(f"TOOL RESULT{f' ({name})' if name else ''}:\n{content}")
        else:
            out.append(f"{str(role).upper()}:\n{content}")
    return out


# -- aggregation ------------------------------------------------------------------------------------------
def _normalised_weights(items: Sequence[ChecklistItem]) -> list[float]:
    total = sum(item.weight for item in items)
    if not items:
        return []
    if total <= 0:
        return [1.0 / len(items)] * len(items)
    return [item.weight / total for item in items]


def item_key(c: int, t: int, item: ChecklistItem) -> str:
    return f"c{c}/t{t}/{item.id}"


def aggregate_checklist(
    checklists: Checklists,
    step_passes: Mapping[tuple[int, int, int], Sequence[bool]],
    tool_error_items: frozenset[tuple[int, int, int]] | set[tuple[int, int, int]] = frozenset(),
) -> tuple[float, list[float], dict[str, dict[str, Any]]]:
    """Reward, per-turn scores and per-item details from step verdicts.

    ``step_passes[(c, t, k)]`` are the verdicts of item ``k`` of turn ``t`` of checklist ``c`` at each judged
    step (missing or empty: the turn was not reached or had no step). ``tool_error_items`` are forced to 0.
    Returns ``(reward, per_turn, per_item)``: ``per_turn[t]`` is the turn score averaged over checklists, so
    ``reward == mean(per_turn)`` when all checklists have the same number of turns.
    """
    n_cells = sum(len(checklist) for checklist in checklists)
    if n_cells == 0:
        raise ValueError("no checklist turns to aggregate")
    n_turns = max(len(checklist) for checklist in checklists)
    per_turn_sum = [0.0] * n_turns
    per_item: dict[str, dict[str, Any]] = {}
    total = 0.0
    for c, checklist in enumerate(checklists):
        for t, items in enumerate(checklist):
            score = 0.0
            for k, (item, weight) in enumerate(zip(items, _normalised_weights(items), strict=True)):
                steps = [bool(v) for v in step_passes.get((c, t, k), ())]
                forced = (c, t, k) in tool_error_items
                passed = any(steps) and not forced
                if passed:
                    score += weight
                per_item[item_key(c, t, item)] = {
                    "passed": passed,
                    "weight": weight,
                    "steps": steps,
                    "tool_error": forced,
                    "focus_on": item.focus_on,
                }
            per_turn_sum[t] += score
            total += score
    n_checklists = len(checklists)
    return total / n_cells, [s / n_checklists for s in per_turn_sum], per_item


# -- the judge --------------------------------------------------------------------------------------------
@dataclass
class ChecklistJudgeConfig:
    """How :class:`ChecklistJudge` prompts and aggregates."""

    # prompt template version, a key of envace.rewards.prompts.CHECKLIST_JUDGE_PROMPTS
    prompt_version: str = DEFAULT_CHECKLIST_PROMPT_VERSION
    # follow-up requests per judge call when the reply is not valid {"reasoning", "answer"} JSON
    repair_rounds: int = 1
    # "turn": a tool error anywhere in the turn zeroes the tool-focused items of that turn;
    # "step": only the steps followed by an error fail them (other steps are still judged)
    tool_error_scope: str = "turn"
    # an item focuses on tool calls when its focus_on starts with one of these (case-insensitive)
    tool_focus_prefixes: tuple[str, ...] = ("assistant.tool_calls", "tool.content")
    # show the assistant's private reasoning (reasoning_content / <think>) to the judge
    include_reasoning: bool = True
    # character budget of the earlier-turns transcript (middle truncated); <= 0: unlimited
    max_history_chars: int = 30_000
    # character budget of the current-turn transcript (middle truncated, so the graded step stays); <= 0: unlimited
    max_current_chars: int = 30_000
    # send response_format json_schema with each judge call (None: the pool config's use_json_schema)
    use_json_schema: bool | None = None
    # sampling overrides for judge calls (temperature, max_tokens, seed, extra_body, ...)
    sampling: dict[str, Any] = field(default_factory=dict)
    # at most this many failure reasons are kept in JudgeResult.failures
    max_failures_kept: int = 20

    def __post_init__(self) -> None:
        checklist_judge_template(self.prompt_version)  # fail early on an unknown version
        if self.tool_error_scope not in ("turn", "step"):
            raise ValueError(f"tool_error_scope must be 'turn' or 'step', got {self.tool_error_scope!r}")
        if self.repair_rounds < 0:
            raise ValueError(f"repair_rounds must be >= 0, got {self.repair_rounds}")
        self.tool_focus_prefixes = tuple(p.lower() for p in self.tool_focus_prefixes)


@dataclass
class JudgeResult:
    """The checklist reward of one trajectory."""

    reward: float | None  # None exactly when masked
    masked: bool  # a judge call failed: do not train on this sample's judged reward
    reason: str  # why masked ("" otherwise)
    per_turn: list[float]  # turn scores averaged over checklists ([] when masked)
    per_item: dict[str, dict[str, Any]]  # "c{c}/t{t}/{item id}" -> passed, weight, steps, tool_error, reasoning
    n_calls: int  # distinct judge calls made (identical prompts are asked once)
    n_failures: int  # judge calls that failed
    n_tool_error_items: int = 0  # (checklist, turn, item) cells forced to 0 by a tool error, not judged
    failures: list[str] = field(default_factory=list)  # reasons of the failed calls (capped)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ChecklistJudge:
    """Judge trajectories against CM2 checklists with an :class:`~envace.rewards.llm.LLMPool`.

    All calls of one trajectory run concurrently; the pool's semaphore bounds them (across trajectories too
    when the pool is shared).
    """

    def __init__(
        self,
        pool: LLMPool,
        config: ChecklistJudgeConfig | None = None,
        *,
        is_tool_error: Callable[[Mapping[str, Any]], bool] = default_is_tool_error,
    ) -> None:
        self.pool = pool
        self.config = config or ChecklistJudgeConfig()
        self.is_tool_error = is_tool_error
        self._template = checklist_judge_template(self.config.prompt_version)

    def focuses_on_tools(self, item: ChecklistItem) -> bool:
        focus = item.focus_on.strip().lower()
        return any(focus.startswith(p) for p in self.config.tool_focus_prefixes)

    def build_prompt(self, item: ChecklistItem, rendered: Sequence[str], turn: Turn, step: Step) -> str:
        cfg = self.config
        history = "\n\n".join(rendered[: turn.start]) or "(none: this is the first turn)"
        current = "\n\n".join(rendered[turn.start : step.end])
        failure = "\n".join(f"- {f}" for f in item.failure_examples) or "- (none given)"
        evidence = (
            "\n".join(f"- (turn {e.turn}, step {e.step}, {e.from_}): {e.snippet}" for e in item.evidence)
            or "- (none given)"
        )
        return self._template.substitute(
            question=item.question,
            focus_on=item.focus_on,
            pass_condition=item.pass_condition,
            failure_examples=failure,
            evidence=evidence,
            history=clip_middle(history, cfg.max_history_chars),
            current=clip_middle(current, cfg.max_current_chars),
            step=step.step,
        )

    async def _ask(self, prompt: str) -> JudgeVerdict:
        return await self.pool.complete_json(
            [{"role": "user", "content": prompt}],
            JudgeVerdict,
            repair_rounds=self.config.repair_rounds,
            use_json_schema=self.config.use_json_schema,
            **self.config.sampling,
        )

    async def judge(self, messages: Sequence[Mapping[str, Any]], checklists: Any) -> JudgeResult:
        """Score one trajectory (OpenAI-format messages) against ``checklist_list`` (see :func:`parse_checklists`).

        Raises :class:`ValueError` for invalid checklists and :class:`ConfigurationError` from the pool;
        every other judge failure masks the result.
        """
        cfg = self.config
        checklists = parse_checklists(checklists)
        turns = split_turns(messages, self.is_tool_error)
        rendered = render_messages(messages, include_reasoning=cfg.include_reasoning)

        prompts: dict[str, int] = {}  # prompt -> call index (identical prompts are asked once)
        plan: dict[tuple[int, int, int], list[int | None]] = {}  # cell -> call index per step (None: forced fail)
        tool_error_items: set[tuple[int, int, int]] = set()
        for c, checklist in enumerate(checklists):
            for t, items in enumerate(checklist):
                if t >= len(turns):
                    continue  # never reached: scores 0
                turn = turns[t]
                for k, item in enumerate(items):
                    tool_focused = self.focuses_on_tools(item)
                    if tool_focused and cfg.tool_error_scope == "turn" and turn.tool_error:
                        tool_error_items.add((c, t, k))
                        continue
                    calls: list[int | None] = []
                    for step in turn.steps:
                        if tool_focused and step.tool_error:  # step scope: this step fails, others are judged
                            calls.append(None)
                            continue
                        prompt = self.build_prompt(item, rendered, turn, step)
                        calls.append(prompts.setdefault(prompt, len(prompts)))
                    plan[(c, t, k)] = calls

        outcomes = await asyncio.gather(*(self._ask(p) for p in prompts), return_exceptions=True)
        failures: list[str] = []
        for out in outcomes:
            if isinstance(out, ConfigurationError):
                raise out
            if isinstance(out, InfrastructureError | ModelOutputError):
                failures.append(f"{type(out).__name__}: {out}")
            elif isinstance(out, BaseException):
                raise out
        n_calls = len(prompts)
        n_forced = len(tool_error_items)
        if failures:
            return JudgeResult(
                reward=None,
                masked=True,
                reason=f"{len(failures)} of {n_calls} judge call(s) failed; first: {failures[0]}",
                per_turn=[],
                per_item={},
                n_calls=n_calls,
                n_failures=len(failures),
                n_tool_error_items=n_forced,
                failures=failures[: cfg.max_failures_kept],
            )

        verdicts: list[JudgeVerdict] = outcomes  # type: ignore[assignment]
        step_passes = {
            cell: [verdicts[i].answer if i is not None else False for i in calls] for cell, calls in plan.items()
        }
        reward, per_turn, per_item = aggregate_checklist(checklists, step_passes, tool_error_items)
        for (c, t, k), calls in plan.items():
            per_item[item_key(c, t, checklists[c][t][k])]["reasoning"] = [
                verdicts[i].reasoning if i is not None else "tool error in this step" for i in calls
            ]
        for c, t, k in tool_error_items:
            per_item[item_key(c, t, checklists[c][t][k])]["reasoning"] = ["tool error in this turn"]
        return JudgeResult(
            reward=reward,
            masked=False,
            reason="",
            per_turn=per_turn,
            per_item=per_item,
            n_calls=n_calls,
            n_failures=0,
            n_tool_error_items=n_forced,
        )
