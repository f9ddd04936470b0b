"""The ``bfcl_multi_turn`` pool: the 800 tasks of the four multi-turn categories, split per scenario."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from envace.envs.base import EnvironmentPool, TaskSpec, ToolCall, Verdict, register_pool
from envace.envs.bfcl.backend import method_owner, public_signatures
from envace.envs.bfcl.calls import parse_call_string, split_call_list
from envace.envs.bfcl.episode import BFCLEpisode, TaskRecord
from envace.envs.bfcl.schema import convert_bfcl_function_doc
from envace.envs.bfcl.upstream import (
    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC,
    load_dataset_entry,
    load_ground_truth_entry,
)

POOL_NAME = "bfcl_multi_turn"
MULTI_TURN_CATEGORIES: tuple[str, ...] = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)

# Names bfcl_eval's executor refuses to evaluate; a tool with one of these names could never pass.
_BFCL_BLOCKED_NAMES = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})


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
        self._records: dict[str, TaskRecord] = {}
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
            owner = method_owner(entry["involved_classes"])
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
            self._records[task_id] = TaskRecord(
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

    def _record(self, task_id: str) -> TaskRecord:
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
        owner = method_owner(record.entry["involved_classes"])
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
                    bound = public_signatures(owner[name])[name].bind(*args, **kwargs)
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
        owner = method_owner(record.entry["involved_classes"])
        return {name: owner[name] for name in record.tools}

    def ground_truth(self, task_id: str) -> list[list[str]]:
        """BFCL's raw ground-truth call strings, one list per turn."""
        return copy.deepcopy(self._record(task_id).ground_truth)

    def entry(self, task_id: str) -> dict[str, Any]:
        """A copy of bfcl_eval's dataset entry for the task."""
        return copy.deepcopy(self._record(task_id).entry)

    def _user_message(self, record: TaskRecord, turn: int) -> str:
        if turn in record.missed and not record.entry["question"][turn]:
            return DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
        messages = record.entry["question"][turn]
        return "\n\n".join(str(m.get("content", "")) for m in messages if m.get("role", "user") == "user")

    def _build_spec(self, record: TaskRecord) -> TaskSpec:
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
