"""Engine: the eight effect ops on declared paths, path grammar, conditions, normalisation, persistence."""

from __future__ import annotations

import pytest

from trace2env.engine import (
    MISSING,
    EngineError,
    apply_effects,
    eval_condition,
    get_path,
    normalise,
    parse_path,
    render_template,
    resolve_effects,
)
from trace2env.models import Condition, Effect


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
