"""The rule engine (``trace2env/engine.py``): the eight effect ops on declared paths, the path grammar and its
errors, list indices, value resolution ($state, templated keys), every condition operator, templates, normalisation,
rule selection (priority, confidence, ambiguity, effects that do not apply), invariants, schema validation of effects
and argument checks of actions."""

from __future__ import annotations

import pytest

from trace2env.engine import (
    MISSING,
    EngineError,
    apply_effects,
    check_action,
    check_invariants,
    eval_condition,
    get_path,
    json_type_of,
    normalise,
    parse_path,
    render_template,
    resolve_effects,
    select_rule,
    type_matches,
    validate_effects,
)
from trace2env.models import ActionSpec, ArgumentSpec, Condition, Effect, Invariant, StateField, TransitionRule


def run(state, *effects, args=None):
    return apply_effects(state, resolve_effects([Effect(**e) for e in effects], args or {}, state))


def test_every_op_and_input_untouched():
    s0 = {"world": {"n": 1, "l": [1], "d": {"a": 1, "b": 2}, "keep": {"deep": [1, 2]}}, "session": {}}
    s = run(s0, {"op": "set", "path": "world.x", "value": {"$action_arg": "v"}},
            {"op": "create", "path": 'world["a.b"]', "value": 1},
            {"op": "increment", "path": "world.n", "value": 2}, {"op": "decrement", "path": "world.n"},
            {"op": "append", "path": "world.l", "value": 2}, {"op": "append", "path": "world.new", "value": "z"},
            {"op": "merge", "path": "world.d", "value": {"c": 3}}, {"op": "remove", "path": "world.d", "value": ["a"]},
            {"op": "delete", "path": "world.$k"}, args={"v": [7], "k": "x"})
    assert s["world"] == {"n": 2, "l": [1, 2], "d": {"b": 2, "c": 3}, "keep": {"deep": [1, 2]}, "a.b": 1, "new": ["z"]}
    assert s0["world"] == {"n": 1, "l": [1], "d": {"a": 1, "b": 2}, "keep": {"deep": [1, 2]}}  # persistent
    assert s["world"]["keep"] is s0["world"]["keep"] and s["session"] is s0["session"]  # structure shared


@pytest.mark.parametrize("eff", [
    {"op": "create", "path": "world.n", "value": 1}, {"op": "delete", "path": "world.zz"},
    {"op": "increment", "path": "world.s"}, {"op": "increment", "path": "world.n", "value": 0.5},
    {"op": "append", "path": "world.n", "value": 1}, {"op": "merge", "path": "world.n", "value": {}},
    {"op": "remove", "path": "world.d", "value": "nope"}, {"op": "delete", "path": "world"},
])
def test_bad_effects_raise(eff):
    with pytest.raises(EngineError):
        run({"world": {"n": 1, "s": "x", "d": {}}}, eff)


def test_paths_conditions_templates_and_normalisation():
    assert parse_path('world.files["/a.txt"].$k', {"k": "x.y"}) == ("world", "files", "/a.txt", "x.y")
    with pytest.raises(EngineError):
        parse_path("nowhere.x")
    st = {"world": {"n": 3, "tags": ["a"]}}
    assert get_path(st, "world.missing") is MISSING
    c = lambda **kw: Condition.model_validate(kw)
    assert eval_condition(c(left={"path": "world.n"}, op="eq", right={"literal": 3.0}), {}, st)
    assert not eval_condition(c(left={"path": "world.gone"}, op="ne", right={"literal": 1}), {}, st)  # unknown ≠ false
    assert eval_condition(c(left={"path": "world.tags"}, op="contains", right={"action_arg": "t"}), {"t": "a"}, st)
    assert eval_condition(c(any_of=[{"op": "exists", "left": {"path": "world.z"}},
                                    {"op": "gt", "left": {"path": "world.n"}, "right": {"literal": 2}}]), {}, st)
    assert normalise({"b": 1.0, "a": (2.5,)}) == {"a": [2.5], "b": 1}
    out = render_template('{"k": {{json:action.arguments.k}}, "n": {{state_after.world.n}}, "o": "{{outcome}}"}',
                          arguments={"k": "q"}, before=st, after={"world": {"n": 4}}, outcome="success")
    assert out == '{"k": "q", "n": 4, "o": "success"}'
    with pytest.raises(EngineError):
        render_template("{{state_before.world.none}}", arguments={}, before=st, after=st, outcome="x")


