"""Shared by the Trace2Env tests: the KV environment's helpers (``t2e_kvenv.py``) on ``sys.path``, and two worldbooks
built from its traces (module-scoped: each built once per test module that asks for it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from trace2env import ScriptedProvider, build_worldbook, load_worldbook, make_split_manifest, parse_trace

sys.path.insert(0, str(Path(__file__).parent))  # the KV environment's helpers, for every test module here
from t2e_kvenv import record, script


@pytest.fixture(scope="module")
def kvbook(tmp_path_factory):
    """A model-free worldbook of the KV environment; every episode starts from the empty store."""
    traces = [parse_trace({**record(s, n=30), "metadata": {"trajectory_group": f"g{s}", "initial_state_id": "empty"}})
              for s in range(12)]
    return load_worldbook(build_worldbook(traces, tmp_path_factory.mktemp("kv") / "wb"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    traces = [parse_trace(record(s, n=30, fmt=("events", "messages", "steps")[s % 3])) for s in range(24)]
    split = make_split_manifest(traces, train=0.7)
    out = tmp_path_factory.mktemp("wb") / "kv"
    provider = ScriptedProvider(script())
    build_worldbook(traces, out, provider=provider, split=split)
    assert [c[0] for c in provider.calls] == ["induce_schema", "induce_rules"]
    return load_worldbook(out), traces, split
