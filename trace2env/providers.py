"""The model-provider interface of the construction stages (and, later, of the world-model agent).

Paper §4.1 / Appendix C.2: construction uses a model ``phi`` for evidence extraction, schema induction, rule
induction and falsification review, contracts and notes. Every such stage calls a :class:`Provider` with a
stage name, a JSON payload and a pydantic response model; the answer is validated locally. Two providers:

* :class:`ScriptedProvider` — answers keyed by stage (a fixed answer, or a queue consumed in order), so
  every stage is testable without a model; an unscripted stage raises :class:`ProviderError`.
* :class:`trace2env.llm.OpenAIProvider` — any OpenAI-compatible endpoint (``openai`` client, JSON-schema
  structured output validated locally by pydantic, bounded repair rounds, token and cost accounting).

Errors follow the project's one taxonomy, defined once in :mod:`envllm` (``envace.rewards.llm``
re-exports the same classes): :class:`InfrastructureError` (endpoint down, time-out, 429/5xx; retried, then
raised), :class:`ConfigurationError` (4xx, unknown model; raised at once) and :class:`ModelOutputError` (the
model answered but nothing validated after the repair rounds). All are :class:`ProviderError` s (the
taxonomy's base :class:`~envllm.LLMError` under its trace2env name), as is a scripted provider's
missing answer.

The response models of the stages the deterministic pipeline already consumes live here too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ValidationError

from envllm import ConfigurationError, InfrastructureError, LLMError, ModelOutputError

from .models import ActionSpec, Frozen, Invariant, RenderContract, StateField, TransitionRule

__all__ = [
    "STAGES",
    "STAGE_MODELS",
    "ConfigurationError",
    "ContractProposal",
    "InfrastructureError",
    "ModelOutputError",
    "Provider",
    "ProviderError",
    "RuleProposal",
    "SchemaProposal",
    "ScriptedProvider",
    "Stage",
]

Stage = Literal["extract_transition", "induce_schema", "induce_rules", "falsify_rules", "induce_renderers",
                "induce_notes", "world_model_step", "predict_observation", "judge_observation"]
STAGES: tuple[str, ...] = Stage.__args__  # type: ignore[attr-defined]

T = TypeVar("T", bound=BaseModel)


#: a stage the provider cannot answer (unscripted, exhausted, endpoint failure, invalid after repairs): the
#: base of the taxonomy (:class:`~envllm.LLMError`), so ``except ProviderError`` catches all of it
ProviderError = LLMError


@runtime_checkable
class Provider(Protocol):
    """``complete(stage, payload, response_model)`` → a validated ``response_model`` instance."""

    def complete(self, stage: str, payload: Mapping[str, Any], response_model: type[T]) -> T: ...


class SchemaProposal(Frozen):
    """``induce_schema``: actions and state fields to merge into the deterministic schema."""

    actions: tuple[ActionSpec, ...] = ()
    state_fields: tuple[StateField, ...] = ()


class RuleProposal(Frozen):
    """``induce_rules``: candidate rules and invariants (reviewed by replay before they become executable)."""

    rules: tuple[TransitionRule, ...] = ()
    invariants: tuple[Invariant, ...] = ()


class ContractProposal(Frozen):
    """``induce_renderers``: observation contracts."""

    contracts: tuple[RenderContract, ...] = ()


STAGE_MODELS: dict[str, type[BaseModel]] = {
    "induce_schema": SchemaProposal,
    "induce_rules": RuleProposal,
    "induce_renderers": ContractProposal,
}


class ScriptedProvider:
    """Answers keyed by stage. A value that is a list is a queue (one item per call); anything else is
    returned on every call. Items may be model instances or plain dicts (validated against the model).
    ``calls`` records ``(stage, payload)`` for assertions."""

    def __init__(self, script: Mapping[str, Any]):
        unknown = set(script) - set(STAGES)
        if unknown:
            raise ValueError(f"unknown stages in script: {sorted(unknown)}")
        self._script: dict[str, Any] = {k: (list(v) if isinstance(v, list) else v) for k, v in script.items()}
        self.calls: list[tuple[str, Mapping[str, Any]]] = []

    def complete(self, stage: str, payload: Mapping[str, Any], response_model: type[T]) -> T:
        self.calls.append((stage, payload))
        if stage not in self._script:
            raise ProviderError(f"no scripted answer for stage {stage!r}")
        item = self._script[stage]
        if isinstance(item, list):
            if not item:
                raise ProviderError(f"scripted answers for stage {stage!r} are exhausted")
            item = item.pop(0)
        if isinstance(item, response_model):
            return item
        try:
            data = item.model_dump() if isinstance(item, BaseModel) else item
            return response_model.model_validate(data)
        except ValidationError as e:
            raise ProviderError(f"stage {stage!r}: scripted answer does not fit {response_model.__name__}: {e}") from e

    def scripted(self) -> Sequence[str]:
        return sorted(self._script)