# -- path errors, list indices, values, condition operators, templates, rule selection, invariants, schemas -----------

def cond(**kw) -> Condition:
    return Condition.model_validate(kw)


def resolved(*effects, args=None, state=None):
    return resolve_effects([Effect(**e) for e in effects], args or {}, state or {})


@pytest.mark.parametrize("path, args, reason", [
    ("world.{{action.arguments.k", {"k": 1}, "unclosed token"),
    ("world.{{state_before.x}}", {}, "must be an action argument"),
    ("world.{{action.arguments.k}}", {}, "needs argument 'k'"),
    ("world.$k", {}, "needs argument 'k'"),
    ("world[oops]", {}, "bad bracket"),
    ("", {}, "empty path"),
    ("planet.x", {}, "must start with one of"),
])
def test_path_errors_name_the_reason(path, args, reason):
    with pytest.raises(EngineError, match=reason):
        parse_path(path, args)


def test_argument_tokens_brackets_and_list_indices():
    assert parse_path('world.{{action.arguments.k}}[2]["x y"]', {"k": "a.b"}) == ("world", "a.b", "2", "x y")
    st = {"world": {"l": [10, 20, {"z": 1}], "s": "text"}}
    assert get_path(st, "world.l[1]") == 20 and get_path(st, "world.l.-1.z") == 1
    assert get_path(st, "world.l[5]") is MISSING and get_path(st, "world.s.x") is MISSING
    assert get_path(st, ("world", "l", "0")) == 10  # a pre-parsed path
    out = apply_effects(st, resolved({"op": "set", "path": "world.l[2].z", "value": 2}, {"op": "delete", "path": "world.l[0]"}))
    assert out["world"]["l"] == [20, {"z": 2}] and st["world"]["l"] == [10, 20, {"z": 1}]
    with pytest.raises(EngineError, match="out of range"):
        apply_effects(st, resolved({"op": "set", "path": "world.l[7]", "value": 0}))
    with pytest.raises(EngineError, match="cannot descend into str"):
        apply_effects(st, resolved({"op": "set", "path": "world.s.x", "value": 0}))
    # intermediate objects are created for a missing path
    assert apply_effects({"world": {}}, resolved({"op": "set", "path": "world.a.b", "value": 1}))["world"] == {"a": {"b": 1}}


def test_values_resolve_against_arguments_and_the_pre_state():
    st = {"world": {"price": 5, "owner": "ana"}}
    args = {"k": "sku-1", "n": 3, "tags": ["x"]}
    (e,) = resolve_effects([Effect(op="set", path="world.order", value={
        "{{action.arguments.k}}": {"$action_arg": "n"}, "price": {"$state": "world.price"},
        "all": ["{{action.arguments.tags}}", "id-{{action.arguments.k}}", "n={{action.arguments.n}}", "{{json:action.arguments.k}}", 7]})], args, st)
    assert e.value == {"sku-1": 3, "price": 5, "all": [["x"], "id-sku-1", "n=3", '"sku-1"', 7]}
    for value, reason in (({"$action_arg": "zz"}, "needs argument 'zz'"), ({"$state": "world.nope"}, "unknown state"),
                          ("{{action.arguments.zz}}", "needs argument 'zz'"), ("a {{action.arguments.zz}}", "needs argument 'zz'"),
                          ("a {{outcome}}", "only action arguments")):
        with pytest.raises(EngineError, match=reason):
            resolve_effects([Effect(op="set", path="world.x", value=value)], args, st)


