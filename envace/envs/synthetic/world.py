"""One generated environment: its domain, tools (with renamings), initial state, tool execution and tasks."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from envace.envs.base import TaskSpec, ToolCall
from envace.envs.synthetic.domains import DOMAINS, OPS, SHAPES, SRC_DST, WRITES, dump_obs, error_obs
from envace.envs.synthetic.tasks import Check, Draft, Infeasible, Task, Turn

if TYPE_CHECKING:
    from envace.envs.synthetic.pool import SyntheticPool


#: Prompt budget on the tools' JSON (characters). Qwen3's chat template renders each tool as one JSON
#: line (>= 3.25 characters per token for these schemas); ~100 tokens of template and <= 40 of
#: instruction leave ~370 tokens (the longest prompt measured: docs/results/cpu_default.md).
_TOOLS_BUDGET_CHARS = 1290


def _schema_chars(tool: Mapping[str, Any]) -> int:
    return len(json.dumps(tool, ensure_ascii=False)) + 1


class Env:
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
        src, dst = pick((*SRC_DST, (f"from_{d.noun}", f"to_{d.noun}")), SRC_DST[0])
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
        self.tasks: list[Task] = []

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
            return error_obs(f"unknown tool {call.name}")
        names = self.roles[op]
        if validate:
            extra = sorted(set(call.arguments) - set(names.values()))
            if extra:
                return error_obs(f"unexpected argument {extra[0]!r} for {call.name}")
            if not self._well_formed(op, call.arguments):
                errors = list(self.validators[call.name].iter_errors(call.arguments))
                if errors:
                    return error_obs(f"invalid arguments for {call.name}: {best_match(errors).message}")
        a = {role: call.arguments[name] for role, name in names.items()}
        if "amount" in a:
            a["amount"] = int(a["amount"])  # JSON Schema integers include 3.0
            if a["amount"] < 1:
                return error_obs(f"{names['amount']} must be at least 1")
        if "value" in a:
            a["value"] = int(a["value"])
            if not d.lo <= a["value"] <= d.hi:
                return error_obs(f"{names['value']} must be between {d.lo} and {d.hi}")
        for role in ("id", "src", "dst"):
            if role in a and a[role] not in state:
                return error_obs(f"unknown {d.noun} {a[role]}")
        if op == "find":
            key = a["name"].strip().casefold()
            for eid, e in state.items():
                if e["name"].casefold() == key:
                    return dump_obs({"id": eid})
            return error_obs(f"no {d.noun} with {d.namef} {a['name']}")
        if op == "get":
            return dump_obs(self.record(a["id"], state[a["id"]]))
        if op == "list":
            return dump_obs({"ids": [eid for eid, e in state.items() if e["status"] == a["status"]]})
        if op == "set":
            state[a["id"]]["status"] = a["status"]
            return dump_obs({"id": a["id"], d.statf: a["status"]})
        if op == "add":
            e = state[a["id"]]
            e["num"] += a["amount"]
            return dump_obs({"id": a["id"], d.numf: e["num"]})
        if op == "setnum":
            state[a["id"]]["num"] = a["value"]
            return dump_obs({"id": a["id"], d.numf: a["value"]})
        if op == "move":
            if a["src"] == a["dst"]:
                return error_obs(f"source and target are the same {d.noun}")
            src, dst = state[a["src"]], state[a["dst"]]
            if src["num"] < a["amount"]:
                return error_obs(f"insufficient {d.numf} in {a['src']}")
            src["num"] -= a["amount"]
            dst["num"] += a["amount"]
            return dump_obs({"from": a["src"], "to": a["dst"], "moved": a["amount"]})
        if op == "create":
            name = a["name"].strip()
            if not name or any(e["name"].casefold() == name.casefold() for e in state.values()):
                return error_obs(f"{d.namef} {a['name']!r} is taken" if name else f"empty {d.namef}")
            numbers = [int(k[len(self.prefix) :]) for k in state if k[len(self.prefix) :].isdigit()]
            eid = f"{self.prefix}{max(numbers, default=9) + 1}"
            while eid in state:  # pragma: no cover - defensive
                eid += "0"
            state[eid] = {"name": name, "num": a["value"], "status": d.statuses[0]}
            return dump_obs({"id": eid})
        if op == "delete":
            del state[a["id"]]
            return dump_obs({"deleted": a["id"]})
        raise AssertionError(op)  # pragma: no cover

    # -- task generation --------------------------------------------------------------------------------

    def shapes(self) -> list[str]:
        ops = set(self.ops)
        writes = ops & set(WRITES)
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
            draft: Draft | None = None
            for k in range(len(shapes)):
                shape = shapes[(j + k) % len(shapes)]
                for _ in range(12):
                    try:
                        cand = Draft(self, rng).build(shape)
                    except Infeasible:
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
                draft = Draft(self, rng).build(shape)
            task_id = f"{self.env_id}/t{j:0{width}d}"
            self.tasks.append(self._finish(pool, task_id, shape, draft.turns, draft.state))

    def _finish(
        self, pool: SyntheticPool, task_id: str, shape: str, turns: list[Turn], state: dict[str, dict[str, Any]]
    ) -> Task:
        """The task record: checks from the diff between the initial and the gold final ``state``."""
        d = self.domain
        checks: list[Check] = []
        touched: set[str] = set()
        for eid, e in self.initial.items():
            if eid not in state:
                checks.append(Check("deleted", f"{d.noun} {eid} is deleted", eid=eid))
                touched.add(eid)
            elif state[eid] != e:
                f = state[eid]
                checks.append(
                    Check(
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
                Check(
                    "created",
                    f"a new {d.noun} with {d.namef} {f['name']}, {d.numf} {f['num']} and {d.statf} {f['status']} exists",
                    fields=tuple(sorted(f.items())),
                )
            )
        other = "other " if touched or created else ""
        checks.append(
            Check(
                "unchanged",
                f"no {other}{d.noun} is changed, created or deleted",
                touched=frozenset(touched),
                n_created=len(created),
            )
        )
        for t, turn in enumerate(turns):
            for token in turn.answers:
                checks.append(Check("answer", f"reply {t + 1} states {token}", turn=t, token=token))
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
        return Task(task_id, shape, turns, checks, spec)
