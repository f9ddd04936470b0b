"""The LLM judge of next-observation prediction (paper §5.1; AgentWorldBench's scoring protocol).

The judge sees the context of one teacher-forced step (the recorded episode prefix, clipped), the action,
the predicted observation and the recorded (reference) observation, and scores the prediction on five
dimensions, each an integer 1–5:

* **Format** — the prediction has the structure, syntax and fields of the environment's observations;
* **Factuality** — the values it states are those of the reference (names, numbers, statuses, errors);
* **Consistency** — it agrees with what earlier turns of the episode established;
* **Realism** — the real environment could plausibly return it for this action;
* **Quality** — overall, how well it would stand in for the reference observation.

Each score ``x`` maps to ``(x - 1) / 4 * 100`` and the step's judge score is the mean of the five (0–100),
as in the reference study (``../shared/design/trace2env-reference.md`` §5). A judgement that fails — the
model never produced a valid verdict after the provider's repair rounds (:class:`ModelOutputError`), or the
endpoint failed after its retries (:class:`InfrastructureError`) — is **masked**: :meth:`LLMJudge.score`
returns ``None``, the failure is counted by kind, and the step is excluded from every judge mean (never
scored 0). A :class:`ConfigurationError` (wrong model, bad key) is raised: no judgement can ever succeed.

The judge calls its provider with stage :data:`JUDGE_STAGE` and a pydantic response model
(:class:`JudgeVerdict`); structured output, local validation and repair rounds are the provider's
(:class:`trace2env.llm.OpenAIProvider`). The rubric is versioned (:data:`JUDGE_PROMPTS`) and travels in the
payload as ``instructions``, so it is part of every cache key and of every scripted test's assertions.
Never edit a released version in place: a wording change is a new key.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from envllm import clip_middle

from .models import ActionCall, Event
from .providers import ConfigurationError, InfrastructureError, ModelOutputError, Provider, ProviderError

__all__ = [
    "DIMENSIONS",
    "JUDGE_PROMPTS",
    "JUDGE_STAGE",
    "JudgeResult",
    "JudgeVerdict",
    "LLMJudge",
    "render_history",
    "to_0_100",
]

#: the provider stage of a judgement
JUDGE_STAGE = "judge_observation"

#: the five judge dimensions, in report order
DIMENSIONS: tuple[str, ...] = ("format", "factuality", "consistency", "realism", "quality")

JUDGE_V1 = """\
You are judging a simulator of a software environment. An agent sent one action to the environment; the \
simulator predicted the observation the environment returns. You are given the episode so far (the recorded \
context), the action, the PREDICTED observation and the REFERENCE observation that the real environment \
actually returned. Score the prediction on five dimensions, each an integer from 1 (worst) to 5 (best):

- format: does the prediction have the structure of the reference (JSON vs text, the same fields and \
nesting, the same error shape)? 5 = same structure; 1 = unrelated form.
- factuality: are the values it states the reference's values (identifiers, names, numbers, statuses, \
success vs error)? 5 = every fact matches; 1 = the facts are wrong or invented.
- consistency: does it agree with what earlier turns of this episode established (objects created or \
deleted, values set, errors seen)? 5 = fully consistent; 1 = contradicts the episode.
- realism: could the real environment plausibly return it for this action in this situation? \
5 = indistinguishable from a real observation; 1 = implausible.
- quality: overall, how well would it stand in for the reference for an agent continuing the episode? \
5 = as good as the reference; 1 = useless or misleading.

Compare against the reference, not against your own expectation. Differences in key order or whitespace do \
not matter; a wrong value, a missing field, success where the reference failed (or the reverse) do. \
Reply with one JSON object: {"reasoning": "<one or two sentences>", "format": n, "factuality": n, \
"consistency": n, "realism": n, "quality": n}."""

#: versioned rubrics (never edit a released key in place)
JUDGE_PROMPTS: dict[str, str] = {"judge_v1": JUDGE_V1}


class JudgeVerdict(BaseModel):
    """The judge's reply: five integer scores in 1..5 (anything else fails validation and is repaired)."""

    model_config = ConfigDict(extra="ignore")

    reasoning: str = ""
    format: int = Field(ge=1, le=5)
    factuality: int = Field(ge=1, le=5)
    consistency: int = Field(ge=1, le=5)
    realism: int = Field(ge=1, le=5)
    quality: int = Field(ge=1, le=5)


