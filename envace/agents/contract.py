"""The rollout contract: what one verl output of an envace rollout hands the trainer.

verl carries per-output facts from the agent loop to the trainer only as ``AgentLoopOutput.extra_fields``, a plain
dict stored in TransferQueue. :class:`RolloutFields` is that dict typed: the agent loop
(:mod:`envace.agents.verl_loop`) builds one per output and writes :meth:`RolloutFields.to_extra_fields`; the trainer
(:mod:`envace.verl.trainer`) and EnvSched's trainer (:mod:`envace.verl.sched`) read rows back with
:meth:`RolloutFields.from_extra_fields`, which checks every field and names the row, the key and what is wrong when
one is missing or malformed (instead of a ``KeyError`` or a silently wrong label deep in the trainer).

The wire keys are the ones the agent loop has always written, so rollout dumps, metrics and verl's own readers
(``reward_extra_info`` for its DAPO filter and validation metrics; ``min_global_steps`` / ``max_global_steps`` for
its staleness tags) see the same dict:

=========================  ==============================  ===================================================
wire key                   field                           meaning
=========================  ==============================  ===================================================
``role``                   ``role``                        :class:`~envace.roles.Role` of the output (its name)
``trajectory_id``          ``trajectory_id``               ``{uid}_{session}``: the rollout the output belongs to
``output_index``           ``output_index``                position of the output in its rollout
``task_id``/``pool``       ``task_id``/``pool``            the task
``env_id``                 ``env_id``                      the task's environment
``observation_source``     ``observation_source``          ``real`` / ``rehearse`` / ``simulator``
``stop_reason``            ``stop_reason``                 :class:`~envace.agents.outcomes.StopReason` (its value)
``mask_reason``            ``mask_reason``                 why the rollout could not be judged ('' if it was)
``reward_extra_info``      ``reward``, ``verify_failed``,  ``{"acc": reward, "verify_failed": 0/1, **counters}``
                           ``counters``                    (the transcript's counters, outputs per role)
``fidelity``               ``fidelity``                    JSON list: one record per compared rehearsal
``verdict``                ``verdict``                     the verifier's details, JSON cut to 4000 characters
``actions``                ``actions``                     JSON list: the executed calls (EnvSched's replay)
``empty``                  ``empty``                       1.0 when the output decoded to empty text
``format_error``           ``format_error``                1.0 when the output had a malformed call/rehearsal
``num_tokens``             ``num_tokens``                  trained tokens of the output (loss-mask sum)
``*_global_steps``         ``weight_versions``             verl's weight versions of the generation (optional)
=========================  ==============================  ===================================================

A row that carries none of envace's keys (a row of one of verl's own agent loops) is a *foreign* row: it reads as an
``act`` output with no trajectory id, counters or fidelity, and valid unless its ``reward_extra_info`` says
``verify_failed`` — what the trainer has always assumed of such rows. A row that carries some of envace's keys but
not all is an error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from envace.agents.outcomes import StopReason
from envace.roles import Role

__all__ = ["GREEDY_FIELD", "RolloutFields", "RolloutFieldsError", "key_trajectory"]

#: the other direction, trainer to agent loop: a validation row carrying this field (true) is decoded greedily
#: whatever ``rollout.val_kwargs`` says (the trainer's greedy validation pass, :mod:`envace.verl.trainer`)
GREEDY_FIELD = "envace_greedy"

#: the per-output keys (every envace row has them)
OUTPUT_KEYS = ("role", "output_index", "empty", "format_error", "num_tokens")
#: the per-rollout keys (the same on every output of a rollout)
ROLLOUT_KEYS = ("task_id", "pool", "env_id", "trajectory_id", "observation_source", "stop_reason", "mask_reason",
                "reward_extra_info", "fidelity", "verdict", "actions")
#: verl's weight-version keys, copied from the rollout server's answers when it sends them
WEIGHT_VERSION_KEYS = ("min_global_steps", "max_global_steps", "global_steps")
#: keys only envace writes: a row with none of them is a foreign row (``reward_extra_info`` is verl's convention too)
ENVACE_KEYS = frozenset(OUTPUT_KEYS + ROLLOUT_KEYS) - {"reward_extra_info"}
#: what every ``fidelity`` record holds (:func:`envace.agents.sources.fidelity`)
FIDELITY_KEYS = ("exact", "key_overlap", "error_agree")
#: the longest ``verdict`` written (characters of JSON)
VERDICT_CHARS = 4000


class RolloutFieldsError(ValueError):
    """A row's ``extra_fields`` do not follow the rollout contract (a configuration error: an agent loop that is not
    envace's, or one of another version). The message names the row, the key and what is wrong."""


