"""Providers (``trace2env/providers.py``): the scripted provider is keyed by stage and validates its answers."""

from __future__ import annotations

import pytest

from trace2env import ScriptedProvider
from trace2env.providers import ProviderError, RuleProposal


def test_scripted_provider_is_keyed_by_stage_and_validates():
    p = ScriptedProvider({"induce_rules": [{"rules": []}, {"rules": [{"bogus": 1}]}]})
    assert p.complete("induce_rules", {}, RuleProposal).rules == ()
    with pytest.raises(ProviderError, match="does not fit"):
        p.complete("induce_rules", {}, RuleProposal)
    with pytest.raises(ProviderError, match="exhausted"):
        p.complete("induce_rules", {}, RuleProposal)
    with pytest.raises(ProviderError, match="no scripted answer"):
        p.complete("induce_schema", {}, RuleProposal)
    with pytest.raises(ValueError, match="unknown stages"):
        ScriptedProvider({"nope": {}})
