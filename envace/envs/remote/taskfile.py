"""Task files of the ``mcp`` pool: JSON Lines, one task per line, validated as a whole before any task runs.

A line (every key but ``env_id``, ``system_prompt``, ``turns``, ``workspace`` and ``gold`` is required; ``gold`` is
required on train tasks)::

    {"task_id": "git/branch-switch-01", "split": "train", "category": "branch", "server": "git",
     "instruction": "Create a branch named feature/search from main and switch to it.",
     "turns": [{"user": "a later user message"}],
     "workspace": {"base": "fixtures/webapp.json", "steps": [{"write": {"notes.txt": "todo\\n"}}]},
     "tools": ["git_create_branch", "git_checkout"],
     "verifier": {"kind": "git", "checks": [{"head_branch": "feature/search"}, {"clean": true}]},
     "gold": [[{"name": "git_create_branch", "arguments": {"branch_name": "feature/search"}},
               {"name": "git_checkout", "arguments": {"branch_name": "feature/search"}}]]}

The workspace is a git repository built from ``steps`` (after the steps of the JSON file ``base`` names, relative to
the task file): ``{"commit": MESSAGE, "files": {PATH: TEXT}}`` writes the files and commits them, ``{"branch": NAME}``
creates a branch at HEAD, ``{"checkout": NAME}`` switches to it, ``{"write": {PATH: TEXT}}`` writes files without
staging them, ``{"stage": [PATH, ...]}`` stages them. Verifier checks are listed in :data:`GIT_CHECKS` (the end state
of the repository, read with the ``git`` CLI, and the assistant's replies) and :data:`TOOL_CHECKS` (a read-only tool
call after the episode). A mistake raises ``ValueError`` with one line naming ``file:line``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["GIT_CHECKS", "TOOL_CHECKS", "TaskRecord", "check_tools", "describe_check", "load_tasks", "task_files"]

_KEYS = {"task_id", "split", "category", "server", "instruction", "tools", "verifier", "env_id", "system_prompt",
         "turns", "workspace", "gold"}
_REQUIRED = ("task_id", "split", "category", "server", "instruction", "tools", "verifier")
_SPLITS = ("train", "test")
#: git verifier checks: the check's main key and the other keys it allows
GIT_CHECKS: dict[str, frozenset[str]] = {
    "branch": frozenset({"exists"}),  # the branch exists (or, with "exists": false, does not)
    "head_branch": frozenset(),  # HEAD is on this branch
    "commit_message": frozenset({"on"}),  # the tip commit of "on" (default HEAD) has this message
    "commits": frozenset({"on"}),  # "on" (default HEAD) has this many commits
    "tracked": frozenset({"on"}),  # the path is in the tree of "on" (default HEAD)
    "not_tracked": frozenset({"on"}),  # the path is not in the tree of "on"
    "clean": frozenset(),  # the working tree is clean (true) or not (false), untracked files included
    "staged": frozenset(),  # exactly these paths are staged
    "file_exists": frozenset(),  # the path exists in the working tree
    "reply_contains": frozenset(),  # the assistant's replies contain this text (case-insensitive)
}
#: tool verifier checks: a read-only call after the episode whose text must contain the given text
TOOL_CHECKS: dict[str, frozenset[str]] = {"call": frozenset({"contains", "absent"})}
_STEP_KEYS = {"commit": {"files"}, "branch": set(), "checkout": set(), "write": set(), "stage": set()}


@dataclass(frozen=True)
class TaskRecord:
    """One validated task line, with where it came from (for error messages and relative paths)."""

    data: dict[str, Any]
    path: Path
    line: int
    steps: tuple[dict[str, Any], ...] = field(default=())

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def task_id(self) -> str:
        return self.data["task_id"]


def task_files(tasks: str | Path) -> list[Path]:
    """``tasks`` itself (a ``.jsonl`` file) or the ``*.jsonl`` files of the directory, sorted."""
    path = Path(tasks)
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise ValueError(f"tasks: no *.jsonl file in {path}")
        return files
    if not path.is_file():
        raise ValueError(f"tasks: no such file or directory: {path}")
    return [path]


def load_tasks(files: Iterable[Path], servers: Iterable[str]) -> list[TaskRecord]:
    """Every task of ``files``, each line checked against the schema and the known ``servers``; a task id used twice
    is an error too. Tool names are checked later, against the servers' tool lists (:func:`check_tools`)."""
    servers = set(servers)
    records: list[TaskRecord] = []
    seen: dict[str, str] = {}
    for path in files:
        try:
            lines = path.read_text(encoding="utf-8").split("\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: cannot read the task file: {exc}") from None
        for n, text in enumerate(lines, 1):
            if not text.strip():
                continue
            rec = _parse_line(path, n, text, servers)
            if rec.task_id in seen:
                raise ValueError(f"{rec.where}: task_id {rec.task_id!r} already used at {seen[rec.task_id]}")
            seen[rec.task_id] = rec.where
            records.append(rec)
    return records


