"""Procedurally generated multi-environment tool-use pool (``"synthetic"``).

A deterministic generator (stdlib + ``jsonschema``; no data files) of many small, fully executable
tool-use environments whose tasks are regular enough for a tiny model to learn from gold trajectories,
yet share structure across environments so that cross-environment relations are real.

Domains
    Nine domain templates (:data:`DOMAINS`): ``bank`` (accounts: owner, balance, open/frozen),
    ``shop`` (items: product, stock), ``calendar`` (events: title, hour), ``files`` (path, size),
    ``kv`` (entries: key, value), ``tickets`` (subject, priority), ``library`` (books: title, copies),
    ``loyalty`` (members: name, points, tier) and ``warehouse`` (bins: label, qty, state). Every domain
    state is a small dict ``{entity_id: {"name", "num", "status"}}``; a domain names the three fields
    (``owner``/``balance``/``status``, ``label``/``qty``/``state``, ...), the entity noun, its statuses
    (the first one is the status of newly created entities), the value range and the pool of entity
    names. Environment ``i`` (``env_id`` ``"syn-<domain>-<i>"``) instantiates domain ``i mod 9`` with
    its own entities (6-9, distinct values), id prefix (``A17``, ``K42``, ...), tool subset and
    renamings (tool names, id/amount/value/name/status parameter names, source/target parameter
    names), all drawn from ``random.Random(f"{seed}:{i}")``. The tool subset aims at 3-8 of the
    domain's operations but stops at a budget on the rendered schemas (:data:`_TOOLS_BUDGET_CHARS`),
    so that the prompt (the chat template's tool block + the instruction; there is no system prompt)
    stays within 512 Qwen3 tokens: environments end up with 3-6 tools.

Operations
    Tools implement nine abstract operations shared by all domains (the cross-environment structure):
    ``find`` (name -> ``{"id"}``), ``get`` (id -> the record), ``list`` (status -> ``{"ids"}``),
    ``set`` (status), ``add`` (increase the number), ``setnum`` (set the number), ``move`` (move an
    amount of the number between two entities; fails on insufficient funds), ``create`` (name + number
    -> ``{"id"}``, ids are ``prefix + (max number + 1)``) and ``delete``. Every environment has
    ``find``, ``get`` and at least one of ``set``/``add``/``setnum``. Tool schemas are OpenAI function
    schemas (``{"type": "function", "function": {"name", "description", "parameters"}}``) with terse
    descriptions; ``parameters`` is JSON Schema with types, status enums and ``required`` (kept lean
    for the prompt budget). Observations are ``json.dumps`` of a small dict; every failure is an
    observation ``{"error": "..."}``, never an exception: unknown tool, an argument name the tool does
    not have, arguments rejected by ``jsonschema``, an amount below 1 or a set/created number outside
    the domain's range, unknown id or name, insufficient amount, a taken name, calls after the
    episode ended.

Task shapes (``TaskSpec.category``)
    ``act``            one write call with ids and values given in the instruction
    ``query``          ``get`` then answer a field (number or status)
    ``lookup_act``     ``find`` by name, then a write on the returned id (id dependency)
    ``lookup_query``   ``find`` then ``get`` then answer (id dependency)
    ``copy_value``     ``get`` a number, then ``setnum``/``move`` with it (value dependency)
    ``transfer_chain`` two ``find`` calls, then ``move`` between the two ids (3 calls)
    ``create_verify``  ``create``, ``get`` the new id, answer its id and status
    ``filter_update``  ``list`` by status, then one write per returned id (2-4 calls)
    ``multiturn``      two user turns: a ``lookup_act``/``lookup_query`` then a follow-up on the same
                       entity ("Now set its status to frozen."); ``end_turn`` hands out the second message
    Environment tasks cycle through the shapes its tools allow (every environment allows at least
    ``act``, ``query``, ``lookup_act``, ``lookup_query`` and ``multiturn``); instructions are unique per
    environment (unless ``tasks_per_env`` exceeds what the shapes can vary; then queries repeat). Gold actions come from executing the generated calls, so every gold sequence is valid.

Verifier
    The expected final state is the gold replay's. Checks (``TaskSpec.verifier_text`` lists them):
    one per touched entity (its final fields, or that it is deleted, or that a new entity with the
    given fields exists), one that nothing else changed (no other entity modified, no extra entity
    created), and, for each user turn that asks a question, one that the agent's reply for that turn
    (the text passed to ``end_turn``) contains the expected value (number, status or id; whole word,
    case-insensitive). ``reward="binary"``: 1.0 iff all checks pass; ``reward="partial"``: the fraction
    of checks passed.

Replay and answers
    :meth:`SyntheticPool.replay` has no reply text to go on, so by default each turn's reply is the
    concatenation of that turn's observations ("the agent reports what its calls returned"). Gold
    replay thus scores 1.0, while a replay that skips or misdirects the lookup loses the answer check.
    Pass ``replies=pool.gold_replies(task_id)`` (or any texts) to score real replies;
    :meth:`SyntheticPool.gold_trajectory` gives the full gold chat (tool calls, observations, replies)
    for supervised fine-tuning.

Splits
    Per task: ``sha256(f"{seed}:{task_id}")`` mapped to [0, 1) below ``test_fraction`` is ``"test"``,
    otherwise ``"train"``. Construction is lazy: an environment (tools, state, tasks, gold) is built on
    first use of one of its tasks.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from envace.envs.base import EnvironmentPool, Episode, TaskSpec, ToolCall, ToolCallError, Verdict, register_pool

__all__ = [
    "DOMAINS",
    "OPS",
    "POOL_NAME",
    "SHAPES",
    "Domain",
    "SyntheticEpisode",
    "SyntheticPool",
    "export_envsched_jsonl",
]

POOL_NAME = "synthetic"

#: abstract operations, in the order tools are listed
OPS: tuple[str, ...] = ("find", "get", "list", "set", "add", "setnum", "move", "create", "delete")
#: task shapes (``TaskSpec.category``), in the order environments cycle through them
SHAPES: tuple[str, ...] = (
    "act",
    "query",
    "lookup_act",
    "lookup_query",
    "copy_value",
    "transfer_chain",
    "create_verify",
    "filter_update",
    "multiturn",
)
_WRITES = ("set", "add", "setnum", "delete")  # single-entity writes


@dataclass(frozen=True)
class Domain:
    """A domain template; environments instantiate it with their own entities and renamings."""

    name: str
    noun: str
    plural: str
    namef: str  # field holding the entity's unique name
    numf: str  # the numeric field
    statf: str  # the categorical field
    statuses: tuple[str, ...]  # statuses[0]: status of new entities
    lo: int
    hi: int
    names: tuple[str, ...]
    letters: str  # id prefix candidates
    tools: Mapping[str, tuple[str, ...]]  # op -> tool-name variants (ops the domain supports)
    idp: tuple[str, ...]  # id parameter name variants
    amtp: tuple[str, ...] = ("amount",)  # amount parameter name variants


_PEOPLE = (
    "Ana Ruiz", "Li Wei", "Omar Haddad", "Priya Nair", "Jon Berg", "Sara Kim", "Tom Lutz",
    "Ines Vidal", "Marta Fong", "Carl Ode", "Eva Lind", "Raj Patel", "Nora Diaz", "Ivan Petrov",
)  # fmt: skip

# fmt: off
DOMAINS: tuple[Domain, ...] = (
    Domain(
        "bank", "account", "accounts", "owner", "balance", "status", ("open", "frozen"), 20, 900, _PEOPLE, "ABK",
        {
            "find": ("find_account", "lookup_account", "account_by_owner"),
            "get": ("get_account", "account_info", "show_account"),
            "list": ("list_accounts", "accounts_by_status"),
            "set": ("set_account_status", "set_status"),
            "add": ("deposit", "credit_account"),
            "move": ("transfer", "move_funds"),
            "create": ("open_account", "create_account"),
            "delete": ("close_account", "delete_account"),
        },
        ("account_id", "acct", "id"),
    ),
    Domain(
        "shop", "item", "items", "product", "stock", "status", ("listed", "hidden"), 5, 300,
        ("lamp", "kettle", "mug", "desk", "chair", "sofa", "fan", "rug", "clock", "vase", "towel", "stool",
         "pillow", "mirror"),
        "IPS",
        {
            "find": ("find_item", "item_by_product", "search_item"),
            "get": ("get_item", "item_info"),
            "list": ("list_items", "items_by_status"),
            "set": ("set_item_status", "set_listing"),
            "add": ("restock", "add_stock"),
            "setnum": ("set_stock", "update_stock"),
            "create": ("add_item", "create_item"),
            "delete": ("remove_item", "delete_item"),
        },
        ("item_id", "sku", "id"),
        ("qty", "amount"),
    ),
    Domain(
        "calendar", "event", "events", "title", "hour", "status", ("confirmed", "tentative", "cancelled"), 7, 20,
        ("standup", "review", "lunch", "retro", "demo", "sync", "training", "interview", "planning", "offsite",
         "onboarding", "budget", "workshop", "party"),
        "ECM",
        {
            "find": ("find_event", "event_by_title"),
            "get": ("get_event", "event_info", "show_event"),
            "list": ("list_events", "events_by_status"),
            "set": ("set_event_status", "mark_event"),
            "setnum": ("reschedule", "set_event_hour"),
            "create": ("create_event", "add_event", "schedule_event"),
            "delete": ("delete_event", "remove_event"),
        },
        ("event_id", "id"),
    ),
    Domain(
        "files", "file", "files", "path", "size", "status", ("private", "shared"), 1, 999,
        ("notes.txt", "todo.md", "report.pdf", "data.csv", "logo.png", "main.py", "budget.xls", "readme.md",
         "plan.doc", "log.txt", "app.js", "index.html", "photo.jpg", "song.mp3"),
        "FD",
        {
            "find": ("find_file", "file_by_path", "locate_file"),
            "get": ("stat_file", "get_file", "file_info"),
            "list": ("list_files", "files_by_status"),
            "set": ("set_visibility", "set_file_status"),
            "add": ("append", "grow_file"),
            "setnum": ("truncate", "resize_file"),
            "create": ("create_file", "touch"),
            "delete": ("delete_file", "rm_file"),
        },
        ("file_id", "fid", "id"),
        ("bytes", "amount"),
    ),
    Domain(
        "kv", "entry", "entries", "key", "value", "status", ("live", "locked"), 1, 500,
        ("cache_ttl", "max_users", "retries", "timeout", "port", "workers", "batch", "quota", "limit", "depth",
         "threads", "backlog", "window", "shards"),
        "KV",
        {
            "find": ("find_key", "lookup_key"),
            "get": ("get_entry", "read_entry"),
            "list": ("list_entries", "entries_by_status"),
            "set": ("set_entry_status", "lock_state"),
            "add": ("incr", "increment"),
            "setnum": ("put", "set_value"),
            "move": ("shift_value", "move_value"),
            "create": ("create_entry", "insert"),
            "delete": ("delete_entry", "drop_entry"),
        },
        ("entry_id", "eid", "id"),
        ("by", "amount"),
    ),
    Domain(
        "tickets", "ticket", "tickets", "subject", "priority", "status", ("open", "pending", "closed"), 1, 9,
        ("login error", "slow page", "refund", "broken link", "crash", "typo", "timeout", "billing", "password",
         "upload fail", "sync issue", "dark mode", "export bug", "spam"),
        "TQ",
        {
            "find": ("find_ticket", "ticket_by_subject", "search_tickets"),
            "get": ("get_ticket", "ticket_info"),
            "list": ("list_tickets", "tickets_by_status"),
            "set": ("set_ticket_status", "update_ticket"),
            "setnum": ("set_priority", "reprioritize"),
            "create": ("create_ticket", "file_ticket", "new_ticket"),
            "delete": ("delete_ticket", "purge_ticket"),
        },
        ("ticket_id", "tid", "id"),
    ),
    Domain(
        "library", "book", "books", "title", "copies", "status", ("available", "reserved"), 1, 60,
        ("dune", "emma", "ulysses", "hamlet", "odyssey", "walden", "beloved", "rebecca", "matilda", "heidi",
         "ivanhoe", "carrie", "lolita", "persuasion"),
        "BL",
        {
            "find": ("find_book", "search_title"),
            "get": ("get_book", "book_info"),
            "list": ("list_books", "books_by_status"),
            "set": ("set_book_status", "mark_book"),
            "add": ("add_copies", "acquire"),
            "setnum": ("set_copies", "recount"),
            "create": ("add_book", "catalog_book"),
            "delete": ("withdraw_book", "remove_book"),
        },
        ("book_id", "isbn", "id"),
        ("count", "amount"),
    ),
    Domain(
        "loyalty", "member", "members", "name", "points", "tier", ("basic", "silver", "gold"), 10, 999, _PEOPLE, "MR",
        {
            "find": ("find_member", "member_by_name"),
            "get": ("get_member", "member_info"),
            "list": ("list_members", "members_by_tier"),
            "set": ("set_tier", "change_tier"),
            "add": ("award_points", "add_points"),
            "move": ("transfer_points", "gift_points"),
            "create": ("enroll", "add_member"),
            "delete": ("remove_member", "unenroll"),
        },
        ("member_id", "mid", "id"),
        ("points", "amount"),
    ),
    Domain(
        "warehouse", "bin", "bins", "label", "qty", "state", ("active", "sealed"), 5, 500,
        ("north", "south", "east", "west", "dock", "yard", "loft", "annex", "cellar", "depot", "bay", "attic",
         "shed", "vault"),
        "WB",
        {
            "find": ("find_bin", "bin_by_label"),
            "get": ("get_bin", "bin_info", "inspect_bin"),
            "list": ("list_bins", "bins_by_state"),
            "set": ("set_bin_state", "seal_state"),
            "add": ("receive", "add_qty"),
            "setnum": ("set_qty", "count_bin"),
            "move": ("move_stock", "transfer_qty"),
            "create": ("create_bin", "open_bin"),
            "delete": ("delete_bin", "retire_bin"),
        },
        ("bin_id", "bin", "id"),
        ("qty", "amount"),
    ),
)
# fmt: on

_SRC_DST = (("from_id", "to_id"), ("source", "target"), ("src", "dst"))


def _obs(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _err(msg: str) -> str:
    return _obs({"error": msg})


#: Prompt budget on the tools' JSON (characters). Qwen3's chat template renders each tool as one JSON
#: line (>= 3.25 characters per token for these schemas); ~100 tokens of template and <= 40 of
#: instruction leave ~370 tokens. Measured over all tasks of seeds 0-3: at most 494 prompt tokens.
_TOOLS_BUDGET_CHARS = 1290


def _schema_chars(tool: Mapping[str, Any]) -> int:
    return len(json.dumps(tool, ensure_ascii=False)) + 1


def _copy_state(state: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: dict(v) for k, v in state.items()}


# --------------------------------------------------------------------------------------------------
# Environments
# --------------------------------------------------------------------------------------------------


class _Infeasible(Exception):
    """A task shape cannot be instantiated in this environment (state)."""


@dataclass
class _Turn:
    user: str
    calls: list[ToolCall] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    reply: str = "Done."
    answers: list[str] = field(default_factory=list)  # tokens the reply must contain


@dataclass(frozen=True)
class _Check:
    kind: str  # "entity" | "deleted" | "created" | "unchanged" | "answer"
    text: str
    eid: str = ""
    fields: tuple[tuple[str, Any], ...] = ()
    turn: int = 0
    token: str = ""
    touched: frozenset[str] = frozenset()
    n_created: int = 0


@dataclass
class _Task:
    task_id: str
    shape: str
    turns: list[_Turn]
    checks: list[_Check]
    spec: TaskSpec


class _Env:
    """One generated environment: domain, tools (with renamings), initial state and tasks."""

    def __init__(self, pool: SyntheticPool, index: int) -> None:
        self.index = index
        self.domain = d = DOMAINS[index % len(DOMAINS)]
        self.env_id = f"syn-{d.name}-{index:02d}"
        rng = random.Random(f"{pool.seed}:{index}")
        self.rng = rng

        # -- renamings (without them: each domain's first variant) --------------------------------------
        def pick(options: Sequence[Any], canonical: Any) -> Any:
            chosen = rng.choice(options)
            return chosen if pool.renamings else canonical

        idp = pick(d.idp, d.idp[0])
        src, dst = pick((*_SRC_DST, (f"from_{d.noun}", f"to_{d.noun}")), _SRC_DST[0])
        self.roles: dict[str, dict[str, str]] = {
            "find": {"name": pick(sorted({d.namef, "name"}), d.namef)},
            "get": {"id": idp},
            "list": {"status": d.statf},
            "set": {"id": idp, "status": pick((d.statf, f"new_{d.statf}"), d.statf)},
            "add": {"id": idp, "amount": pick(d.amtp, d.amtp[0])},
            "setnum": {"id": idp, "value": pick((d.numf, "value"), d.numf)},
            "move": {"src": src, "dst": dst, "amount": pick(d.amtp, d.amtp[0])},
            "create": {"name": pick(sorted({d.namef, "name"}), d.namef), "value": pick((d.numf, "value"), d.numf)},
            "delete": {"id": idp},
        }
        self.tool_name = {op: pick(d.tools[op], d.tools[op][0]) for op in OPS if op in d.tools}

        # -- tool subset: find + get + one of set/add/setnum, then random extra ops up to a random target
        # in [3, 8] while the rendered schemas fit the prompt budget (in practice 3-6 tools fit) -------
        supported = [op for op in OPS if op in d.tools]
        core = ["find", "get", rng.choice([op for op in ("set", "add", "setnum") if op in d.tools])]
        extras = [op for op in supported if op not in core]
        rng.shuffle(extras)
        target = rng.randint(3, min(8, len(supported)))
        chosen = list(core)
        used = sum(_schema_chars(self._schema(op)) for op in core)
        for op in extras:
            if len(chosen) >= target:
                break
            size = _schema_chars(self._schema(op))
            if used + size <= _TOOLS_BUDGET_CHARS:
                chosen.append(op)
                used += size
        self.ops = [op for op in OPS if op in chosen]
        self.tool_name = {op: self.tool_name[op] for op in self.ops}
        self.tool_op = {name: op for op, name in self.tool_name.items()}
        self.tools = [self._schema(op) for op in self.ops]
        self.validators = {t["function"]["name"]: Draft202012Validator(t["function"]["parameters"]) for t in self.tools}

        # -- initial state ----------------------------------------------------------------------------
        self.prefix = rng.choice(d.letters)
        n = rng.randint(6, 9)
        ids = [f"{self.prefix}{k}" for k in sorted(rng.sample(range(10, 90), n))]
        names = rng.sample(d.names, n)
        nums = rng.sample(range(d.lo, d.hi + 1), n)
        self.initial: dict[str, dict[str, Any]] = {
            eid: {"name": names[k], "num": nums[k], "status": rng.choice(d.statuses)} for k, eid in enumerate(ids)
        }
        self.system_prompt = None  # the tools say everything; the prompt budget is for them
        self.state_summary = f"{d.plural}: " + "; ".join(
            f"{eid} {e['name']} {d.numf}={e['num']} {d.statf}={e['status']}" for eid, e in self.initial.items()
        )
        self.tasks: list[_Task] = []

    # -- tools ------------------------------------------------------------------------------------------

    def _schema(self, op: str) -> dict[str, Any]:
        d, r = self.domain, self.roles[op]
        string = {"type": "string"}
        role_schema: dict[str, dict[str, Any]] = {
            "id": string,
            "src": string,
            "dst": string,
            "name": string,
            "status": {"type": "string", "enum": list(d.statuses)},
            "amount": {"type": "integer"},
            "value": {"type": "integer"},
        }
        props = {name: role_schema[role] for role, name in r.items()}
        a = "an" if d.noun[0] in "aeiou" else "a"
        desc = {
            "find": f"Find {a} {d.noun} id by {d.namef}.",
            "get": f"Get {a} {d.noun}.",
            "list": f"List {d.noun} ids by {d.statf}.",
            "set": f"Set {a} {d.noun}'s {d.statf}.",
            "add": f"Add to {a} {d.noun}'s {d.numf}.",
            "setnum": f"Set {a} {d.noun}'s {d.numf}.",
            "move": f"Move {d.numf} between {d.plural}.",
            "create": f"Create {a} {d.noun}; returns its id.",
            "delete": f"Delete {a} {d.noun}.",
        }[op]
        params = {"type": "object", "properties": props, "required": list(props)}
        return {"type": "function", "function": {"name": self.tool_name[op], "description": desc, "parameters": params}}

    def call(self, op: str, **roles: Any) -> ToolCall:
        """A ToolCall of ``op`` with role values (``id``, ``amount``, ...) under this env's names."""
        names = self.roles[op]
        return ToolCall(self.tool_name[op], {names[role]: v for role, v in roles.items()})

    # -- execution --------------------------------------------------------------------------------------

    def record(self, eid: str, e: Mapping[str, Any]) -> dict[str, Any]:
        d = self.domain
        return {"id": eid, d.namef: e["name"], d.numf: e["num"], d.statf: e["status"]}

    def _well_formed(self, op: str, args: Mapping[str, Any]) -> bool:
        """Fast sufficient check of the arguments against the tool's schema (all keys, types, enums)."""
        d, names = self.domain, self.roles[op]
        if len(args) != len(names):
            return False
        for role, name in names.items():
            v = args.get(name)
            if role == "status":
                ok = isinstance(v, str) and v in d.statuses
            elif role in ("amount", "value"):
                ok = type(v) is int
            else:
                ok = isinstance(v, str)
            if not ok:
                return False
        return True

    def execute(self, state: dict[str, dict[str, Any]], call: ToolCall, *, validate: bool = True) -> str:
        """Run ``call`` on ``state`` (mutated in place); the observation is JSON text.

        Argument names outside the schema are rejected first; then the arguments are validated
        against the tool's JSON schema (types, enums, required): :meth:`_well_formed` accepts the
        common well-formed case quickly, anything it rejects goes to ``jsonschema``, which decides and
        words the error. Amounts must be positive and set/created numbers within the domain's range.
        ``validate=False`` is for the generator's own (trusted) calls.
        """
        d = self.domain
        op = self.tool_op.get(call.name)
        if op is None:
            return _err(f"unknown tool {call.name}")
        names = self.roles[op]
        if validate:
            extra = sorted(set(call.arguments) - set(names.values()))
            if extra:
                return _err(f"unexpected argument {extra[0]!r} for {call.name}")
            if not self._well_formed(op, call.arguments):
                errors = list(self.validators[call.name].iter_errors(call.arguments))
                if errors:
                    return _err(f"invalid arguments for {call.name}: {best_match(errors).message}")
        a = {role: call.arguments[name] for role, name in names.items()}
        if "amount" in a:
            a["amount"] = int(a["amount"])  # JSON Schema integers include 3.0
            if a["amount"] < 1:
                return _err(f"{names['amount']} must be at least 1")
        if "value" in a:
            a["value"] = int(a["value"])
            if not d.lo <= a["value"] <= d.hi:
                return _err(f"{names['value']} must be between {d.lo} and {d.hi}")
        for role in ("id", "src", "dst"):
            if role in a and a[role] not in state:
                return _err(f"unknown {d.noun} {a[role]}")
        if op == "find":
            key = a["name"].strip().casefold()
            for eid, e in state.items():
                if e["name"].casefold() == key:
                    return _obs({"id": eid})
            return _err(f"no {d.noun} with {d.namef} {a['name']}")
        if op == "get":
            return _obs(self.record(a["id"], state[a["id"]]))
        if op == "list":
            return _obs({"ids": [eid for eid, e in state.items() if e["status"] == a["status"]]})
        if op == "set":
            state[a["id"]]["status"] = a["status"]
            return _obs({"id": a["id"], d.statf: a["status"]})
        if op == "add":
            e = state[a["id"]]
            e["num"] += a["amount"]
            return _obs({"id": a["id"], d.numf: e["num"]})
        if op == "setnum":
            state[a["id"]]["num"] = a["value"]
            return _obs({"id": a["id"], d.numf: a["value"]})
        if op == "move":
            if a["src"] == a["dst"]:
                return _err(f"source and target are the same {d.noun}")
            src, dst = state[a["src"]], state[a["dst"]]
            if src["num"] < a["amount"]:
                return _err(f"insufficient {d.numf} in {a['src']}")
            src["num"] -= a["amount"]
            dst["num"] += a["amount"]
            return _obs({"from": a["src"], "to": a["dst"], "moved": a["amount"]})
        if op == "create":
            name = a["name"].strip()
            if not name or any(e["name"].casefold() == name.casefold() for e in state.values()):
                return _err(f"{d.namef} {a['name']!r} is taken" if name else f"empty {d.namef}")
            numbers = [int(k[len(self.prefix) :]) for k in state if k[len(self.prefix) :].isdigit()]
            eid = f"{self.prefix}{max(numbers, default=9) + 1}"
            while eid in state:  # pragma: no cover - defensive
                eid += "0"
            state[eid] = {"name": name, "num": a["value"], "status": d.statuses[0]}
            return _obs({"id": eid})
        if op == "delete":
            del state[a["id"]]
            return _obs({"deleted": a["id"]})
        raise AssertionError(op)  # pragma: no cover

    # -- task generation --------------------------------------------------------------------------------

    def shapes(self) -> list[str]:
        ops = set(self.ops)
        writes = ops & set(_WRITES)
        ok = {
            "act": bool(ops & {"set", "add", "setnum", "move", "create", "delete"}),
            "query": True,
            "lookup_act": bool(writes),
            "lookup_query": True,
            "copy_value": bool(ops & {"setnum", "move"}),
            "transfer_chain": "move" in ops,
            "create_verify": "create" in ops,
            "filter_update": "list" in ops and bool(writes),
            "multiturn": bool(ops & {"set", "add", "setnum"}),
        }
        return [s for s in SHAPES if ok[s]]

    def build_tasks(self, pool: SyntheticPool) -> None:
        rng = self.rng
        shapes = self.shapes()
        if pool.shapes is not None:  # keep only the pool's shapes (a query if the environment allows none)
            shapes = [s for s in shapes if s in pool.shapes] or ["query"]
        seen: set[str] = set()
        width = max(2, len(str(pool.tasks_per_env - 1)))
        for j in range(pool.tasks_per_env):
            draft: _Draft | None = None
            for k in range(len(shapes)):
                shape = shapes[(j + k) % len(shapes)]
                for _ in range(12):
                    try:
                        cand = _Draft(self, rng).build(shape)
                    except _Infeasible:
                        break
                    key = "\n".join(t.user for t in cand.turns)
                    if key not in seen:
                        seen.add(key)
                        draft = cand
                        break
                if draft is not None:
                    break
            if draft is None:  # every shape exhausted (very large tasks_per_env): repeat a query
                shape = "query"
                draft = _Draft(self, rng).build(shape)
            task_id = f"{self.env_id}/t{j:0{width}d}"
            self.tasks.append(self._finish(pool, task_id, shape, draft.turns, draft.state))

    def _finish(
        self, pool: SyntheticPool, task_id: str, shape: str, turns: list[_Turn], state: dict[str, dict[str, Any]]
    ) -> _Task:
        """The task record: checks from the diff between the initial and the gold final ``state``."""
        d = self.domain
        checks: list[_Check] = []
        touched: set[str] = set()
        for eid, e in self.initial.items():
            if eid not in state:
                checks.append(_Check("deleted", f"{d.noun} {eid} is deleted", eid=eid))
                touched.add(eid)
            elif state[eid] != e:
                f = state[eid]
                checks.append(
                    _Check(
                        "entity",
                        f"{d.noun} {eid} has {d.numf} {f['num']} and {d.statf} {f['status']}",
                        eid=eid,
                        fields=tuple(sorted(f.items())),
                    )
                )
                touched.add(eid)
        created = [eid for eid in state if eid not in self.initial]
        for eid in created:
            f = state[eid]
            checks.append(
                _Check(
                    "created",
                    f"a new {d.noun} with {d.namef} {f['name']}, {d.numf} {f['num']} and {d.statf} {f['status']} exists",
                    fields=tuple(sorted(f.items())),
                )
            )
        other = "other " if touched or created else ""
        checks.append(
            _Check(
                "unchanged",
                f"no {other}{d.noun} is changed, created or deleted",
                touched=frozenset(touched),
                n_created=len(created),
            )
        )
        for t, turn in enumerate(turns):
            for token in turn.answers:
                checks.append(_Check("answer", f"reply {t + 1} states {token}", turn=t, token=token))
        n_calls = sum(len(t.calls) for t in turns)
        spec = TaskSpec(
            pool=pool.name,
            task_id=task_id,
            env_id=self.env_id,
            category=shape,
            split=pool.split_of(task_id),
            system_prompt=self.system_prompt,
            first_user_message=turns[0].user,
            tools=self.tools,
            initial_state_summary=self.state_summary,
            verifier_text="; ".join(c.text for c in checks),
            metadata={
                "domain": d.name,
                "shape": shape,
                "n_calls": n_calls,
                "n_turns": len(turns),
                "asks_question": any(t.answers for t in turns),
                "reward": pool.reward,
            },
        )
        return _Task(task_id, shape, turns, checks, spec)


