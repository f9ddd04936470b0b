"""The rollout loop's own config sections: ``envace.agent.limits`` (:class:`LoopLimits`), ``envace.agent.rehearsal``
(:class:`RehearsalPrompt`) and ``envace.tts`` (:class:`TTSConfig`, test-time rehearsal), and the versioned prompt
files they name (:func:`prompt_text`).

They sit below both users: the turn engine, the observation sources (``envace.agents``) and the evaluation
(``envace.eval``) run with them, and the config schema (:mod:`envace.config`) embeds them, so the schema never
reaches into either. The evaluation CLI sets the same limits and rehearsal settings from flags generated from the
fields (``--max-user-turns`` ..., ``--tts`` / ``--rehearsals`` ...): the dataclass defaults are the one source.

Every prompt the policy reads that envace writes (the rehearsal prompt in training and at test time, the note that
announces tools added mid-episode in training, the test-time rehearsal's evaluation, summary and memory) is a file
``envace/prompts/<name>_<version>.txt``, read here and nowhere else; the config names the version
(``envace.agent.rehearsal.version``, ``envace.agent.tools_added_version``, ``envace.tts.prompt_version``) and runs
record it (:func:`envace.config.prompt_versions` in training, ``run.json``'s ``prompts`` in evaluation). Never edit
a released version: add ``_v2`` and make it the default.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

__all__ = ["PROMPT_DIR", "TTS_MEMORIES", "TTS_MODES", "TTS_PROMPTS", "LoopLimits", "RehearsalPrompt", "TTSConfig",
           "TTSValueError", "prompt_text"]

#: the versioned prompt files (``<name>_<version>.txt``)
PROMPT_DIR = Path(__file__).with_name("prompts")


@functools.cache
def prompt_text(name: str, version: str) -> str:
    """The text of ``envace/prompts/<name>_<version>.txt``, exactly as stored (read once per process).

    An unknown name or version raises ValueError naming the file and the versions there are."""
    path = PROMPT_DIR / f"{name}_{version}.txt"
    if not path.is_file():
        known = sorted(p.stem.removeprefix(name + "_") for p in PROMPT_DIR.glob(f"{name}_v*.txt"))
        raise ValueError(f"no prompt {name!r} version {version!r} ({path}); versions: {known}")
    return path.read_text(encoding="utf-8")


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

    # version of the rehearsal system prompt, the file envace/prompts/rehearsal_<version>.txt
    version: str = "v1"

    # characters of conversation history kept (the oldest part is cut first; the system prompt never)
    max_history_chars: int = 6000
    # real example responses of the called tool shown to the rehearsal role (0: none)
    max_examples: int = 3
    # show every tool's full schema (True) or only the called tool's schema plus the other tools' names
    all_schemas: bool = False

    def __post_init__(self) -> None:
        try:
            prompt_text("rehearsal", self.version)  # an unknown version fails here, before any rollout
        except ValueError as exc:
            raise ValueError(f"envace.agent.rehearsal.version {self.version!r} has no file: {exc}") from None

    def system_prompt(self) -> str:
        """The rehearsal role's system prompt (the file's final newline is not part of it)."""
        return prompt_text("rehearsal", self.version).removesuffix("\n")


#: test-time rehearsal modes: none (plain evaluation), parallel, sequential (EnvACE §4.3)
TTS_MODES = ("none", "parallel", "sequential")
#: what the committed execution reads as its rehearsal memory: summary (the paper's: the model's self-evaluations
#: summarised by the model, §4.3) or verbatim (the rehearsed attempts' transcripts themselves)
TTS_MEMORIES = ("summary", "verbatim")
#: the test-time rehearsal's prompt files (``tts_<name>_<version>.txt``): evaluate (one attempt → feedback),
#: summarize (all → memory), attempt (one attempt with its feedback, inside summarize and history), history
#: (sequential mode's earlier attempts), memory (the memory text the committed execution reads); with
#: ``memory: verbatim``: transcript (one attempt, no feedback), verbatim_history and verbatim_memory (history and
#: memory made of such transcripts)
TTS_PROMPTS = ("evaluate", "summarize", "attempt", "history", "memory", "transcript", "verbatim_history",
               "verbatim_memory")


class TTSValueError(ValueError):
    """A :class:`TTSConfig` value out of range: names the field, so the CLI can name the flag and Hydra the key."""

    def __init__(self, name: str, reason: str) -> None:
        self.field, self.reason = name, reason
        super().__init__(f"envace.tts.{name} {reason}")


def _flag(name: str) -> dict[str, Any]:
    return {"flag": name}


@dataclass
class TTSConfig:
    """Test-time rehearsal settings (EnvACE §4.3): ``envace.tts`` in Hydra, ``--tts ... --rehearsals N`` and the flag
    named in each field's metadata on the evaluation CLI (:func:`envace.eval.args.add_tts_arguments`).

    Sampling defaults are the paper's Table 3 settings: acting and rehearsal at temperature 1.0 / top-p 1.0,
    evaluation and summary at 0.01. ``act_*`` applies to the acting role in the rehearsals *and* in the
    committed execution (in TTS mode it replaces ``--temperature`` / ``--top-p``).
    """

    # none (plain evaluation) | parallel | sequential
    mode: str = field(default="none", metadata=_flag("--tts"))
    # rehearsal attempts N per task before the committed execution (the paper's Table 3: 2; Figure 6: 1..5)
    rehearsals: int = field(default=2, metadata=_flag("--rehearsals"))
    # OpenAI-compatible base URL of the rehearsal model M that writes tool responses (null: the policy's endpoint)
    rehearsal_base_url: str | None = field(default=None, metadata=_flag("--rehearsal-base-url"))
    # model name of M at that endpoint (null: the policy's model)
    rehearsal_model: str | None = field(default=None, metadata=_flag("--rehearsal-model"))
    # API key of M's endpoint (null: the policy's key)
    rehearsal_api_key: str | None = field(default=None, metadata=_flag("--rehearsal-api-key"))
    # acting role (rehearsal attempts and committed execution): sampling temperature
    act_temperature: float = field(default=1.0, metadata=_flag("--act-temperature"))
    # acting role: nucleus top-p
    act_top_p: float = field(default=1.0, metadata=_flag("--act-top-p"))
    # rehearsal role (imagined tool responses): sampling temperature
    rehearse_temperature: float = field(default=1.0, metadata=_flag("--rehearse-temperature"))
    # rehearsal role: nucleus top-p
    rehearse_top_p: float = field(default=1.0, metadata=_flag("--rehearse-top-p"))
    # self-evaluation of each attempt: sampling temperature
    evaluate_temperature: float = field(default=0.01, metadata=_flag("--evaluate-temperature"))
    # self-evaluation: nucleus top-p
    evaluate_top_p: float = field(default=1.0, metadata=_flag("--evaluate-top-p"))
    # summary into the rehearsal memory: sampling temperature
    summarize_temperature: float = field(default=0.01, metadata=_flag("--summarize-temperature"))
    # summary: nucleus top-p
    summarize_top_p: float = field(default=1.0, metadata=_flag("--summarize-top-p"))
    # completion-token limit of one evaluation / summary reply (null: the run's --max-tokens)
    judge_max_tokens: int | None = field(default=None, metadata=_flag("--tts-judge-max-tokens"))
    # follow-up requests after an evaluation / summary reply that does not validate (then: masked, reported)
    repair_rounds: int = field(default=1, metadata=_flag("--tts-repair-rounds"))
    # also send response_format=json_schema for evaluation / summary (vLLM guided decoding; not every server has it)
    json_schema: bool = field(default=False, metadata=_flag("--tts-json-schema"))
    # version of the prompt files envace/prompts/tts_<name>_<version>.txt
    prompt_version: str = field(default="v1", metadata=_flag("--tts-prompt-version"))
    # characters of one rendered trajectory in the evaluation / summary / history prompts (oldest part cut first)
    max_trajectory_chars: int = field(default=6000, metadata=_flag("--tts-max-trajectory-chars"))
    # characters of the task context (system prompt) shown to evaluation and summary (the end is cut)
    max_context_chars: int = field(default=4000, metadata=_flag("--tts-max-context-chars"))
    # at most this many items per memory list (facts, pitfalls, plan); longer lists are repaired
    max_memory_items: int = field(default=8, metadata=_flag("--tts-max-memory-items"))
    # the memory the committed execution reads: summary (the paper's §4.3: each attempt self-evaluated, then all
    # summarised by the model) | verbatim (the rehearsed attempts' transcripts themselves; no self-evaluation, no
    # summary, and sequential attempts see the earlier transcripts alone: for a model that cannot write a useful
    # review or summary)
    memory: str = field(default="summary", metadata=_flag("--tts-memory"))
    # verbatim memory (and sequential history): at most this many characters in all; past it each attempt's transcript
    # is cut to an equal share, from its oldest end (its last calls and final reply stay; the headers are never cut)
    max_memory_chars: int = field(default=4000, metadata=_flag("--tts-max-memory-chars"))

    #: fields that have no effect with ``memory: summary`` and that runs recorded before they existed lack: ``run.json``
    #: records them only with ``memory: verbatim`` (:meth:`recorded`), so those runs resume
    VERBATIM_ONLY: ClassVar[tuple[str, ...]] = ("memory", "max_memory_chars")

    def __post_init__(self) -> None:
        if self.mode not in TTS_MODES:
            raise TTSValueError("mode", f"must be one of {list(TTS_MODES)}, got {self.mode!r}")
        if self.memory not in TTS_MEMORIES:
            raise TTSValueError("memory", f"must be one of {list(TTS_MEMORIES)}, got {self.memory!r}")
        _tts_at_least("rehearsals", self.rehearsals, 1)
        for name in ("act", "rehearse", "evaluate", "summarize"):
            t, p = getattr(self, f"{name}_temperature"), getattr(self, f"{name}_top_p")
            if not 0.0 <= t <= 2.0:
                raise TTSValueError(f"{name}_temperature", f"must be in [0, 2], got {t}")
            if not 0.0 < p <= 1.0:
                raise TTSValueError(f"{name}_top_p", f"must be in (0, 1], got {p}")
        if self.judge_max_tokens is not None:
            _tts_at_least("judge_max_tokens", self.judge_max_tokens, 1)
        _tts_at_least("repair_rounds", self.repair_rounds, 0)
        for name in ("max_trajectory_chars", "max_context_chars", "max_memory_items", "max_memory_chars"):
            _tts_at_least(name, getattr(self, name), 1)
        for name in TTS_PROMPTS:  # an unknown version fails here, before any task runs
            try:
                prompt_text("tts_" + name, self.prompt_version)
            except ValueError as exc:
                raise TTSValueError("prompt_version", f"{self.prompt_version!r} has no file: {exc}") from None

    @classmethod
    def flags(cls) -> dict[str, str]:
        """Field name → its command-line flag (the field's metadata)."""
        return {f.name: f.metadata["flag"] for f in fields(cls)}

    def recorded(self) -> dict[str, Any]:
        """The settings as a run records them (``run.json``): every field, except :attr:`VERBATIM_ONLY` with
        ``memory: summary`` (the paper's memory, the one every run had before the option existed)."""
        out = asdict(self)
        if self.memory == "summary":
            for name in self.VERBATIM_ONLY:
                del out[name]
        return out


def _tts_at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise TTSValueError(name, f"must be >= {low}, got {value!r}")
