"""The CLI convention's helpers (trace2env/cliargs.py): exit 3 for infrastructure, strict JSON output (issue 43)."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from trace2env.cliargs import EXIT_INFRA, InfrastructureFailure, UsageError, run_cli, strict_json


def _refuse(constant: str):
    raise ValueError(f"not JSON: {constant}")


_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=3),
                       lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
                       | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(_VALUES)
def test_strict_json_is_json_with_null_for_every_non_finite_number(value):
    text = strict_json(value, indent=1)
    # the oracle: the standard library's own output (NaN, Infinity, -Infinity) read back with each of those as null
    assert json.loads(text, parse_constant=_refuse) == json.loads(json.dumps(value), parse_constant=lambda c: None)


def test_strict_json_of_a_summary_with_undefined_means():
    summary = {"steps": 0, "exact": float("nan"), "ci95": (float("nan"), float("inf")), "cost": -math.inf}
    assert strict_json(summary) == '{"steps": 0, "exact": null, "ci95": [null, null], "cost": null}'


def test_run_cli_answers_an_outage_with_exit_3_and_a_usage_mistake_with_exit_2(capsys, monkeypatch):
    def outage(argv):
        raise InfrastructureFailure("the endpoint is failing: HTTP 500\nrerun the same command to resume")

    def mistake(argv):
        raise UsageError("--out x exists")

    monkeypatch.delenv("ENVACE_DEBUG", raising=False)
    assert run_cli("prog", outage) == EXIT_INFRA == 3
    assert capsys.readouterr().err == "prog: error: the endpoint is failing: HTTP 500 rerun the same command to resume\n"
    assert run_cli("prog", mistake) == 2
    assert capsys.readouterr().err == "prog: error: --out x exists\n"
