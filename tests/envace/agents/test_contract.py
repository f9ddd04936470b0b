"""The rollout contract (envace/agents/contract.py): what the agent loop writes into verl's ``extra_fields`` reads back
as the same typed fields, the wire dict of a rollout keeps its keys and values exactly, and a row that breaks the
contract is refused with a message naming the row, the key and the fault."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from envace.agents.contract import ENVACE_KEYS, RolloutFields, RolloutFieldsError
from envace.agents.outcomes import StopReason
from envace.roles import Role

#: one output's extra_fields exactly as envace/agents/verl_loop.py writes them (a rehearsed rollout's second output)
WIRE = {
    "task_id": "multi_turn_base_7",
    "pool": "bfcl_multi_turn",
    "env_id": "GorillaFileSystem",
    "trajectory_id": "u1_2",
    "observation_source": "rehearse",
    "stop_reason": "completed",
    "mask_reason": "",
    "reward_extra_info": {"acc": 1.0, "verify_failed": 0.0, "user_turns": 1.0, "assistant_messages": 2.0,
                          "tool_calls": 1.0, "malformed_calls": 0.0, "skipped_calls": 0.0,
                          "malformed_rehearsals": 0.0, "env_errors": 0.0, "bound_hits": 0.0,
                          "act_outputs": 2.0, "rehearse_outputs": 1.0},
    "fidelity": json.dumps([{"exact": 1.0, "key_overlap": 1.0, "error_agree": 1.0}]),
    "verdict": json.dumps({"state": "match", "calls": ["ls"]}),
    "actions": json.dumps([{"name": "ls", "arguments": {"a": "ü"}, "output": "{}"},
                           {"name": "__end_turn__", "arguments": {}}], ensure_ascii=True),
    "min_global_steps": 7, "max_global_steps": 7, "global_steps": 7,
    "role": "rehearse",
    "output_index": 1,
    "empty": 0.0,
    "format_error": 0.0,
    "num_tokens": 12.0,
}


def test_the_loops_wire_dict_reads_as_typed_fields_and_writes_back_identically():
    row = RolloutFields.from_extra_fields(WIRE, row="u1_2_1")
    assert row.role is Role.REHEARSE and row.trajectory_id == "u1_2" and row.output_index == 1
    assert row.stop_reason is StopReason.COMPLETED
    assert row.reward == 1.0 and row.verify_failed is False and row.counters["tool_calls"] == 1.0
    assert row.fidelity == ({"exact": 1.0, "key_overlap": 1.0, "error_agree": 1.0},)
    assert row.actions[0]["arguments"] == {"a": "ü"} and row.num_tokens == 12 and not row.empty
    assert row.weight_versions == {"min_global_steps": 7, "max_global_steps": 7, "global_steps": 7}
    back = row.to_extra_fields()
    assert back == WIRE and list(back) == list(WIRE)  # the same keys in the same order, the same values
    assert type(back["stop_reason"]) is str and type(back["role"]) is str  # plain text on the wire, not enums
    assert list(back["reward_extra_info"]) == list(WIRE["reward_extra_info"])


text = st.text(max_size=12)
number = st.floats(allow_nan=False, allow_infinity=False, width=32)
json_value = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | number | text,
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                          max_leaves=8)
fields = st.builds(
    RolloutFields,
    role=st.sampled_from(list(Role)),
    trajectory_id=text,
    output_index=st.integers(0, 50),
    task_id=text, pool=text, env_id=text, observation_source=text, stop_reason=st.sampled_from(list(StopReason)),
    mask_reason=text,
    reward=number,
    verify_failed=st.booleans(),
    counters=st.dictionaries(text.filter(lambda k: k not in ("acc", "verify_failed")), number, max_size=4),
    fidelity=st.lists(st.fixed_dictionaries({"exact": number, "key_overlap": number, "error_agree": number}),
                      max_size=3).map(tuple),
    verdict=text,
    actions=st.lists(st.dictionaries(text, json_value, max_size=3), max_size=3).map(tuple),
    empty=st.booleans(),
    format_error=st.booleans(),
    num_tokens=st.integers(0, 10**6),
    weight_versions=st.dictionaries(st.sampled_from(["min_global_steps", "max_global_steps", "global_steps"]),
                                    st.integers(0, 10**6)),
)


@given(fields)
def test_typed_fields_survive_the_wire(row):
    wire = row.to_extra_fields()
    assert RolloutFields.from_extra_fields(wire) == row
    assert RolloutFields.from_extra_fields(wire).to_extra_fields() == wire


@given(fields)
def test_the_wire_survives_transfer_queues_pickling(row):
    import pickle

    wire = pickle.loads(pickle.dumps(row.to_extra_fields()))
    assert RolloutFields.from_extra_fields(wire) == row


def test_a_row_of_verls_own_loops_is_an_act_output_valid_unless_its_reward_failed():
    for extra in (None, {}, {"raw_prompt": "hi", "turn_scores": []}):
        row = RolloutFields.from_extra_fields(extra)
        assert row.foreign and row.role is Role.ACT and not row.verify_failed and row.trajectory_id is None
        assert row.actions is None and row.stop_reason is StopReason.UNKNOWN
    failed = RolloutFields.from_extra_fields({"reward_extra_info": {"verify_failed": 1.0, "note": "text"}})
    assert failed.foreign and failed.verify_failed
    with pytest.raises(RolloutFieldsError, match="foreign"):
        failed.to_extra_fields()


@pytest.mark.parametrize("key", sorted(ENVACE_KEYS | {"reward_extra_info"}))
def test_a_missing_key_is_named_with_the_row(key):
    extra = {k: v for k, v in WIRE.items() if k != key}
    with pytest.raises(RolloutFieldsError, match=rf"row u9_0_3: extra_fields lack {key} "):
        RolloutFields.from_extra_fields(extra, row="u9_0_3")


@pytest.mark.parametrize(
    ("key", "value", "fault"),
    [
        ("role", "actor", r"extra_fields.role: 'actor' is not a role; roles are 'act' \(code 0\), 'rehearse'"),
        ("role", True, "is not a role"),
        ("stop_reason", "max_turns", (r"extra_fields.stop_reason: 'max_turns' is not a stop reason; stop reasons are "
                                     "'completed', 'episode_done'")),
        ("stop_reason", 3, "extra_fields.stop_reason=3 is not a string"),
        ("trajectory_id", 3, "extra_fields.trajectory_id=3 is not a string"),
        ("num_tokens", "12", "extra_fields.num_tokens='12' is not a number"),
        ("num_tokens", 2.5, "is not a non-negative whole number"),
        ("output_index", -1, "is not a non-negative whole number"),
        ("empty", 0.5, "extra_fields.empty=0.5 is not 0 or 1"),
        ("format_error", float("nan"), "is not a number"),
        ("reward_extra_info", [1.0], "is not a mapping"),
        ("reward_extra_info", {"acc": 1.0}, "lacks verify_failed"),
        ("reward_extra_info", {"acc": 1.0, "verify_failed": 2.0}, "verify_failed not 0 or 1"),
        ("reward_extra_info", {"acc": "1", "verify_failed": 0.0}, "holds acc='1', not a number"),
        ("fidelity", "[{", "extra_fields.fidelity='\\[{' is not JSON"),
        ("fidelity", '[{"exact": 1.0}]', "a record without key_overlap, error_agree"),
        ("fidelity", '[{"exact": "yes", "key_overlap": 1, "error_agree": 1}]', "values are not all numbers"),
        ("actions", '{"name": "ls"}', "is not a JSON list of objects"),
        ("min_global_steps", "7", "is not a number"),
    ],
)
def test_a_malformed_value_is_refused_with_the_row_the_key_and_the_fault(key, value, fault):
    with pytest.raises(RolloutFieldsError, match=fault) as err:
        RolloutFields.from_extra_fields({**WIRE, key: value}, row="u9_0_3")
    assert str(err.value).startswith("row u9_0_3: ")


def test_extra_fields_that_are_not_a_mapping_are_refused():
    with pytest.raises(RolloutFieldsError, match="row k: extra_fields is a list, not a mapping"):
        RolloutFields.from_extra_fields([("role", "act")], row="k")
