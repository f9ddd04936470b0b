"""The one role enum (envace/roles.py): the engine, the trainer's metrics and the advantage's integer codes all use
it, and a value that names no role is refused with the accepted ones."""

from __future__ import annotations

import pytest

from envace.roles import Role


def test_every_layer_uses_the_same_enum():
    from envace.advantage import ROLE_CODES
    from envace.agents import engine

    assert engine.Role is Role
    assert ROLE_CODES == {0: "act", 1: "rehearse"} == {r.code: r.value for r in Role}


@pytest.mark.parametrize("value", [Role.REHEARSE, "rehearse", 1])
def test_a_role_parses_from_itself_its_name_or_its_code(value):
    assert Role.parse(value) is Role.REHEARSE


@pytest.mark.parametrize("value", ["Act", "ACT", 2, -1, True, None, 0.0])
def test_anything_else_is_refused_naming_the_roles(value):
    with pytest.raises(ValueError, match=r"is not a role; roles are 'act' \(code 0\), 'rehearse' \(code 1\)"):
        Role.parse(value)
