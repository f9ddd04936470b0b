"""The rehearsal prompt (envace/agents/sources.py) is the versioned file envace/prompts/rehearsal_<version>.txt, named
by ``envace.agent.rehearsal.version`` (envace/loop_config.py RehearsalPrompt); v1 renders exactly the text the
module held as a constant before the file existed."""

from __future__ import annotations

import pytest

from envace.agents.sources import RehearsalPrompt, rehearsal_messages
from envace.envs.base import ToolCall
from envace.loop_config import PROMPT_DIR, prompt_text

#: the constant ``_SYSTEM`` of envace/agents/sources.py before the prompt became a file (git show 1d964f0:...)
OLD_SYSTEM = (
    "You are the environment behind a set of tools. You receive the conversation so far and one tool call; you write "
    "exactly the response the real tool would return.\n"
    "1. Check the call. An unknown tool, or arguments that do not satisfy the tool's parameter schema, give a JSON "
    "object {\"error\": \"<what is wrong>\"}.\n"
    "2. Otherwise write the result the tool would return: consistent with its description, with the example "
    "responses, and with every earlier call in the conversation (changes made by earlier calls persist).\n"
    "Answer with the response only: one JSON value between <execution_result> and </execution_result>. No "
    "explanation, no markdown."
)

TOOLS = [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {}}}}]


def test_v1_renders_byte_for_byte_what_the_constant_did():
    msgs = rehearsal_messages(ToolCall("echo", {"x": 1}), [{"role": "user", "content": "hi"}], TOOLS)
    assert msgs[0] == {"role": "system", "content": OLD_SYSTEM}
    assert msgs[0]["content"].encode("utf-8") == OLD_SYSTEM.encode("utf-8")
    assert RehearsalPrompt().version == "v1" and RehearsalPrompt().system_prompt() == OLD_SYSTEM


def test_the_version_picks_the_file(tmp_path, monkeypatch):
    """A v2 file next to v1 is what version v2 renders; v1 is unchanged."""
    import envace.loop_config as lc

    for p in PROMPT_DIR.glob("*.txt"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    (tmp_path / "rehearsal_v2.txt").write_text("Be the tools.\n", encoding="utf-8")
    monkeypatch.setattr(lc, "PROMPT_DIR", tmp_path)
    lc.prompt_text.cache_clear()
    try:
        msgs = rehearsal_messages(ToolCall("echo", {}), [], TOOLS, cfg=RehearsalPrompt(version="v2"))
        assert msgs[0]["content"] == "Be the tools."
        assert RehearsalPrompt().system_prompt() == OLD_SYSTEM
    finally:
        lc.prompt_text.cache_clear()


def test_an_unknown_version_fails_at_construction_with_one_line_naming_the_file():
    with pytest.raises(ValueError) as exc:
        RehearsalPrompt(version="v9")
    msg = str(exc.value)
    assert "envace.agent.rehearsal.version" in msg and "rehearsal_v9.txt" in msg and "versions: ['v1']" in msg
    assert "\n" not in msg
    with pytest.raises(ValueError, match="no prompt 'nothing'"):
        prompt_text("nothing", "v1")
