"""The roles a policy output is written in (EnvACE §4.1): the one definition every layer uses.

The turn engine asks the policy for a message in a role (:mod:`envace.agents.engine`), the agent loop labels each
training output with it (:mod:`envace.agents.contract`), the trainer groups metrics by it (:mod:`envace.verl.trainer`)
and the role-wise advantage takes one baseline per (prompt, role) (:mod:`envace.advantage`). This module is the
lowest layer of ``envace`` (it imports nothing of envace), so all of them can import it.

A role has a name (its value, ``"act"`` / ``"rehearse"``: what travels in verl's ``extra_fields`` and appears in
metric names and rollout dumps) and an integer code (its position here: ``ACT`` is 0, ``REHEARSE`` 1), which the
advantage estimator accepts in place of the name.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["Role"]


class Role(str, enum.Enum):
    """Who the policy is speaking as (EnvACE §4.1)."""

    ACT = "act"  # the agent: tool calls and replies to the user
    REHEARSE = "rehearse"  # the environment: the response to one tool call

    @property
    def code(self) -> int:
        """The role's integer code: its position in the enum (``ACT`` 0, ``REHEARSE`` 1)."""
        return list(type(self)).index(self)

    @classmethod
    def parse(cls, value: Any) -> Role:
        """The role named by ``value``: a :class:`Role`, its name (``"act"``) or its integer code (``0``).

        Raises ValueError naming the accepted values for anything else (``bool`` is not a code)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for role in cls:
                if role.value == value:
                    return role
        elif isinstance(value, int) and not isinstance(value, bool):
            roles = list(cls)
            if 0 <= value < len(roles):
                return roles[value]
        accepted = ", ".join(f"{r.value!r} (code {r.code})" for r in cls)
        raise ValueError(f"{value!r} is not a role; roles are {accepted}")