def check_tools(records: Sequence[TaskRecord], tools: Mapping[str, Iterable[str]]) -> None:
    """Each task's tool subset, gold calls and tool-verifier calls name tools its server has."""
    for rec in records:
        known = set(tools[rec.data["server"]])
        for name in rec.data["tools"]:
            if name not in known:
                raise ValueError(f"{rec.where}: unknown tool {name!r} in 'tools' for server "
                                 f"{rec.data['server']!r}; it has: {', '.join(sorted(known))}")
        subset = set(rec.data["tools"])
        for turn in rec.data.get("gold") or []:
            for call in turn:
                if call["name"] not in subset:
                    raise ValueError(f"{rec.where}: gold calls {call['name']!r}, which is not in the task's 'tools'")
        if rec.data["verifier"]["kind"] == "tool":
            for check in rec.data["verifier"]["checks"]:
                if check["call"]["name"] not in known:
                    raise ValueError(f"{rec.where}: verifier calls unknown tool {check['call']['name']!r}")


def describe_check(check: Mapping[str, Any]) -> str:
    """A verifier check in words (for ``TaskSpec.verifier_text``)."""
    on = f" on {check['on']}" if "on" in check else ""
    if "branch" in check:
        return f"branch {check['branch']} {'exists' if check.get('exists', True) else 'does not exist'}"
    if "head_branch" in check:
        return f"HEAD is on branch {check['head_branch']}"
    if "commit_message" in check:
        return f"the last commit{on or ' on HEAD'} has the message {check['commit_message']!r}"
    if "commits" in check:
        return f"{check['commits']} commit(s){on or ' on HEAD'}"
    if "tracked" in check:
        return f"{check['tracked']} is tracked{on}"
    if "not_tracked" in check:
        return f"{check['not_tracked']} is not tracked{on}"
    if "clean" in check:
        return "the working tree is clean" if check["clean"] else "the working tree has changes"
    if "staged" in check:
        return f"exactly {sorted(check['staged'])} staged"
    if "file_exists" in check:
        return f"{check['file_exists']} exists in the working tree"
    if "reply_contains" in check:
        return f"the reply mentions {check['reply_contains']!r}"
    call = check["call"]
    verb = "does not contain" if "absent" in check else "contains"
    return f"{call['name']}({json.dumps(call.get('arguments', {}))}) {verb} {check.get('absent', check.get('contains'))!r}"


# -- one line -------------------------------------------------------------------------------------------------------


def _parse_line(path: Path, n: int, text: str, servers: set[str]) -> TaskRecord:
    where = f"{path}:{n}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: bad JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a task must be a JSON object, got {type(data).__name__}")  # noqa: TRY004
    try:
        _check_task(data, servers)
        steps = tuple(_workspace_steps(data.get("workspace"), path.parent))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return TaskRecord(data=data, path=path, line=n, steps=steps)


def _check_task(data: dict[str, Any], servers: set[str]) -> None:
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"missing key(s) {missing}")
    for key in ("task_id", "category", "instruction", "server"):
        _string(data[key], key)
    for key in ("env_id", "system_prompt"):
        if key in data:
            _string(data[key], key)
    if data["split"] not in _SPLITS:
        raise ValueError(f"split must be one of {list(_SPLITS)}, got {data['split']!r}")
    if data["server"] not in servers:
        raise ValueError(f"unknown server {data['server']!r}; known: {', '.join(sorted(servers))}")
    tools = data["tools"]
    if not isinstance(tools, list) or not tools or not all(isinstance(t, str) and t for t in tools):
        raise ValueError("'tools' must be a non-empty list of tool names")
    turns = data.get("turns", [])
    if not isinstance(turns, list) or not all(isinstance(t, dict) and set(t) == {"user"} and isinstance(t["user"], str)
                                              and t["user"] for t in turns):
        raise ValueError("'turns' must be a list of {\"user\": TEXT}")
    _check_verifier(data["verifier"])
    _check_gold(data, 1 + len(turns))


def _string(value: Any, key: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key!r} must be a non-empty string")


