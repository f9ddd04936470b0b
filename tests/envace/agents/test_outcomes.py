"""Stop reasons and observation kinds (envace/agents/outcomes.py): each member is its text wherever text is written
(metric names, JSON, string templates), a string read back from outside becomes the member again or is refused with
the accepted values, and exactly the kinds that may end a rollout name a stop reason."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from envace.agents.outcomes import ObservationKind, StopReason

members = st.sampled_from([*StopReason, *ObservationKind])


@given(members)
def test_a_member_writes_as_its_value_everywhere_text_is_made(member):
    value = member.value
    assert member == value and hash(member) == hash(value)  # a dict keyed by the text finds the member
    assert str(member) == f"{member}" == value and f"envace/stop_reason/{member}" == "envace/stop_reason/" + value
    assert json.dumps({member: member}) == json.dumps({value: value})
    assert string.Template("$m").substitute(m=member) == value  # the test-time rehearsal prompts


@given(st.sampled_from(list(StopReason)))
def test_a_stop_reason_read_back_as_text_is_the_member(reason):
    assert StopReason.parse(json.loads(json.dumps(reason))) is reason
    assert StopReason.parse(reason) is reason


@given(st.one_of(st.text(max_size=20), st.integers(), st.none()).filter(lambda v: v not in set(StopReason)))
def test_anything_else_is_refused_with_the_accepted_values(value):
    with pytest.raises(ValueError, match=r"is not a stop reason; stop reasons are 'completed', 'episode_done'"):
        StopReason.parse(value)


#: the kinds a source may end a rollout with (``Observation.terminate``): environment failures that mask it, and a
#: malformed rehearsal with ``on_malformed_rehearsal=end``
ENDING = {ObservationKind.TIMEOUT, ObservationKind.ENV_UNAVAILABLE, ObservationKind.ENV_FAULT,
          ObservationKind.MALFORMED_REHEARSAL, ObservationKind.MALFORMED_CALL}


@pytest.mark.parametrize("kind", list(ObservationKind))
def test_exactly_the_ending_kinds_name_a_stop_reason(kind):
    if kind in ENDING:
        assert StopReason.ending(kind) is StopReason(kind.value)
    else:
        with pytest.raises(ValueError, match=f"an observation of kind '{kind.value}' cannot end a rollout"):
            StopReason.ending(kind)
