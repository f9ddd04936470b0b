"""What the turn engine reports: why a rollout stopped (:class:`StopReason`) and what answered one tool call
(:class:`ObservationKind`).

Both are string enums: a member *is* its value (``StopReason.COMPLETED == "completed"``, ``f"{reason}"`` and
``json.dumps`` give ``completed``), so the metric names ``envace/stop_reason/<value>``, the rollout contract's
``stop_reason`` wire key (:mod:`envace.agents.contract`), evaluation records and rollout dumps carry the same text
they always did. A string that comes back from outside (a row's ``extra_fields``, a ``results.jsonl`` line) becomes a
member again through :meth:`StopReason.parse`.

The engine (:mod:`envace.agents.engine`) re-exports both; the observation sources (:mod:`envace.agents.sources`,
:mod:`envace.agents.worldbook`) produce the kinds.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["ObservationKind", "StopReason"]


class ObservationKind(enum.StrEnum):
    """What answered one tool call (``Observation.kind``)."""

    RESULT = "result"  # the call's answer
    TOOL_ERROR = "tool_error"  # the answer is an error the tool reports (the agent's mistake, e.g. a wrong argument)
    ENV_ERROR = "env_error"  # the environment raised while executing the call (counted in ``env_errors``)
    BOUND_EXCEEDED = "bound_exceeded"  # the call passed a tool bound (time, memory) or crashed in its dry run
    TIMEOUT = "timeout"  # the environment did not answer in time: the rollout is masked
    ENV_UNAVAILABLE = "env_unavailable"  # the environment could not answer (server down): masked
    ENV_FAULT = "env_fault"  # the environment answered against its protocol (the server's fault): masked
    MALFORMED_CALL = "malformed_call"  # the parser rejected the call block
    SKIPPED = "skipped"  # the call was over ``limits.max_calls_per_message``
    MALFORMED_REHEARSAL = "malformed_rehearsal"  # the policy's rehearsed response broke the rehearsal format
    SIMULATOR_GAP = "simulator_gap"  # the Trace2Env simulator has no answer for the call


class StopReason(enum.StrEnum):
    """Why the turn engine stopped a rollout (``Transcript.stop_reason``).

    Infrastructure failures of the policy's endpoint are not stop reasons: they raise, so the caller can retry the
    rollout instead of scoring it. An environment failure that masks the rollout stops it under the observation's
    kind (``timeout``, ``env_unavailable``, ``env_fault``)."""

    COMPLETED = "completed"  # the episode handed out no further user message
    EPISODE_DONE = "episode_done"  # ``episode.done`` became true
    MAX_USER_TURNS = "max_user_turns"  # ``limits.max_user_turns`` reached
    MAX_STEPS_PER_TURN = "max_steps_per_turn"  # the per-turn step limit, with ``on_step_limit=end_episode``
    TOKEN_BUDGET = "token_budget"  # the policy's token budget is spent
    MALFORMED_CALL = "malformed_call"  # a malformed call, with ``on_malformed_call=end``
    MALFORMED_REHEARSAL = "malformed_rehearsal"  # a malformed rehearsal, with ``on_malformed_rehearsal=end``
    MODEL_ERROR = "model_error"  # the endpoint rejected a request the model caused (e.g. context too long)
    TIMEOUT = "timeout"  # the environment did not answer in time (masked)
    ENV_UNAVAILABLE = "env_unavailable"  # the environment could not answer (masked)
    ENV_FAULT = "env_fault"  # the environment broke its protocol (masked)
    UNKNOWN = "unknown"  # a row of one of verl's own agent loops: no envace engine ran it (the rollout contract)

    @classmethod
    def ending(cls, kind: ObservationKind) -> StopReason:
        """The stop reason of a rollout that an observation of ``kind`` ended (``Observation.terminate``).

        Raises ValueError for a kind that cannot end a rollout (a source that sets ``terminate`` on it is wrong)."""
        try:
            return cls(kind)
        except ValueError:
            raise ValueError(f"an observation of kind {str(kind)!r} cannot end a rollout") from None

    @classmethod
    def parse(cls, value: Any) -> StopReason:
        """The stop reason named by ``value`` (a member or its value, e.g. read back from JSON).

        Raises ValueError naming the accepted values for anything else."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"{value!r} is not a stop reason; stop reasons are {', '.join(repr(r.value) for r in cls)}")
