"""A small deterministic key-value tool environment with JSON observations, its recorded traces, and the
rules a model would propose for it (served by a ScriptedProvider keyed by stage)."""

from __future__ import annotations

import json
import random
from typing import Any

KEYS = ["a", "b", "c.d", "x y"]


class FakeKV:
    """The real environment: put/get/delete/incr/count over a dict; bad calls answer with an error."""

    def __init__(self) -> None:
        self.store: dict[str, Any] = {}

    def call(self, name: str, args: dict[str, Any]) -> str:
        k = args.get("key")
        if name == "put":
            self.store[k] = args["value"]
            return json.dumps({"ok": True, "key": k})
        if name == "get":
            return json.dumps({"key": k, "value": self.store[k]} if k in self.store else {"error": "not found", "key": k})
        if name == "delete":
            if k not in self.store:
                return json.dumps({"error": "not found", "key": k})
            del self.store[k]
            return json.dumps({"ok": True, "deleted": k})
        if name == "incr":
            v = self.store.get(k, 0)
            if not isinstance(v, int):
                return json.dumps({"error": "not an integer", "key": k})
            self.store[k] = v + 1
            return json.dumps({"key": k, "value": v + 1})
        if name == "count":
            return json.dumps({"count": len(self.store)})
        raise ValueError(name)


def random_actions(rng: random.Random, n: int) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for _ in range(n):
        name = rng.choice(["put", "put", "get", "get", "delete", "incr", "count"])
        if name == "count":
            out.append((name, {}))
        elif name == "put":
            value = rng.choice([f"v{rng.randint(0, 99)}", rng.randint(0, 9)])
            out.append((name, {"key": rng.choice(KEYS), "value": value}))
        else:
            out.append((name, {"key": rng.choice(KEYS)}))
    return out


def record(seed: int, n: int = 25, fmt: str = "events") -> dict[str, Any]:
    """One recorded episode of the fake environment, in one of the three accepted formats."""
    env, rng = FakeKV(), random.Random(seed)
    calls = [(name, args, env.call(name, args)) for name, args in random_actions(rng, n)]
    meta = {"trajectory_group": f"g{seed}"}
    if fmt == "events":
        events: list[dict[str, Any]] = [{"actor": "user", "kind": "message", "content": f"task {seed}"}]
        for name, args, obs in calls:
            events.append({"actor": "agent", "kind": "action", "content": {"name": name, "arguments": args}})
            events.append({"actor": "environment", "kind": "observation", "content": obs})
        return {"episode_id": f"ep{seed}", "events": events, "metadata": meta}
    if fmt == "messages":
        msgs: list[dict[str, Any]] = [{"role": "user", "content": f"task {seed}"}]
        for i, (name, args, obs) in enumerate(calls):
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]})
            msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": obs})
        return {"episode_id": f"ep{seed}", "messages": msgs, "metadata": meta}
    return {"episode_id": f"ep{seed}", "steps": [{"action": {"name": n_, "arguments": a}, "observation": o}
                                                 for n_, a, o in calls], "metadata": meta}


def K(name: str) -> str:
    return "{{json:action.arguments." + name + "}}"


SCHEMA = {
    "state_fields": [
        {"path": "world.store", "type": "object", "default": {}, "description": "the key-value store"},
        {"path": "world.size", "type": "integer", "default": 0, "description": "number of keys"},
    ],
}

RULES = {
    "invariants": [{"id": "size_nonnegative", "condition": {"left": {"path": "world.size"}, "op": "gte",
                                                           "right": {"literal": 0}}}],
    "rules": [
        {"id": "put_new", "action_type": "put", "priority": 1, "outcome": "success",
         "conditions": [{"left": {"path": "world.store.$key"}, "op": "not_exists"}],
         "effects": [{"op": "create", "path": "world.store.$key", "value": {"$action_arg": "value"}},
                     {"op": "increment", "path": "world.size", "value": 1}],
         "observation_template": '{"ok": true, "key": ' + K("key") + "}"},
        {"id": "put_existing", "action_type": "put", "priority": 1, "outcome": "success",
         "conditions": [{"left": {"path": "world.store.$key"}, "op": "exists"}],
         "effects": [{"op": "set", "path": "world.store.$key", "value": {"$action_arg": "value"}}],
         "observation_template": '{"ok": true, "key": ' + K("key") + "}"},
        {"id": "get_found", "action_type": "get", "priority": 1, "outcome": "success",
         "conditions": [{"left": {"path": "world.store.$key"}, "op": "exists"}],
         "observation_template": '{"key": ' + K("key") + ', "value": {{json:state_before.world.store.$key}}}'},
        {"id": "get_missing", "action_type": "get", "priority": 1, "outcome": "failure",
         "conditions": [{"left": {"path": "world.store.$key"}, "op": "not_exists"}],
         "observation_template": '{"error": "not found", "key": ' + K("key") + "}"},
        {"id": "delete_found", "action_type": "delete", "priority": 1, "outcome": "success",
         "conditions": [{"left": {"path": "world.store.$key"}, "op": "exists"}],
         "effects": [{"op": "delete", "path": "world.store.$key"}, {"op": "decrement", "path": "world.size", "value": 1}],
         "observation_template": '{"ok": true, "deleted": ' + K("key") + "}"},
        {"id": "delete_missing", "action_type": "delete", "priority": 1, "outcome": "failure",
         "conditions": [{"left": {"path": "world.store.$key"}, "op": "not_exists"}],
         "observation_template": '{"error": "not found", "key": ' + K("key") + "}"},
        {"id": "incr_existing", "action_type": "incr", "priority": 1, "outcome": "success",
         "conditions": [{"left": {"path": "world.store.$key"}, "op": "exists"}],
         "effects": [{"op": "increment", "path": "world.store.$key", "value": 1}],
         "observation_template": '{"key": ' + K("key") + ', "value": {{json:state_after.world.store.$key}}}'},
        {"id": "incr_new", "action_type": "incr", "priority": 1, "outcome": "success",
         "conditions": [{"left": {"path": "world.store.$key"}, "op": "not_exists"}],
         "effects": [{"op": "create", "path": "world.store.$key", "value": 1},
                     {"op": "increment", "path": "world.size", "value": 1}],
         "observation_template": '{"key": ' + K("key") + ', "value": 1}'},
        {"id": "count", "action_type": "count", "priority": 1, "outcome": "success",
         "observation_template": '{"count": {{json:state_before.world.size}}}'},
        # a wrong rule the replay review must falsify
        {"id": "get_wrong", "action_type": "get", "priority": 2, "outcome": "success",
         "conditions": [{"left": {"path": "world.store.$key"}, "op": "exists"}],
         "observation_template": '{"key": ' + K("key") + ', "value": null}'},
    ],
}



def script() -> dict[str, Any]:
    return {"induce_schema": SCHEMA, "induce_rules": RULES}
