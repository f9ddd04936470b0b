"""The one role enum (envace/roles.py): the engine, the rollout contract, the trainer's labels and the advantage
estimator all carry it, the wire format (its name in verl's ``extra_fields``) is converted in the contract and the
estimator's other accepted forms in one function, and a value that names no role is refused with the accepted ones."""

from __future__ import annotations

import numpy as np
import pytest

from envace.roles import Role


def test_every_layer_uses_the_same_enum():
    from envace.agents import engine

    assert engine.Role is Role
    assert {r.code: r.value for r in Role} == {0: "act", 1: "rehearse"}


def test_the_role_travels_as_one_type_from_the_agent_loop_to_the_estimator():
    from envace.advantage import _canonical_roles
    from envace.agents.contract import RolloutFields
    from envace.verl.trainer import batch_labels, read_rows

    keys = ["u_0_0", "u_0_1"]
    wire = [RolloutFields(role=role, trajectory_id="u_0", reward=1.0).to_extra_fields()
            for role in (Role.ACT, Role.REHEARSE)]
    assert [w["role"] for w in wire] == ["act", "rehearse"]  # the wire format: the role's name
    labels = batch_labels(keys, read_rows(keys, wire))
    assert list(labels["roles"]) == [Role.ACT, Role.REHEARSE]
    assert all(type(r) is Role for r in labels["roles"])
    # the estimator's one conversion: roles pass as they are; names and codes (any integer type) become roles
    assert list(_canonical_roles(labels["roles"])) == [Role.ACT, Role.REHEARSE]
    converted = _canonical_roles(np.array(["act", 1, np.int64(0), Role.REHEARSE], dtype=object))
    assert list(converted) == [Role.ACT, Role.REHEARSE, Role.ACT, Role.REHEARSE]
    assert all(type(r) is Role for r in converted)
    # a label that names no role (here a bool, which is no code) is a group of its own, not a role
    assert list(_canonical_roles(np.array(["x", True, 2], dtype=object))) == ["x", True, 2]


@pytest.mark.parametrize("value", [Role.REHEARSE, "rehearse", 1])
def test_a_role_parses_from_itself_its_name_or_its_code(value):
    assert Role.parse(value) is Role.REHEARSE


@pytest.mark.parametrize("value", ["Act", "ACT", 2, -1, True, None, 0.0])
def test_anything_else_is_refused_naming_the_roles(value):
    with pytest.raises(ValueError, match=r"is not a role; roles are 'act' \(code 0\), 'rehearse' \(code 1\)"):
        Role.parse(value)