def to_0_100(scores: Sequence[float] | np.ndarray) -> np.ndarray:
    """``(x - 1) / 4 * 100`` elementwise; raises on a score outside 1..5."""
    x = np.asarray(scores, dtype=float)
    if np.any((x < 1) | (x > 5)) or not np.all(np.isfinite(x)):
        raise ValueError(f"judge scores must lie in 1..5, got {x.tolist()}")
    return (x - 1.0) / 4.0 * 100.0


@dataclass(frozen=True)
class JudgeResult:
    """One judged step: the raw 1–5 scores, their 0–100 values and the total (their mean)."""

    raw: Mapping[str, int]
    scores: Mapping[str, float]
    total: float
    reasoning: str = ""

    @classmethod
    def from_verdict(cls, v: JudgeVerdict) -> JudgeResult:
        raw = {d: int(getattr(v, d)) for d in DIMENSIONS}
        mapped = to_0_100([raw[d] for d in DIMENSIONS])
        return cls(raw, dict(zip(DIMENSIONS, mapped.tolist(), strict=True)), float(mapped.mean()), v.reasoning)


def render_history(events: Sequence[Event], *, max_events: int = 40, max_chars: int = 1500) -> list[dict[str, Any]]:
    """The recorded episode prefix as the judge and the prompting baselines see it: the last ``max_events``
    events (``{"actor", "kind", "content"}``), each content clipped to ``max_chars``; a leading marker says
    how many earlier events were left out."""
    out: list[dict[str, Any]] = []
    skipped = max(0, len(events) - max_events)
    if skipped:
        out.append({"actor": "system", "kind": "note", "content": f"{skipped} earlier event(s) omitted"})
    for e in events[skipped:]:
        c = e.content if isinstance(e.content, str) else json.dumps(e.content, ensure_ascii=False, default=str)
        out.append({"actor": e.actor, "kind": e.kind, "content": clip_middle(c, max_chars)})
    return out


@dataclass
class LLMJudge:
    """Scores predicted observations against recorded ones (see the module docstring)."""

    provider: Provider
    prompt_version: str = "judge_v1"
    #: events of the recorded prefix shown as context
    max_history_events: int = 40
    #: characters of one observation (predicted, reference, or a context event) shown
    max_observation_chars: int = 6000
    #: judged steps, and masked failures by kind ("model_output", "infrastructure")
    judged: int = 0
    failures: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.prompt_version not in JUDGE_PROMPTS:
            raise ValueError(f"unknown judge prompt version {self.prompt_version!r}; known: {sorted(JUDGE_PROMPTS)}")

    def payload(self, *, action: ActionCall, predicted: str, reference: str, history: Sequence[Event] = (),
                environment: str = "") -> dict[str, Any]:
        """What the judge is sent for one step (exposed for tests and inspection)."""
        lim = self.max_observation_chars
        return {
            "instructions": JUDGE_PROMPTS[self.prompt_version],
            "prompt_version": self.prompt_version,
            "environment": environment,
            "context": render_history(history, max_events=self.max_history_events, max_chars=lim // 4),
            "action": action.model_dump(mode="json", exclude={"call_id"}),
            "predicted_observation": clip_middle(predicted, lim),
            "reference_observation": clip_middle(reference, lim),
        }

    def score(self, *, action: ActionCall, predicted: str, reference: str, history: Sequence[Event] = (),
              environment: str = "") -> JudgeResult | None:
        """One judgement, or ``None`` (masked and counted) when it failed; configuration errors raise."""
        payload = self.payload(action=action, predicted=predicted, reference=reference, history=history,
                               environment=environment)
        try:
            verdict = self.provider.complete(JUDGE_STAGE, payload, JudgeVerdict)
        except ConfigurationError:
            raise
        except ModelOutputError:
            self.failures["model_output"] += 1
            return None
        except InfrastructureError:
            self.failures["infrastructure"] += 1
            return None
        except ProviderError:  # e.g. a scripted provider without (or out of) answers
            self.failures["provider"] += 1
            return None
        self.judged += 1
        return JudgeResult.from_verdict(verdict)

    @property
    def failure_count(self) -> int:
        return int(sum(self.failures.values()))
