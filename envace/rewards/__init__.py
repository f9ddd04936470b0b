"""Rewards beyond the environments' own verifiers: the LLM client pool, the checklist judge, reward mixing.

* :mod:`envace.rewards.llm` - :class:`LLMPool`, async OpenAI-compatible client over several base URLs
  with a concurrency limit, timeouts, retries and strict JSON replies; the error taxonomy.
* :mod:`envace.rewards.checklist` - :class:`ChecklistJudge`, the CM2-style checklist reward (masked,
  never a silent 0, when the judge fails).
* :mod:`envace.rewards.mix` - :func:`mix_rewards`, weighted mix of reward components with masking.
* :mod:`envace.rewards.score` - :func:`score_episode`, the one scoring path of training and evaluation (verifier,
  checklist, mix) and its masking rule.
"""

from envace.rewards.checklist import (
    ChecklistItem,
    ChecklistJudge,
    ChecklistJudgeConfig,
    Checklists,
    Evidence,
    JudgeResult,
    JudgeVerdict,
    aggregate_checklist,
    default_is_tool_error,
    parse_checklists,
)
from envace.rewards.llm import (
    Completion,
    ConfigurationError,
    InfrastructureError,
    JudgeFormatError,
    LLMEndpointConfig,
    LLMError,
    LLMPool,
    ModelOutputError,
    extract_json_object,
)
from envace.rewards.mix import mix_rewards
from envace.rewards.score import Score, score_episode

__all__ = [
    "ChecklistItem",
    "ChecklistJudge",
    "ChecklistJudgeConfig",
    "Checklists",
    "Completion",
    "ConfigurationError",
    "Evidence",
    "InfrastructureError",
    "JudgeFormatError",
    "JudgeResult",
    "JudgeVerdict",
    "LLMEndpointConfig",
    "LLMError",
    "LLMPool",
    "ModelOutputError",
    "Score",
    "aggregate_checklist",
    "default_is_tool_error",
    "extract_json_object",
    "mix_rewards",
    "parse_checklists",
    "score_episode",
]