def key_trajectory(key: str) -> str:
    """TransferQueue key ``{uid}_{session}_{index}`` → trajectory ``{uid}_{session}``."""
    return key.rsplit("_", 1)[0]


def key_group(key: str) -> str:
    """TransferQueue key ``{uid}_{session}_{index}`` → the prompt uid: the GRPO group the row belongs to."""
    return key.rsplit("_", 2)[0]


@dataclass(frozen=True)
class RolloutFields:
    """One training output of an envace rollout, as the trainer reads it (see the module docstring's table)."""

    role: Role = Role.ACT
    trajectory_id: str | None = None  # None only on a foreign row
    output_index: int = 0
    task_id: str = ""
    pool: str = ""
    env_id: str = ""
    observation_source: str = ""
    stop_reason: StopReason = StopReason.UNKNOWN
    mask_reason: str = ""
    reward: float | None = None  # the trajectory reward (``reward_extra_info.acc``); None on a foreign row
    verify_failed: bool = False  # the rollout could not be judged: masked, left out of every baseline
    counters: dict[str, float] = field(default_factory=dict)  # the rest of ``reward_extra_info``
    fidelity: tuple[dict[str, float], ...] = ()
    verdict: str = ""
    actions: tuple[dict[str, Any], ...] | None = None  # None on a foreign row
    empty: bool = False
    format_error: bool = False
    num_tokens: int = 0
    weight_versions: dict[str, int] = field(default_factory=dict)
    foreign: bool = False  # the row carries none of envace's keys (one of verl's own agent loops)

    # -- writing ---------------------------------------------------------------------------------------------
    def to_extra_fields(self) -> dict[str, Any]:
        """The ``extra_fields`` dict of this output, with the wire keys and value types the loop has always
        written (floats for the 0/1 flags and counts, JSON text for fidelity, verdict and actions)."""
        if self.foreign:
            raise RolloutFieldsError("a foreign row (one of verl's own agent loops) has no envace extra_fields")
        return {
            "task_id": self.task_id,
            "pool": self.pool,
            "env_id": self.env_id,
            "trajectory_id": self.trajectory_id,
            "observation_source": self.observation_source,
            "stop_reason": str(self.stop_reason),
            "mask_reason": self.mask_reason,
            "reward_extra_info": self.reward_extra_info,
            "fidelity": json.dumps(list(self.fidelity)),
            "verdict": self.verdict,
            # executed calls (real outputs) with turn markers: replayable (EnvSched's identifier filter)
            "actions": json.dumps(list(self.actions or ()), ensure_ascii=True, default=str),
            **self.weight_versions,
            "role": self.role.value,
            "output_index": self.output_index,
            "empty": float(self.empty),
            "format_error": float(self.format_error),
            "num_tokens": float(self.num_tokens),
        }

    @property
    def reward_extra_info(self) -> dict[str, float]:
        """verl's ``reward_extra_info`` of the output: ``acc`` (the reward), ``verify_failed`` (0/1), the counters."""
        info = {} if self.reward is None else {"acc": self.reward}
        return {**info, "verify_failed": float(self.verify_failed), **self.counters}

    @staticmethod
    def verdict_text(details: Mapping[str, Any]) -> str:
        """The ``verdict`` of a verifier's details: JSON (non-JSON values as text), cut to :data:`VERDICT_CHARS`."""
        return json.dumps(dict(details), default=str, ensure_ascii=True)[:VERDICT_CHARS]

    # -- reading ---------------------------------------------------------------------------------------------
    @classmethod
    def from_extra_fields(cls, extra: Mapping[str, Any] | None, *, row: str = "?") -> RolloutFields:
        """The typed fields of one row's ``extra_fields`` (``row``: its TransferQueue key, named in errors).

        Raises :class:`RolloutFieldsError` when an envace row lacks a key or holds a value of the wrong type; other
        keys (verl adds some) are ignored."""
        extra = getattr(extra, "data", extra)  # TransferQueue may hand back a NonTensorData wrapper
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise RolloutFieldsError(f"row {row}: extra_fields is a {type(extra).__name__}, not a mapping")
        r = _Reader(extra, row)
        if not ENVACE_KEYS & extra.keys():
            info = r.info(required=False)
            return cls(verify_failed=bool(info.get("verify_failed", 0.0)), foreign=True)
        missing = [k for k in (*ROLLOUT_KEYS, *OUTPUT_KEYS) if k not in extra]
        if missing:
            raise RolloutFieldsError(f"row {row}: extra_fields lack {', '.join(missing)} (written by envace's agent "
                                     f"loop; present: {', '.join(sorted(map(str, extra)))})")
        info = r.info(required=True)
        return cls(
            role=r.role(),
            trajectory_id=r.text("trajectory_id"),
            output_index=r.count("output_index"),
            task_id=r.text("task_id"),
            pool=r.text("pool"),
            env_id=r.text("env_id"),
            observation_source=r.text("observation_source"),
            stop_reason=r.stop_reason(),
            mask_reason=r.text("mask_reason"),
            reward=info.pop("acc"),
            verify_failed=bool(info.pop("verify_failed")),
            counters=info,
            fidelity=tuple(r.json_list("fidelity", numbers=FIDELITY_KEYS)),
            verdict=r.text("verdict"),
            actions=tuple(r.json_list("actions")),
            empty=r.flag("empty"),
            format_error=r.flag("format_error"),
            num_tokens=r.count("num_tokens"),
            weight_versions={k: r.count(k) for k in WEIGHT_VERSION_KEYS if k in extra},
        )