class _Draft:
    """Instantiates one task shape by executing the gold calls on a scratch copy of the state."""

    def __init__(self, env: _Env, rng: random.Random) -> None:
        self.env, self.rng, self.d = env, rng, env.domain
        self.state = _copy_state(env.initial)
        self.turns: list[_Turn] = []

    # -- helpers ----------------------------------------------------------------------------------------

    def has(self, *ops: str) -> bool:
        return all(op in self.env.ops for op in ops)

    def do(self, op: str, **roles: Any) -> dict[str, Any]:
        call = self.env.call(op, **roles)
        obs = self.env.execute(self.state, call, validate=False)
        out = json.loads(obs)
        if "error" in out:  # pragma: no cover - generator bug
            raise AssertionError(f"{self.env.env_id}: gold call {call} failed: {obs}")
        self.turns[-1].calls.append(call)
        self.turns[-1].observations.append(obs)
        return out

    def pick(self, k: int = 1) -> list[str]:
        ids = list(self.state)
        if len(ids) < k:
            raise _Infeasible
        return self.rng.sample(ids, k)

    def ref(self, eid: str) -> str:
        return f"{self.d.noun} {eid}"

    def ref_name(self, eid: str) -> str:
        return f"the {self.d.noun} with {self.d.namef} {self.state[eid]['name']}"

    def amount(self, cap: int | None = None) -> int:
        top = max(5, (self.d.hi - self.d.lo) // 4)
        if cap is not None:
            top = min(top, cap)
        if top < 1:
            raise _Infeasible
        return self.rng.randint(1, top)

    def new_value(self, current: int | None) -> int:
        while True:
            v = self.rng.randint(self.d.lo, self.d.hi)
            if v != current:
                return v

    def new_status(self, current: str) -> str:
        return self.rng.choice([s for s in self.d.statuses if s != current])

    def write(self, op: str, eid: str, x: str, *, follow_up: bool = False) -> str:
        """Execute a single-entity write on ``eid`` and return its instruction (``x``: how it is named)."""
        d, e = self.d, self.state[eid]
        if op == "set":
            s = self.new_status(e["status"])
            self.do("set", id=eid, status=s)
            return f"Now set its {d.statf} to {s}." if follow_up else f"Set the {d.statf} of {x} to {s}."
        if op == "add":
            a = self.amount()
            self.do("add", id=eid, amount=a)
            return f"Now increase its {d.numf} by {a}." if follow_up else f"Increase the {d.numf} of {x} by {a}."
        if op == "setnum":
            v = self.new_value(e["num"])
            self.do("setnum", id=eid, value=v)
            return f"Now set its {d.numf} to {v}." if follow_up else f"Set the {d.numf} of {x} to {v}."
        if op == "delete":
            self.do("delete", id=eid)
            return f"Delete {x}."
        raise AssertionError(op)  # pragma: no cover

    def ask(self, eid: str, *, follow_up: bool = False, by_name: bool = False) -> str:
        """``get`` ``eid`` and expect its number or status in the reply; returns the question."""
        d = self.d
        rec = self.do("get", id=eid)
        field_name = self.rng.choice((d.numf, d.statf))
        value = str(rec[field_name])
        self.turns[-1].answers.append(value)
        self.turns[-1].reply = f"The {field_name} of {d.noun} {eid} is {value}."
        if follow_up:
            return f"Now what is its {field_name}?"
        return f"What is the {field_name} of {self.ref_name(eid) if by_name else self.ref(eid)}?"

    def unused_name(self) -> str:
        taken = {e["name"] for e in self.state.values()}
        free = [n for n in self.d.names if n not in taken]
        if not free:
            raise _Infeasible
        return self.rng.choice(free)

    # -- shapes -----------------------------------------------------------------------------------------

    def build(self, shape: str) -> _Draft:
        self.turns = [_Turn(user="")]
        self.turns[0].user = getattr(self, f"_shape_{shape}")()
        return self

    def _shape_act(self) -> str:
        ops = [op for op in ("set", "add", "setnum", "move", "create", "delete") if self.has(op)]
        op = self.rng.choice(ops)
        d = self.d
        if op == "move":
            src, dst = self.pick(2)
            a = self.amount(cap=self.state[src]["num"])
            self.do("move", src=src, dst=dst, amount=a)
            return f"Move {a} of the {d.numf} of {self.ref(src)} to {self.ref(dst)}."
        if op == "create":
            name, v = self.unused_name(), self.new_value(None)
            self.do("create", name=name, value=v)
            return f"Create a new {d.noun} with {d.namef} {name} and {d.numf} {v}."
        (eid,) = self.pick()
        return self.write(op, eid, self.ref(eid))

    def _shape_query(self) -> str:
        (eid,) = self.pick()
        return self.ask(eid)

    def _shape_lookup_act(self) -> str:
        op = self.rng.choice([op for op in _WRITES if self.has(op)])
        (eid,) = self.pick()
        x = self.ref_name(eid)
        self.do("find", name=self.state[eid]["name"])
        return self.write(op, eid, x)

    def _shape_lookup_query(self) -> str:
        (eid,) = self.pick()
        self.do("find", name=self.state[eid]["name"])
        return self.ask(eid, by_name=True)

    def _shape_copy_value(self) -> str:
        d = self.d
        src, dst = self.pick(2)
        op = self.rng.choice([op for op in ("setnum", "move") if self.has(op)])
        v = self.do("get", id=src)[d.numf]
        if op == "setnum":
            self.do("setnum", id=dst, value=v)
            return f"Set the {d.numf} of {self.ref(dst)} to the {d.numf} of {self.ref(src)}."
        self.do("move", src=src, dst=dst, amount=v)
        return f"Move all of the {d.numf} of {self.ref(src)} to {self.ref(dst)}."

    def _shape_transfer_chain(self) -> str:
        d = self.d
        src, dst = self.pick(2)
        x, y = self.ref_name(src), self.ref_name(dst)
        a = self.amount(cap=self.state[src]["num"])
        self.do("find", name=self.state[src]["name"])
        self.do("find", name=self.state[dst]["name"])
        self.do("move", src=src, dst=dst, amount=a)
        return f"Move {a} of the {d.numf} of {x} to {y}."

    def _shape_create_verify(self) -> str:
        d = self.d
        name, v = self.unused_name(), self.new_value(None)
        eid = self.do("create", name=name, value=v)["id"]
        status = self.do("get", id=eid)[d.statf]
        turn = self.turns[-1]
        turn.answers += [eid, status]
        turn.reply = f"Created {d.noun} {eid}; its {d.statf} is {status}."
        return f"Create a new {d.noun} with {d.namef} {name} and {d.numf} {v}, then tell me its id and {d.statf}."

    def _shape_filter_update(self) -> str:
        d = self.d
        counts = {s: [eid for eid, e in self.state.items() if e["status"] == s] for s in d.statuses}
        options = [s for s, ids in counts.items() if 1 <= len(ids) <= 3]
        if not options:
            raise _Infeasible
        s = self.rng.choice(options)
        op = self.rng.choice([op for op in _WRITES if self.has(op)])
        ids = self.do("list", status=s)["ids"]
        group = f"every {s} {d.noun}"
        if op == "set":
            s2 = self.new_status(s)
            for eid in ids:
                self.do("set", id=eid, status=s2)
            return f"Set the {d.statf} of {group} to {s2}."
        if op == "add":
            a = self.amount()
            for eid in ids:
                self.do("add", id=eid, amount=a)
            return f"Increase the {d.numf} of {group} by {a}."
        if op == "setnum":
            v = self.new_value(None)
            if any(self.state[eid]["num"] == v for eid in ids):
                raise _Infeasible
            for eid in ids:
                self.do("setnum", id=eid, value=v)
            return f"Set the {d.numf} of {group} to {v}."
        for eid in ids:
            self.do("delete", id=eid)
        return f"Delete {group}."

    def _shape_multiturn(self) -> str:
        (eid,) = self.pick()
        writes = [op for op in ("set", "add", "setnum") if self.has(op)]
        first_asks = self.rng.random() < 0.4
        self.do("find", name=self.state[eid]["name"])
        first_op = "get" if first_asks else self.rng.choice(writes)
        if first_asks:
            first = self.ask(eid, by_name=True)
        else:
            first = self.write(first_op, eid, self.ref_name(eid))
        self.turns.append(_Turn(user=""))
        # a different write than turn 1's (a second ``set`` could undo the first one)
        follow = [("write", op) for op in writes if op != first_op] + ([] if first_asks else [("ask", "get")])
        if self.has("move") and len(self.state) > 1:
            follow.append(("move", "move"))
        kind, op = self.rng.choice(follow)
        if kind == "write":
            second = self.write(op, eid, "", follow_up=True)
        elif kind == "ask":
            second = self.ask(eid, follow_up=True)
        else:
            dst = self.rng.choice([k for k in self.state if k != eid])
            a = self.amount(cap=self.state[eid]["num"])
            self.do("move", src=eid, dst=dst, amount=a)
            second = f"Now move {a} of its {self.d.numf} to {self.ref(dst)}."
        self.turns[-1].user = second
        return first


# --------------------------------------------------------------------------------------------------
# Episode
# --------------------------------------------------------------------------------------------------


class SyntheticEpisode(Episode):
    """A live task: a private copy of the environment's state, the turn pointer and the replies."""

    def __init__(self, env: _Env, task: _Task, reward: str, state: dict[str, dict[str, Any]] | None = None) -> None:
        self.spec = task.spec
        self._env = env
        self._task = task
        self._reward = reward
        self.state = _copy_state(env.initial) if state is None else state
        self.replies: list[str] = []
        self._turn = 0
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    @property
    def turn(self) -> int:
        return self._turn

    @property
    def num_turns(self) -> int:
        return len(self._task.turns)

    def tools(self) -> list[dict[str, Any]]:
        return list(self._env.tools)

    def execute(self, call: ToolCall | Mapping[str, Any]) -> str:
        if self._done:
            return _err("the episode is over")
        if not isinstance(call, ToolCall):
            try:
                call = ToolCall.from_dict(call)
            except ToolCallError as exc:
                return _err(str(exc))
        return self._env.execute(self.state, call)

    def end_turn(self, assistant_text: str) -> str | None:
        if self._done:
            return None
        self.replies.append(assistant_text or "")
        self._turn += 1
        if self._turn >= len(self._task.turns):
            self._done = True
            return None
        return self._task.turns[self._turn].user

    def checks(self) -> list[tuple[str, bool]]:
        """Every verifier check in words with its outcome on the current state and replies."""
        state, initial = self.state, self._env.initial
        out = []
        for c in self._task.checks:
            if c.kind == "entity":
                ok = state.get(c.eid) == dict(c.fields)
            elif c.kind == "deleted":
                ok = c.eid not in state
            elif c.kind == "created":
                ok = any(eid not in initial and e == dict(c.fields) for eid, e in state.items())
            elif c.kind == "unchanged":
                ok = all(state.get(eid) == e for eid, e in initial.items() if eid not in c.touched) and (
                    sum(eid not in initial for eid in state) == c.n_created
                )
            else:
                reply = self.replies[c.turn] if c.turn < len(self.replies) else ""
                ok = re.search(rf"(?<!\w){re.escape(c.token)}(?!\w)", reply, re.IGNORECASE) is not None
            out.append((c.text, ok))
        return out

    def verify(self) -> Verdict:
        checks = self.checks()
        n_ok = sum(ok for _, ok in checks)
        passed = n_ok == len(checks)
        reward = (1.0 if passed else 0.0) if self._reward == "binary" else n_ok / len(checks)
        failed = [text for text, ok in checks if not ok]
        return Verdict(
            reward=float(reward),
            passed=passed,
            details={
                "task_id": self.spec.task_id,
                "checks": [{"check": text, "passed": ok} for text, ok in checks],
                "passed_checks": n_ok,
                "total_checks": len(checks),
                "error_type": None if passed else "synthetic:check_failed",
                "reason": "" if passed else "failed: " + "; ".join(failed),
            },
        )

    def fork(self) -> SyntheticEpisode:
        ep = SyntheticEpisode(self._env, self._task, self._reward, state=_copy_state(self.state))
        ep.replies = list(self.replies)
        ep._turn, ep._done = self._turn, self._done
        return ep


# --------------------------------------------------------------------------------------------------
# Pool
# --------------------------------------------------------------------------------------------------


@register_pool(POOL_NAME)
class SyntheticPool(EnvironmentPool):
    """``n_envs`` generated environments × ``tasks_per_env`` tasks (default 51 × 50), deterministic in ``seed``.

    Args:
        n_envs: number of environments (domain ``i mod 9`` for environment ``i``).
        tasks_per_env: tasks generated per environment.
        seed: generator seed (entities, tools, renamings, tasks) and split seed.
        reward: ``"binary"`` (1.0 iff every check passes) or ``"partial"`` (fraction of checks passed).
        test_fraction: share of tasks in the ``"test"`` split.
        shapes: keep only these task shapes (a subset of :data:`SHAPES`; ``None``: all). Each
            environment cycles through the kept shapes its tools allow (``act``, ``query``,
            ``lookup_act``, ``lookup_query`` and ``multiturn`` are allowed everywhere; an environment
            that allows none of the kept shapes gets ``query`` tasks). Task ids and splits do not
            depend on ``shapes``; the tasks themselves do.
        renamings: each environment draws its own tool and parameter names from its domain's variants
            (``True``, the default: environments of one domain look different, related only by their
            abstract operations) or uses the domain's first variant everywhere (``False``: the pool the
            warm-started tiny policy learns on, see ``envace.models.warmstart``).
    """

    name = POOL_NAME

    def __init__(
        self,
        n_envs: int = 51,
        tasks_per_env: int = 50,
        seed: int | str = 0,
        reward: str = "binary",
        test_fraction: float = 0.2,
        shapes: Sequence[str] | None = None,
        renamings: bool = True,
    ) -> None:
        if shapes is not None:
            if isinstance(shapes, str):
                shapes = (shapes,)
            unknown = [s for s in shapes if s not in SHAPES]
            if unknown or not shapes:
                raise ValueError(f"shapes must be a non-empty subset of {SHAPES}, got {shapes!r}")
            shapes = tuple(s for s in SHAPES if s in set(shapes))
        self.shapes: tuple[str, ...] | None = shapes
        self.renamings = bool(renamings)
        if int(n_envs) < 1 or int(tasks_per_env) < 1:
            raise ValueError(f"n_envs and tasks_per_env must be positive, got {n_envs}, {tasks_per_env}")
        if reward not in ("binary", "partial"):
            raise ValueError(f"reward must be 'binary' or 'partial', got {reward!r}")
        if not 0.0 <= test_fraction <= 1.0:
            raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
        self.n_envs, self.tasks_per_env = int(n_envs), int(tasks_per_env)
        self.seed, self.reward, self.test_fraction = seed, reward, float(test_fraction)
        self._env_ids = [f"syn-{DOMAINS[i % len(DOMAINS)].name}-{i:02d}" for i in range(self.n_envs)]
        self._env_index = {eid: i for i, eid in enumerate(self._env_ids)}
        width = max(2, len(str(self.tasks_per_env - 1)))
        self._ids = [f"{e}/t{j:0{width}d}" for e in self._env_ids for j in range(self.tasks_per_env)]
        self._split = {tid: self.split_of(tid) for tid in self._ids}
        self._envs: dict[int, _Env] = {}
        self._lock = threading.Lock()

    # -- construction -----------------------------------------------------------------------------------

    def split_of(self, task_id: str) -> str:
        h = int.from_bytes(hashlib.sha256(f"{self.seed}:{task_id}".encode()).digest()[:8], "big") / 2**64
        return "test" if h < self.test_fraction else "train"

    def _env(self, index: int) -> _Env:
        env = self._envs.get(index)
        if env is None:
            with self._lock:
                env = self._envs.get(index)
                if env is None:
                    env = _Env(self, index)
                    env.build_tasks(self)
                    self._envs[index] = env
        return env

    def _lookup(self, task_id: str) -> tuple[_Env, _Task]:
        env_id, _, rest = task_id.partition("/t")
        index = self._env_index.get(env_id)
        if index is None or not rest.isdigit() or int(rest) >= self.tasks_per_env or task_id not in self._split:
            raise KeyError(f"unknown {self.name} task {task_id!r}")
        env = self._env(index)
        return env, env.tasks[int(rest)]

    # -- protocol ---------------------------------------------------------------------------------------

    def task_ids(self, split: str | None = None) -> list[str]:
        if split in (None, "all"):
            return list(self._ids)
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; use 'train', 'test' or None")
        return [t for t in self._ids if self._split[t] == split]

    def task(self, task_id: str) -> TaskSpec:
        return self._lookup(task_id)[1].spec

    def start(self, task_id: str, reward: str | None = None) -> SyntheticEpisode:
        """A fresh episode; ``reward`` overrides the pool's reward variant for this episode."""
        if reward not in (None, "binary", "partial"):
            raise ValueError(f"reward must be 'binary' or 'partial', got {reward!r}")
        env, task = self._lookup(task_id)
        return SyntheticEpisode(env, task, reward or self.reward)

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        _, task = self._lookup(task_id)
        return [[ToolCall(c.name, dict(c.arguments)) for c in t.calls] for t in task.turns]

    def replay(
        self, task_id: str, actions: Sequence[Sequence[ToolCall]], replies: Sequence[str] | None = None
    ) -> Verdict:
        """Execute ``actions`` (one list per user turn), end each turn with a reply and verify.

        ``replies[t]`` is the reply that ends turn ``t``; by default (and for turns ``replies`` does
        not cover) it is the turn's observations joined by newlines, so answer checks pass iff the
        turn's calls retrieved the asked value. Turns beyond the task's are ignored.
        """
        ep = self.start(task_id)
        for t, turn in enumerate(actions):
            observations = [ep.execute(call) for call in turn]
            reply = replies[t] if replies is not None and t < len(replies) else "\n".join(observations)
            if ep.end_turn(reply) is None:
                break
        return ep.verify()

    # -- extras -----------------------------------------------------------------------------------------

    def environments(self) -> list[str]:
        """The environment ids, in order."""
        return list(self._env_ids)

    def env_tools(self, env_id: str) -> list[dict[str, Any]]:
        """The tool schemas of an environment."""
        return list(self._env(self._env_index[env_id]).tools)

    def user_messages(self, task_id: str) -> list[str]:
        """The task's user messages, one per turn."""
        return [t.user for t in self._lookup(task_id)[1].turns]

    def gold_replies(self, task_id: str) -> list[str]:
        """The gold assistant reply closing each turn (``"Done."`` unless the turn asks a question)."""
        return [t.reply for t in self._lookup(task_id)[1].turns]

    def gold_observations(self, task_id: str) -> list[list[str]]:
        """The observation of every gold call, one list per turn."""
        return [list(t.observations) for t in self._lookup(task_id)[1].turns]

    def gold_trajectory(self, task_id: str) -> list[dict[str, Any]]:
        """The full gold chat: user messages, assistant tool calls, tool observations and replies (OpenAI form)."""
        _, task = self._lookup(task_id)
        msgs = task.spec.initial_messages()
        for t, turn in enumerate(task.turns):
            if t:
                msgs.append({"role": "user", "content": turn.user})
            for call, obs in zip(turn.calls, turn.observations, strict=True):
                msgs.append(
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"type": "function", "function": {"name": call.name, "arguments": dict(call.arguments)}}
                        ],
                    }
                )
                msgs.append({"role": "tool", "content": obs})
            msgs.append({"role": "assistant", "content": turn.reply})
        return msgs


# --------------------------------------------------------------------------------------------------
# EnvSched export
# --------------------------------------------------------------------------------------------------


def export_envsched_jsonl(pool: EnvironmentPool, path: str | Path, split: str | None = None) -> int:
    """Write the tasks of ``pool`` (any pool, optionally one split) as EnvSched JSONL; returns the task count.

    Records come from :func:`envace.envs.records.task_records` (``task_id`` is ``"<pool>/<task id>"``). Each
    environment's tools and shared metadata are written once, in an environment record before its first
    task (``envsched.write_pool_jsonl``); task lines keep their own fields. ``envsched.TaskPool.from_jsonl(path)``
    loads the file (and still loads files of the older one-self-contained-line-per-task layout).
    """
    from envace.envs.records import task_records
    from envsched import write_pool_jsonl

    records = task_records({pool.name: pool}, [(pool.name, tid) for tid in pool.task_ids(split)])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_pool_jsonl(records, path)
