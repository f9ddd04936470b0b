"""The applicability gate (``trace2env/applicability.py``, pure): labels of recorded evidence against the current
history, and the sanitiser."""

from __future__ import annotations

from trace2env.applicability import applicability, sanitise
from trace2env.models import ActionCall


def A(name, **args):
    return ActionCall(name=name, arguments=args)


def test_applicability_labels():
    get_a, put_a, put_b = A("get", key="a"), A("put", key="a", value=1), A("put", key="b", value=2)
    kw = {"item_context": "s0", "context": "s0"}
    lab = lambda item, act, ih, h, **k: applicability(item, '{"key": "a"}', act, item_history=ih, history=h,
                                                      **{**kw, **k}).label
    assert lab(get_a, get_a, [], []) == "supporting"
    assert lab(get_a, get_a, [put_b], []) == "supporting"  # history on other operands does not matter
    assert lab(get_a, get_a, [put_a], [put_a]) == "supporting"
    assert lab(get_a, get_a, [put_a], []) == "uncertain"  # a write on "a" only in the recorded episode
    assert lab(get_a, get_a, [A("reset")], []) == "uncertain"  # operand-free actions may touch anything
    assert lab(get_a, get_a, [], [], context="s1") == "uncertain"  # another initial state
    assert lab(get_a, get_a, [], [], context=None) == "uncertain"  # unknown initial state
    assert lab(A("get", key="zzz"), get_a, [], []) == "format_only"
    assert lab(A("get", key="zzz"), get_a, [], [], episode_names=frozenset({"zzz"})) == "uncertain"
    assert lab(A("count"), A("count"), [put_a], [put_b]) == "uncertain"  # no operands: the whole history counts
    assert sanitise('{"id": "A17", "at": "2024-05-01 10:00", "n": 12345, "h": "deadbeef01", "ok": 7}') == \
        '{"id": "<id>", "at": "<date>", "n": <num>, "h": "<hash>", "ok": 7}'