def test_remaining_effect_branches():
    st = {"world": {"l": ["a", "b", "a"], "n": 2, "f": 1.5, "d": {"k": 1}}}
    out = apply_effects(st, resolved({"op": "remove", "path": "world.l", "value": "a"}, {"op": "merge", "path": "world.m", "value": {"x": 1}},
                                     {"op": "increment", "path": "world.f", "value": 0.25}, {"op": "decrement", "path": "world.n", "value": 2.0}))
    assert out["world"]["l"] == ["b", "a"] and out["world"]["m"] == {"x": 1} and out["world"]["f"] == 1.75
    assert out["world"]["n"] == 0 and isinstance(out["world"]["n"], int)
    for eff, reason in (({"op": "remove", "path": "world.l", "value": "zz"}, "does not contain"),
                        ({"op": "remove", "path": "world.n", "value": "a"}, "not an object or array"),
                        ({"op": "merge", "path": "world.d", "value": [1]}, "not an object"),
                        ({"op": "increment", "path": "world.n", "value": "x"}, "not a number"),
                        ({"op": "create", "path": "world", "value": {}}, "whole namespace")):
        with pytest.raises(EngineError, match=reason):
            apply_effects(st, resolved(eff))
    bad = resolved({"op": "set", "path": "world.x", "value": 1})[0]
    object.__setattr__(bad, "op", "explode")
    with pytest.raises(EngineError, match="unknown op"):
        apply_effects(st, [bad])


def test_normalise_and_json_types():
    assert normalise({"b": (1.0, 2.5), "a": True, 3: None}) == {"3": None, "a": True, "b": [1, 2.5]}
    assert normalise(float("inf")) == float("inf") and normalise(object) is object
    assert [json_type_of(v) for v in (None, True, 1, 1.5, "s", {}, [], ())] == ["null", "boolean", "integer", "number", "string", "object", "array", "array"]
    assert json_type_of(object()) == "any"
    assert type_matches("number", 3) and type_matches("any", None) and not type_matches("integer", 3.5) and not type_matches("string", 1)


@pytest.mark.parametrize("op, left, right, expected", [
    ("eq", 3, 3.0, True), ("ne", 3, 4, True), ("ne", 3, 3, False), ("gt", 4, 3, True), ("gt", 3, 3, False),
    ("gte", 3, 3, True), ("gte", 2, 3, False), ("lt", 2, 3, True), ("lt", 3, 3, False), ("lte", 3, 3, True), ("lte", 4, 3, False),
    ("contains", "abc", "b", True), ("contains", ["a"], "b", False), ("contains", 5, 5, False),
    ("in", "b", ["a", "b"], True), ("in", "c", "ab", False), ("in", 1, 1, False),
    ("gt", "a", 1, False),  # incomparable types: false, never an exception
])
def test_every_comparison_operator(op, left, right, expected):
    assert eval_condition(cond(left={"literal": left}, op=op, right={"literal": right}), {}, {}) is expected


def test_operands_and_unknowns():
    st = {"world": {"n": 1}}
    assert eval_condition(cond(left={"path": "world.n"}, op="not_exists"), {}, st) is False
    assert eval_condition(cond(left={"path": "world.z"}, op="not_exists"), {}, st) is True
    assert eval_condition(cond(left={"path": "world.$k"}, op="exists"), {}, st) is False  # unresolvable path: unknown
    assert eval_condition(cond(left={"action_arg": "a"}, op="eq", right={"action_arg": "b"}), {"a": 1}, st) is False  # b unknown
    assert eval_condition(cond(left={"action_arg": "a"}, op="eq"), {"a": 1}, st) is False  # no right operand


def test_templates():
    before, after = {"world": {"n": 1}}, {"world": {"n": 2, "who": "ana"}}
    text = render_template("{{outcome}}: {{state_before.world.n}} -> {{state_after.world.n}} by {{state_after.world.who}} "
                           "({{json:state_after.world.who}}, {{action.arguments.k}})", arguments={"k": [1]}, before=before, after=after, outcome="success")
    assert text == 'success: 1 -> 2 by ana ("ana", [1])'
    with pytest.raises(EngineError, match="unknown template token"):
        render_template("{{weather}}", arguments={}, before=before, after=after, outcome="x")
    with pytest.raises(EngineError, match="refers to nothing"):
        render_template("{{state_after.world.gone}}", arguments={}, before=before, after=after, outcome="x")


def rule(rid, priority=0, value=1, confidence=0.9, status="supported", conditions=(), op="set", action="buy", template=None):
    return TransitionRule(id=rid, action_type=action, priority=priority, confidence=confidence, status=status, conditions=conditions,
                          effects=(Effect(op=op, path="world.x", value=value),), outcome="success", observation_template=template)