class _Reader:
    """Typed reads of one row's ``extra_fields``; every failure names the row and the key."""

    def __init__(self, extra: Mapping[str, Any], row: str) -> None:
        self.extra, self.row = extra, row

    def fail(self, key: str, what: str) -> RolloutFieldsError:
        return RolloutFieldsError(f"row {self.row}: extra_fields.{key}={self.extra.get(key)!r:.200} {what}")

    def text(self, key: str) -> str:
        value = self.extra[key]
        if not isinstance(value, str):
            raise self.fail(key, "is not a string")
        return value

    def number(self, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise self.fail(key, "is not a number")
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.number(key, self.extra[key])
        if value not in (0.0, 1.0):
            raise self.fail(key, "is not 0 or 1")
        return value == 1.0

    def count(self, key: str) -> int:
        value = self.number(key, self.extra[key])
        if value < 0 or not value.is_integer():
            raise self.fail(key, "is not a non-negative whole number")
        return int(value)

    def role(self) -> Role:
        try:
            return Role.parse(self.extra["role"])
        except ValueError as exc:
            raise RolloutFieldsError(f"row {self.row}: extra_fields.role: {exc}") from None

    def stop_reason(self) -> StopReason:
        text = self.text("stop_reason")
        try:
            return StopReason.parse(text)
        except ValueError as exc:
            raise RolloutFieldsError(f"row {self.row}: extra_fields.stop_reason: {exc}") from None

    def info(self, *, required: bool) -> dict[str, float]:
        info = self.extra.get("reward_extra_info")
        if info is None and not required:
            return {}
        info = getattr(info, "data", info)
        if not isinstance(info, Mapping):
            raise self.fail("reward_extra_info", "is not a mapping")
        if required:
            missing = [k for k in ("acc", "verify_failed") if k not in info]
            if missing:
                raise self.fail("reward_extra_info", f"lacks {', '.join(missing)}")
        out = {}
        for k, v in info.items():
            if not isinstance(k, str):
                raise self.fail("reward_extra_info", f"has a non-string key {k!r}")
            if k == "acc" and isinstance(v, float) and math.isnan(v):
                out[k] = v  # a reward that could not be computed is NaN on a masked row
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                if required:
                    raise self.fail("reward_extra_info", f"holds {k}={v!r:.80}, not a number")
                continue  # verl's own loops may keep other values there; envace reads only verify_failed
            out[k] = float(v)
        if required and out["verify_failed"] not in (0.0, 1.0):
            raise self.fail("reward_extra_info", "holds verify_failed not 0 or 1")
        return out

    def json_list(self, key: str, numbers: tuple[str, ...] | None = None) -> list[Any]:
        """A JSON list of objects; with ``numbers``, objects of numbers that hold at least those keys."""
        try:
            value = json.loads(self.text(key))
        except json.JSONDecodeError as exc:
            raise self.fail(key, f"is not JSON ({exc.msg} at character {exc.pos})") from None
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise self.fail(key, "is not a JSON list of objects")
        if numbers is not None:
            for rec in value:
                if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in rec.values()):
                    raise self.fail(key, "holds a record whose values are not all numbers")
                if missing := [k for k in numbers if k not in rec]:
                    raise self.fail(key, f"holds a record without {', '.join(missing)}")
        return value