def _check_verifier(verifier: Any) -> None:
    if not isinstance(verifier, dict) or verifier.get("kind") not in ("git", "tool"):
        raise ValueError("'verifier' must be {\"kind\": \"git\" | \"tool\", \"checks\": [...]}")
    if set(verifier) - {"kind", "checks", "reward"}:
        raise ValueError(f"unknown verifier key(s) {sorted(set(verifier) - {'kind', 'checks', 'reward'})}")
    if verifier.get("reward", "binary") not in ("binary", "partial"):
        raise ValueError(f"verifier reward must be 'binary' or 'partial', got {verifier['reward']!r}")
    checks = verifier.get("checks")
    if not isinstance(checks, list) or not checks:
        raise ValueError("verifier 'checks' must be a non-empty list")
    vocab = GIT_CHECKS if verifier["kind"] == "git" else TOOL_CHECKS
    for i, check in enumerate(checks):
        _check_one(check, vocab, f"check {i}")


def _check_one(check: Any, vocab: Mapping[str, frozenset[str]], label: str) -> None:
    if not isinstance(check, dict):
        raise ValueError(f"{label} must be a JSON object")  # noqa: TRY004  (a task-file mistake)
    heads = [k for k in check if k in vocab]
    if len(heads) != 1:
        raise ValueError(f"unknown verifier check {json.dumps(check)}; known: {', '.join(vocab)}")
    head = heads[0]
    extra = set(check) - {head} - vocab[head]
    if extra:
        raise ValueError(f"{label} ({head}): unknown key(s) {sorted(extra)}")
    value = check[head]
    if head == "call":
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(
                value.get("arguments", {}), dict) or ("contains" in check) == ("absent" in check):
            raise ValueError(f"{label}: a tool check is {{\"call\": {{\"name\", \"arguments\"}}, \"contains\" | "
                             "\"absent\": TEXT}")
    elif head == "clean":
        if not isinstance(value, bool):
            raise ValueError(f"{label}: 'clean' must be true or false")
    elif head == "commits":
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{label}: 'commits' must be a count")
    elif head == "staged":
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise ValueError(f"{label}: 'staged' must be a list of paths")
    elif not isinstance(value, str) or not value:
        raise ValueError(f"{label}: {head!r} must be a non-empty string")
    if "exists" in check and not isinstance(check["exists"], bool):
        raise ValueError(f"{label}: 'exists' must be true or false")


def _check_gold(data: dict[str, Any], n_turns: int) -> None:
    gold = data.get("gold")
    if gold is None:
        if data["split"] == "train":
            raise ValueError("missing 'gold' on a train task")
        return
    if not isinstance(gold, list) or not gold or len(gold) > n_turns or not all(isinstance(t, list) for t in gold):
        raise ValueError(f"'gold' must be a list of at most {n_turns} turn(s), each a list of calls")
    for turn in gold:
        for call in turn:
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                    and isinstance(call.get("arguments", {}), dict) and set(call) <= {"name", "arguments"}):
                raise ValueError(f"gold call {json.dumps(call)} is not {{\"name\", \"arguments\"}}")


def _workspace_steps(workspace: Any, folder: Path, depth: int = 0) -> list[dict[str, Any]]:
    if workspace is None:
        return []
    if not isinstance(workspace, dict) or set(workspace) - {"base", "steps", "description"}:
        raise ValueError("'workspace' must be {\"base\": FILE, \"steps\": [...], \"description\": TEXT}")
    steps: list[dict[str, Any]] = []
    if "base" in workspace:
        base = folder / str(workspace["base"])
        if depth > 4:
            raise ValueError(f"workspace base {base} nests too deep")
        try:
            base_data = json.loads(base.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"workspace base {base}: {exc}") from None
        steps += _workspace_steps(base_data, base.parent, depth + 1)
    raw = workspace.get("steps", [])
    if not isinstance(raw, list):
        raise ValueError("workspace 'steps' must be a list")  # noqa: TRY004  (a task-file mistake)
    for step in raw:
        steps.append(_check_step(step))
    return steps


def _check_step(step: Any) -> dict[str, Any]:
    heads = [k for k in _STEP_KEYS if isinstance(step, dict) and k in step]
    if len(heads) != 1 or set(step) - {heads[0]} - _STEP_KEYS[heads[0]]:
        raise ValueError(f"unknown workspace step {json.dumps(step)}; known: {', '.join(_STEP_KEYS)}")
    head = heads[0]
    files = step.get("files", {}) if head == "commit" else step[head] if head == "write" else {}
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ValueError(f"workspace step {head!r}: files must be {{PATH: TEXT}}")
    for path in files:
        if path.startswith(("/", ".git")) or ".." in Path(path).parts:
            raise ValueError(f"workspace step {head!r}: path {path!r} leaves the repository")
    if head == "stage" and not (isinstance(step[head], list) and all(isinstance(p, str) for p in step[head])):
        raise ValueError("workspace step 'stage' must list paths")
    if head in ("commit", "branch", "checkout") and not (isinstance(step[head], str) and step[head]):
        raise ValueError(f"workspace step {head!r} needs a non-empty name")
    return dict(step)
