"""The rollout loop's own config sections: ``envace.agent.limits`` (:class:`LoopLimits`) and
``envace.agent.rehearsal`` (:class:`RehearsalPrompt`).

They sit below both users: the turn engine and the observation sources (``envace.agents``) run with them, and
the config schema (:mod:`envace.config`) embeds them, so the schema never reaches into ``envace.agents``.
The evaluation CLI sets the same limits from flags (``--max-user-turns`` ...).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

__all__ = ["LoopLimits", "RehearsalPrompt"]


@dataclass
class LoopLimits:
    """Limits and failure policies of one rollout: the same fields in Hydra (``envace.agent.limits``)
    and in the evaluation CLI (``--max-user-turns`` ...)."""

    # user turns one episode may run (the paper's runs: 30)
    max_user_turns: int = 30
    # assistant messages within one user turn (tool-call rounds + the final reply; BFCL's own limit is 20)
    max_steps_per_turn: int = 20
    # tool calls answered from one assistant message; further calls get an error observation
    max_calls_per_message: int = 8
    # observations longer than this many characters are truncated in the middle (0: never)
    max_observation_chars: int = 8000
    # at the per-turn step limit: end the episode, or move on to the next user turn
    on_step_limit: str = "end_episode"
    # a malformed tool call: feed the parser's error back as an observation, or end the episode
    on_malformed_call: str = "feedback"
    # a malformed rehearsal (rehearse source): feed an error observation back, or end the episode
    on_malformed_rehearsal: str = "end"
    # CPU seconds one tool call may compute (and 3x as many wall-clock seconds); a call past it is stopped,
    # has no effect, and the model reads an error observation (envace/envs/sandbox.py; 0: no bound)
    tool_timeout_s: float = 30.0
    # MiB one tool call may allocate, with the same consequence (0: no bound)
    tool_memory_mb: int = 2048

    #: allowed values of the string-valued fields
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "on_step_limit": ("end_episode", "next_turn"),
        "on_malformed_call": ("feedback", "end"),
        "on_malformed_rehearsal": ("feedback", "end"),
    }

    def __post_init__(self) -> None:
        for name in ("max_user_turns", "max_steps_per_turn", "max_calls_per_message"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"limits.{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("max_observation_chars", "tool_timeout_s", "tool_memory_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"limits.{name} must be >= 0, got {getattr(self, name)!r}")
        for name, allowed in self.CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"limits.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass
class RehearsalPrompt:
    """How the rehearsal prompt is built (``envace.agent.rehearsal``)."""

    # characters of conversation history kept (the oldest part is cut first; the system prompt never)
    max_history_chars: int = 6000
    # real example responses of the called tool shown to the rehearsal role (0: none)
    max_examples: int = 3
    # show every tool's full schema (True) or only the called tool's schema plus the other tools' names
    all_schemas: bool = False
