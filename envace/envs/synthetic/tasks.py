"""Task drafting: one task shape instantiated by executing its gold calls on a scratch copy of an environment's
state, and the task records (turns, checks) it produces."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from envace.envs.base import TaskSpec, ToolCall
from envace.envs.synthetic.domains import WRITES, copy_state

if TYPE_CHECKING:
    from envace.envs.synthetic.world import Env


class Infeasible(Exception):
    """A task shape cannot be instantiated in this environment (state)."""


@dataclass
class Turn:
    user: str
    calls: list[ToolCall] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    reply: str = "Done."
    answers: list[str] = field(default_factory=list)  # tokens the reply must contain


@dataclass(frozen=True)
class Check:
    kind: str  # "entity" | "deleted" | "created" | "unchanged" | "answer"
    text: str
    eid: str = ""
    fields: tuple[tuple[str, Any], ...] = ()
    turn: int = 0
    token: str = ""
    touched: frozenset[str] = frozenset()
    n_created: int = 0


@dataclass
class Task:
    task_id: str
    shape: str
    turns: list[Turn]
    checks: list[Check]
    spec: TaskSpec


class Draft:
    """Instantiates one task shape by executing the gold calls on a scratch copy of the state."""

    def __init__(self, env: Env, rng: random.Random) -> None:
        self.env, self.rng, self.d = env, rng, env.domain
        self.state = copy_state(env.initial)
        self.turns: list[Turn] = []

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
            raise Infeasible
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
            raise Infeasible
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
            raise Infeasible
        return self.rng.choice(free)

    # -- shapes -----------------------------------------------------------------------------------------

    def build(self, shape: str) -> Draft:
        self.turns = [Turn(user="")]
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
        op = self.rng.choice([op for op in WRITES if self.has(op)])
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
            raise Infeasible
        s = self.rng.choice(options)
        op = self.rng.choice([op for op in WRITES if self.has(op)])
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
                raise Infeasible
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
        self.turns.append(Turn(user=""))
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
