"""The mid-episode tool announcement of token-level rollouts (envace/agents/token_policy.py ``announce_tools``) is the
versioned file envace/prompts/tools_added_<version>.txt (``envace.agent.tools_added_version``); v1 renders exactly the
text the module built inline before the file existed."""

from __future__ import annotations

import json

import pytest

from envace.agents.token_policy import announce_tools

TOOLS = [
    {"type": "function", "function": {"name": "cp", "description": "copy a file (ünïcode, $HOME, {braces})",
                                      "parameters": {"type": "object", "properties": {"src": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "mv", "parameters": {"type": "object", "properties": {}}}},
]


def old_announce_tools(tools):
    """The function body before the file existed (git show 1d964f0:envace/agents/token_policy.py)."""
    body = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return f"You can now also call these functions (signatures within <tools></tools> XML tags):\n<tools>\n{body}\n</tools>"


@pytest.mark.parametrize("tools", [TOOLS, TOOLS[:1], []])
def test_v1_renders_byte_for_byte_what_the_inline_text_did(tools):
    assert announce_tools(tools).encode("utf-8") == old_announce_tools(tools).encode("utf-8")
    assert announce_tools(tools, "v1") == announce_tools(tools)


def test_an_unknown_version_names_the_file():
    with pytest.raises(ValueError, match=r"tools_added_v9\.txt.*versions: \['v1'\]"):
        announce_tools(TOOLS, "v9")