def test_rule_selection():
    st = {"world": {"x": 0}}
    high = rule("high", priority=2, value=5)
    chosen = select_rule([rule("low"), high, rule("other_action", priority=9, action="sell")], "buy", {}, st)
    assert chosen.rule == high and [e.value for e in chosen.effects] == [5] and not chosen.ambiguous
    # excluded: not supported, below the confidence threshold, a failing condition, effects that cannot apply
    out = select_rule([rule("t", status="tentative"), rule("c", confidence=0.1), rule("cond", conditions=(cond(left={"path": "world.y"}, op="exists"),)),
                       rule("apply", op="create")], "buy", {}, st, min_confidence=0.5)
    assert out.rule is None and out.reason == "no applicable rule"
    # two top-priority rules with different plans: ambiguous, both reported; the same plan twice: the lower id wins
    amb = select_rule([rule("a", value=1), rule("b", value=2)], "buy", {}, st)
    assert amb.rule is None and amb.ambiguous and set(amb.candidates) == {"a", "b"} and "disagree" in amb.reason
    amb = select_rule([rule("a", template="x"), rule("b", template="y")], "buy", {}, st)
    assert amb.ambiguous
    same = select_rule([rule("b", value=1.0), rule("a", value=1)], "buy", {}, st)
    assert same.rule.id == "a" and not same.ambiguous and set(same.candidates) == {"a", "b"}


def test_invariants():
    inv = [Invariant(id="nonneg", condition=cond(left={"path": "world.n"}, op="gte", right={"literal": 0})),
           Invariant(id="soft", condition=cond(left={"path": "world.n"}, op="gt", right={"literal": 100}), severity="warning")]
    assert check_invariants(inv, {"world": {"n": 1}}) == []
    assert check_invariants(inv, {"world": {"n": -1}}) == ["nonneg"]


def test_validate_effects_against_the_schema():
    fields = [StateField(path="world.users", type="object"), StateField(path="world.users.admin", type="object", mutable=False),
              StateField(path="world.count", type="integer"), StateField(path="world.name", type="string"),
              StateField(path="world.log", type="array"), StateField(path="world.frozen", type="string", mutable=False)]
    ok = resolved({"op": "set", "path": "world.users.bob", "value": {}}, {"op": "increment", "path": "world.count"},
                  {"op": "append", "path": "world.log", "value": 1}, {"op": "merge", "path": "world.users", "value": {}})
    assert validate_effects([e for e in ok if e.path != ("world", "users")], fields) == []
    errs = validate_effects(resolved(
        {"op": "set", "path": "world.nowhere", "value": 1}, {"op": "set", "path": "world.frozen", "value": "x"},
        {"op": "delete", "path": "world.users"}, {"op": "set", "path": "world.count", "value": "3"},
        {"op": "append", "path": "world.name", "value": "x"}, {"op": "merge", "path": "world.count", "value": {}},
        {"op": "increment", "path": "world.name"}), fields)
    assert errs == ["set world.nowhere: path not declared in the state schema", "set world.frozen: field is immutable",
                    "delete world.users: field is immutable",  # an immutable field below it
                    "set world.count: expected integer, got string", "append world.name: field is string, not array",
                    "merge world.count: field is integer, not object", "increment world.name: field is string, not a number"]


def test_check_action():
    specs = [ActionSpec(name="buy", aliases=("purchase",), arguments={"sku": ArgumentSpec(type="string", required=True),
                                                                        "qty": ArgumentSpec(type="integer"), "size": ArgumentSpec(type="string", enum=("S", "M"))})]
    assert check_action(specs, "sell", {}) == (None, ["unknown action 'sell'"])
    spec, errs = check_action(specs, "purchase", {"sku": "a", "qty": 2, "size": "M"})
    assert spec is specs[0] and errs == []
    assert check_action(specs, "buy", ["a"])[1] == ["arguments must be an object"]
    assert check_action(specs, "buy", {"qty": 1.5, "size": "XL", "color": "red"})[1] == [
        "missing required argument 'sku'", "argument 'qty': expected integer, got number", "argument 'size': 'XL' not one of ['S', 'M']",
        "unknown argument 'color'"]
