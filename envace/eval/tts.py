"""Test-time rehearsal (EnvACE §4.3, §5.5, Appendix B "Algorithm 1", Appendix D prompts).

Before it touches the real environment the policy makes N *private rehearsals* of the task, each an
imagined trajectory in which the tool responses are written by a rehearsal model (the policy itself in its
REHEARSE role, or another endpoint: the paper's "Base" rows), then *evaluates* each attempt (an assessment
plus a revision suggestion), *summarises* attempts and evaluations into a compact rehearsal memory
``m_x``, and finally makes one *committed execution* in the real environment conditioned on ``m_x``.
Only that execution is scored, by the benchmark's official verifier.

``parallel``  the N attempts start independently from the same context (and run concurrently); their
              feedback is kept for the summary but not shown to the other attempts.
``sequential`` attempt n sees attempts 1..n-1 with their assessments and revision suggestions
              (``history`` template appended to the system prompt).

Everything multi-turn runs on the one turn engine (:class:`envace.agents.engine.TurnEngine`): a rehearsal
is an engine rollout of a :class:`RehearsalEpisode` (a private fork of the started task whose ``execute``
and ``verify`` refuse to run) with :func:`envace.agents.sources.RehearseSource` answering the calls; the
committed execution is :meth:`envace.eval.runner.AgentLoopRunner.run_episode` on the real episode,
wrapped so that its system prompt carries the memory (:class:`ConditionedEpisode`).

The user side of a rehearsal is the fork's: BFCL's scripted next questions; in τ² the benchmark's
simulated user keeps talking on the fork (as in τ²'s orchestrator with the agent's tool calls routed to the
rehearsal model), and user-side tool calls (telecom) run on the fork's private copy of the environment.
The real episode is started (τ²: greeted and answered once, which is the shared "initial task context"),
forked, and otherwise left alone until the committed execution.

``memory: verbatim`` (``--tts-memory verbatim``; the paper's pipeline is ``summary``) keeps the rehearsed attempts'
transcripts themselves as the memory, for a model that cannot write a useful review or summary: no self-evaluation
and no summary is requested (in parallel mode only the summary reads the feedback; in sequential mode the feedback
such a model writes is what the variant leaves out), sequential attempts see the earlier transcripts alone
(``verbatim_history``), and the committed execution reads them (``verbatim_memory``), within ``max_memory_chars``
(:meth:`RehearsalRunner.verbatim_text`). Each transcript is the attempt after the shared opening, rendered as the
reviews see it (role-prefixed, imagined tool responses included).

Self-evaluation and summary are strict structured outputs: pydantic models (:class:`RehearsalFeedback`,
:class:`RehearsalMemory`) validated by :meth:`envace.rewards.llm.LLMPool.complete_json` with bounded repair
rounds. A reply that never validates is *masked and reported*: the attempt goes into the summary marked
"not assessed", a failed summary leaves the committed execution without memory; both are counted in the
record (``extra["tts"]``) and in the run's summary, never silently scored. Endpoint failures follow envace's
one error taxonomy (:mod:`envace.rewards.llm`): infrastructure errors retry the task on the next run,
configuration errors abort.

Prompts are versioned template files ``envace/prompts/tts_<name>_<version>.txt`` (:class:`string.Template`,
``$name`` placeholders; read by :func:`envace.loop_config.prompt_text`). Never edit a released version: add ``_v2``.
The settings are :class:`~envace.loop_config.TTSConfig` (``envace.tts`` in Hydra, ``--tts ...`` flags here).

Cost accounting: every request is metered per role (``act`` and ``rehearse`` inside rehearsals,
``evaluate``, ``summarize``, ``commit`` for the committed execution): calls, prompt/completion tokens and
summed request seconds (``wall_s``; concurrent requests overlap, so roles can sum past the elapsed time).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from string import Template
from typing import Any

from pydantic import BaseModel, Field, StrictBool, field_validator

from envace.agents.client import ChatClient, is_context_too_long
from envace.agents.engine import LoopLimits, Reply, Role, Transcript, TurnEngine
from envace.agents.sources import RehearseSource, render_history
from envace.envs.base import EnvironmentPool, Episode, TaskSpec, ToolCall, Verdict
from envace.eval.report import format_grid
from envace.eval.runner import AgentLoopRunner, ChatPolicy, RunContext, TaskRecord, register_runner, to_api_messages
from envace.loop_config import TTS_MODES, TTS_PROMPTS, RehearsalPrompt, TTSConfig, prompt_text
from envace.rewards.llm import ConfigurationError, JudgeFormatError, LLMEndpointConfig, LLMPool

__all__ = [
    "MODES",
    "ROLES",
    "ConditionedEpisode",
    "CostMeter",
    "RehearsalEpisode",
    "RehearsalFeedback",
    "RehearsalMemory",
    "RehearsalRunner",
    "RehearsalTouchedEnvironment",
    "TTSConfig",
    "cost_summary",
    "cut_oldest",
    "format_cost_table",
    "load_prompt",
    "prompt_versions",
]

MODES = TTS_MODES
#: metered roles, in table order
ROLES = ("act", "rehearse", "evaluate", "summarize", "commit")
PROMPT_NAMES = TTS_PROMPTS


# --------------------------------------------------------------------------------------------
# Prompts and structured outputs
# --------------------------------------------------------------------------------------------


def prompt_versions(config: TTSConfig, rehearsal: RehearsalPrompt | None = None) -> dict[str, str]:
    """The versions of the prompt files a run with ``config`` shows the policy: the rehearsal prompt (training's,
    ``envace/prompts/rehearsal_*``) and the test-time ones (``tts_*``). Recorded in ``run.json`` and each record."""
    return {"rehearsal": (rehearsal or RehearsalPrompt()).version, "tts": config.prompt_version}


def load_prompt(name: str, version: str = "v1") -> Template:
    """The test-time rehearsal template ``name`` (:data:`PROMPT_NAMES`): ``envace/prompts/tts_<name>_<version>.txt``."""
    return Template(prompt_text("tts_" + name, version))


class RehearsalFeedback(BaseModel):
    """The self-evaluation of one rehearsal attempt (assessment + revision suggestion, §4.3)."""

    assessment: str = Field(min_length=1, max_length=4000)  # what the attempt did right and wrong
    success: StrictBool  # would it likely succeed if the tools behaved as rehearsed
    revision: str = Field(min_length=1, max_length=4000)  # what to do differently next time

    @field_validator("assessment", "revision")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be blank")
        return v.strip()


class RehearsalMemory(BaseModel):
    """The rehearsal memory ``m_x``: a compact summary of all attempts and their feedback (§4.3)."""

    facts: list[str] = Field(max_length=32)  # what the rehearsals suggest about tools and environment
    pitfalls: list[str] = Field(max_length=32)  # mistakes to avoid
    plan: list[str] = Field(min_length=1, max_length=32)  # recommended steps for the real attempt

    @field_validator("facts", "pitfalls", "plan")
    @classmethod
    def _items(cls, v: list[str]) -> list[str]:
        out = [s.strip() for s in v]
        if any(not s for s in out):
            raise ValueError("items must not be blank")
        if any(len(s) > 1000 for s in out):
            raise ValueError("items must be at most 1000 characters")
        return out


#: the mark in front of a transcript cut from its oldest end (the one :func:`render_history` writes)
OMITTED = "...(earlier conversation omitted)...\n"


def cut_oldest(text: str, limit: int) -> tuple[str, int]:
    """``text`` cut from its oldest end to at most ``limit`` characters (:data:`OMITTED` in front when there is room
    for it), and how many of its characters were cut."""
    if len(text) <= limit:
        return text, 0
    if limit <= len(OMITTED):
        kept = text[len(text) - limit:] if limit > 0 else ""
        return kept, len(text) - len(kept)
    keep = limit - len(OMITTED)
    return OMITTED + text[len(text) - keep:], len(text) - keep


def _bullets(items: Sequence[str]) -> str:
    return "\n".join(f"- {s}" for s in items) if items else "- (none)"


def render_memory(memory: RehearsalMemory, total: int, version: str = "v1") -> str:
    return load_prompt("memory", version).substitute(
        total=total, facts=_bullets(memory.facts), pitfalls=_bullets(memory.pitfalls), plan=_bullets(memory.plan)
    ).strip()


# --------------------------------------------------------------------------------------------
# Episodes: the private rehearsal fork and the memory-conditioned real episode
# --------------------------------------------------------------------------------------------


class RehearsalTouchedEnvironment(RuntimeError):
    """A rehearsal tried to execute a tool call or run the verifier: a bug, never the model's fault."""


def _with_system_note(messages: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    """``messages`` with ``note`` appended to the system prompt (a system message is added if there is none)."""
    if not note:
        return messages
    out = copy.deepcopy(messages)
    if out and out[0].get("role") == "system":
        base = out[0].get("content") or ""
        out[0]["content"] = f"{base}\n\n{note}" if base else note
    else:
        out.insert(0, {"role": "system", "content": note})
    return out


class RehearsalEpisode(Episode):
    """The user side of a private rehearsal: a fork of the started task that never executes a call.

    ``initial_messages`` / ``tools`` / ``end_turn`` / ``done`` come from the fork (``note``, e.g. the
    sequential history, is appended to the system prompt); ``execute`` and ``verify`` raise
    :class:`RehearsalTouchedEnvironment` (tool calls are answered by the rehearsal source).
    """

    executable = False

    def __init__(self, fork: Episode, note: str = "") -> None:
        self._fork = fork
        self.spec = fork.spec
        self.note = note

    def initial_messages(self) -> list[dict[str, Any]]:
        return _with_system_note(list(self._fork.initial_messages()), self.note)

    def tools(self) -> list[dict[str, Any]]:
        return self._fork.tools()

    def execute(self, call: ToolCall) -> str:
        raise RehearsalTouchedEnvironment(f"a rehearsal must not execute {call.name!r} in an environment")

    def end_turn(self, assistant_text: str) -> str | None:
        return self._fork.end_turn(assistant_text)

    def verify(self) -> Verdict:
        raise RehearsalTouchedEnvironment("a rehearsal is never scored")

    def fork(self) -> Episode:
        return RehearsalEpisode(self._fork.fork(), self.note)

    def close(self) -> None:
        self._fork.close()

    @property
    def done(self) -> bool:
        return self._fork.done


class ConditionedEpisode(Episode):
    """The real episode with the rehearsal memory appended to its system prompt; everything else delegates."""

    def __init__(self, inner: Episode, note: str) -> None:
        self.inner = inner
        self.spec = inner.spec
        self.note = note
        self.executable = inner.executable
        self.remote = inner.remote

    def initial_messages(self) -> list[dict[str, Any]]:
        return _with_system_note(list(self.inner.initial_messages()), self.note)

    async def aexecute(self, call: ToolCall) -> str:
        return await self.inner.aexecute(call)

    async def averify(self) -> Verdict:
        return await self.inner.averify()

    def close(self) -> None:
        self.inner.close()

    def tools(self) -> list[dict[str, Any]]:
        return self.inner.tools()

    def execute(self, call: ToolCall) -> str:
        return self.inner.execute(call)

    def end_turn(self, assistant_text: str) -> str | None:
        return self.inner.end_turn(assistant_text)

    def verify(self) -> Verdict:
        return self.inner.verify()

    def fork(self) -> Episode:
        return ConditionedEpisode(self.inner.fork(), self.note)

    @property
    def done(self) -> bool:
        return self.inner.done


# --------------------------------------------------------------------------------------------
# Cost accounting
# --------------------------------------------------------------------------------------------


class CostMeter:
    """Per-role counters of one task: calls, prompt/completion tokens, summed request seconds (thread-safe)."""

    FIELDS = ("calls", "prompt_tokens", "completion_tokens", "wall_s")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.roles: dict[str, dict[str, float]] = {}

    def add(self, role: str, *, prompt_tokens: int = 0, completion_tokens: int = 0, seconds: float = 0.0) -> None:
        with self._lock:
            row = self.roles.setdefault(role, dict.fromkeys(self.FIELDS, 0))
            row["calls"] += 1
            row["prompt_tokens"] += int(prompt_tokens or 0)
            row["completion_tokens"] += int(completion_tokens or 0)
            row["wall_s"] = round(row["wall_s"] + seconds, 4)

    def as_dict(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {r: dict(self.roles[r]) for r in (*ROLES, *sorted(set(self.roles) - set(ROLES))) if r in self.roles}


class MeteredPolicy(ChatPolicy):
    """:class:`ChatPolicy` that meters every request under ``names[role]`` (e.g. ACT → "act" or "commit")."""

    def __init__(self, client: ChatClient, meter: CostMeter, names: Mapping[Role, str],
                 sampling: dict[Role, dict[str, Any]] | None = None) -> None:
        super().__init__(client, sampling)
        self.meter = meter
        self.names = dict(names)

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, role: Role) -> Reply:
        start = time.monotonic()
        reply = await super().respond(messages, tools, role)
        self.meter.add(self.names[role], prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens,
                       seconds=time.monotonic() - start)
        return reply


class _MeteredPool(LLMPool):
    """:class:`LLMPool` whose completions (repair rounds included) are metered under the role in ``sampling``."""

    def __init__(self, config: LLMEndpointConfig, meter: CostMeter) -> None:
        super().__init__(config)
        self.meter = meter

    async def complete(self, messages: Sequence[Mapping[str, Any]], **sampling: Any) -> Any:
        role = sampling.pop("_role", "judge")
        start = time.monotonic()
        completion = await super().complete(messages, **sampling)
        usage = completion.usage or {}
        self.meter.add(role, prompt_tokens=usage.get("prompt_tokens", 0),
                       completion_tokens=usage.get("completion_tokens", 0), seconds=time.monotonic() - start)
        return completion


def cost_summary(records: Sequence[TaskRecord]) -> dict[str, Any]:
    """Per-role totals over the records of a TTS run (``extra["tts"]["cost"]``), plus rehearsal outcome counts and the
    memory the committed executions read (``memory_chars``: characters in all; ``memory_cut_chars``: transcript
    characters a verbatim memory's cap left out)."""
    roles: dict[str, dict[str, float]] = {}
    counts = {"tasks": 0, "attempts": 0, "unassessed_attempts": 0, "memory_failures": 0, "memory_chars": 0,
              "memory_cut_chars": 0, "rehearsal_s": 0.0, "commit_s": 0.0}
    for rec in records:
        tts = (rec.extra or {}).get("tts")
        if not tts:
            continue
        counts["tasks"] += 1
        counts["attempts"] += len(tts.get("attempts", []))
        counts["unassessed_attempts"] += sum(1 for a in tts.get("attempts", []) if a.get("evaluation_error"))
        counts["memory_failures"] += 1 if tts.get("memory_error") else 0
        counts["memory_chars"] += int(tts.get("memory_chars", len(tts.get("memory_text") or "")))
        counts["memory_cut_chars"] += int(tts.get("memory_cut_chars", 0))
        counts["rehearsal_s"] = round(counts["rehearsal_s"] + float(tts.get("rehearsal_s", 0.0)), 3)
        counts["commit_s"] = round(counts["commit_s"] + float(tts.get("commit_s", 0.0)), 3)
        for role, row in tts.get("cost", {}).items():
            acc = roles.setdefault(role, dict.fromkeys(CostMeter.FIELDS, 0))
            for k in CostMeter.FIELDS:
                acc[k] = round(acc[k] + row.get(k, 0), 4)
    ordered = {r: roles[r] for r in (*ROLES, *sorted(set(roles) - set(ROLES))) if r in roles}
    total = {k: round(sum(r[k] for r in ordered.values()), 4) for k in CostMeter.FIELDS}
    return {"roles": ordered, "total": total, **counts}


def format_cost_table(cost: Mapping[str, Any], *, markdown: bool = False) -> str:
    """The per-role cost table: calls, prompt / completion tokens, request seconds, per task and in total."""
    n = max(1, int(cost.get("tasks", 0)))
    header = ["role", "calls", "prompt tok", "completion tok", "request s", "calls/task", "tok/task"]
    rows = []
    for role, r in [*cost["roles"].items(), ("total", cost["total"])]:
        tok = r["prompt_tokens"] + r["completion_tokens"]
        rows.append([role, f"{int(r['calls'])}", f"{int(r['prompt_tokens'])}", f"{int(r['completion_tokens'])}",
                     f"{r['wall_s']:.1f}", f"{r['calls'] / n:.1f}", f"{tok / n:.0f}"])
    lines = [format_grid(header, rows, markdown=markdown)]
    lines.append(
        f"{cost.get('tasks', 0)} task(s), {cost.get('attempts', 0)} rehearsal(s) "
        f"({cost.get('unassessed_attempts', 0)} not assessed), {cost.get('memory_failures', 0)} memory failure(s), "
        f"memory {cost.get('memory_chars', 0) / n:.0f} chars a task; "
        f"elapsed: rehearsal {cost.get('rehearsal_s', 0.0):.1f}s, committed execution {cost.get('commit_s', 0.0):.1f}s"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------


@dataclass
class Attempt:
    """One private rehearsal and its self-evaluation."""

    index: int  # 1-based
    transcript: Transcript
    opening: int = 0  # messages of the transcript before the attempt's own (the shared context, history included)
    feedback: RehearsalFeedback | None = None
    evaluation_error: str | None = None  # why the feedback is missing (masked, reported)

    def to_json(self, keep_transcript: bool) -> dict[str, Any]:
        t = self.transcript
        out: dict[str, Any] = {
            "index": self.index,
            "stop_reason": t.stop_reason,
            "user_turns": t.user_turns,
            "assistant_messages": len(t.steps),
            "tool_calls": t.tool_calls,
            "malformed_calls": t.malformed_calls,
            "malformed_rehearsals": t.malformed_rehearsals,
            "feedback": self.feedback.model_dump() if self.feedback else None,
            "evaluation_error": self.evaluation_error,
        }
        if keep_transcript:
            out["messages"] = json.loads(json.dumps(to_api_messages(t.messages), default=str))
        return out


def _context_text(messages: Sequence[Mapping[str, Any]], limit: int) -> str:
    system = next((m.get("content") or "" for m in messages if m.get("role") == "system"), "")
    opening = render_history(messages, 0)
    parts = []
    if system:
        parts.append("System prompt:\n" + (system if len(system) <= limit else system[:limit] + "\n...(cut)..."))
    parts.append("Opening of the conversation:\n" + (opening or "(none)"))
    return "\n\n".join(parts)


def _tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = []
    for t in tools:
        fn = t.get("function", t)
        lines.append(f"- {fn.get('name')}: {str(fn.get('description') or '').strip()[:300]}")
    return "\n".join(lines) or "(no tools)"


class RehearsalRunner:
    """A task runner (``runner(pool, task_id) -> TaskRecord``) doing rehearse → evaluate → summarise → commit."""

    def __init__(
        self,
        client: ChatClient,
        config: TTSConfig,
        limits: LoopLimits | None = None,
        *,
        rehearsal_client: ChatClient | None = None,
        start_kwargs: dict[str, Any] | None = None,
        keep_transcript: bool = True,
        env_timeout_s: float | None = 60.0,
        rehearsal_prompt: RehearsalPrompt | None = None,
    ) -> None:
        if config.mode == "none":
            raise ValueError("RehearsalRunner needs tts mode 'parallel' or 'sequential'")
        self.client = client
        self.rehearsal_client = rehearsal_client or client
        self.config = config
        self.limits = limits or LoopLimits()
        self.start_kwargs = dict(start_kwargs or {})
        self.keep_transcript = keep_transcript
        self.rehearsal_prompt = rehearsal_prompt or RehearsalPrompt()  # the rehearsals' prompt (training's)
        self.committer = AgentLoopRunner(client, self.limits, start_kwargs=self.start_kwargs,
                                         keep_transcript=keep_transcript, env_timeout_s=env_timeout_s)
        self._prompts = {name: load_prompt(name, config.prompt_version) for name in PROMPT_NAMES}
        ep = client.config
        self.judge_config = LLMEndpointConfig(
            base_urls=list(ep.base_urls), model=ep.model, api_key=ep.api_key, api_key_env=ep.api_key_env,
            timeout_s=ep.timeout_s, max_retries=ep.max_retries, temperature=config.evaluate_temperature,
            top_p=config.evaluate_top_p, max_tokens=config.judge_max_tokens or ep.max_tokens,
            use_json_schema=config.json_schema, extra_body=dict(ep.extra_body), concurrency=max(4, config.rehearsals),
        )

    # -- sampling per role --------------------------------------------------------------------------------
    def _seed(self, attempt: int) -> dict[str, Any]:
        base = self.client.config.seed
        return {} if base is None else {"seed": int(base) + attempt}  # distinct attempts under a fixed seed

    def _act_sampling(self, attempt: int) -> dict[str, Any]:
        return {"temperature": self.config.act_temperature, "top_p": self.config.act_top_p, **self._seed(attempt)}

    def _rehearse_sampling(self, attempt: int) -> dict[str, Any]:
        return {"temperature": self.config.rehearse_temperature, "top_p": self.config.rehearse_top_p,
                **self._seed(attempt)}

    # -- one task -----------------------------------------------------------------------------------------
    def __call__(self, pool: EnvironmentPool, task_id: str) -> TaskRecord:
        started = time.monotonic()
        spec: TaskSpec = pool.task(task_id)
        with contextlib.closing(pool.start(task_id, **self.start_kwargs)) as episode:  # a remote session ends here
            meter = CostMeter()
            attempts, memory, memory_error = asyncio.run(self.rehearse(episode, meter))
            rehearsal_s = time.monotonic() - started
            cut = 0
            if self.config.memory == "verbatim":
                note, cut = self.verbatim_text("verbatim_memory", attempts, total=len(attempts))
            else:
                note = render_memory(memory, len(attempts), self.config.prompt_version) if memory is not None else ""
            commit_start = time.monotonic()
            policy = MeteredPolicy(self.client, meter, {Role.ACT: "commit", Role.REHEARSE: "rehearse"},
                                   {Role.ACT: self._act_sampling(0)})
            rec = self.committer.run_episode(spec, ConditionedEpisode(episode, note), policy, started=started)
            rec.extra["tts"] = {
                "mode": self.config.mode,
                "rehearsals": self.config.rehearsals,
                "rehearsal_model": self.rehearsal_client.config.model,
                "prompts": prompt_versions(self.config, self.rehearsal_prompt),
                "attempts": [a.to_json(self.keep_transcript) for a in attempts],
                "memory": memory.model_dump() if memory is not None else None,
                "memory_text": note,
                "memory_error": memory_error,
                "memory_kind": self.config.memory,
                "memory_chars": len(note),
                "memory_cut_chars": cut,  # transcript characters left out of a verbatim memory (its cap)
                "cost": meter.as_dict(),
                "rehearsal_s": round(rehearsal_s, 3),
                "commit_s": round(time.monotonic() - commit_start, 3),
            }
            return rec

    async def rehearse(
        self, episode: Episode, meter: CostMeter
    ) -> tuple[list[Attempt], RehearsalMemory | None, str | None]:
        """The N private rehearsals with their evaluations, and the summary (memory, or why there is none); with
        ``memory: verbatim`` neither evaluations nor a summary (the memory is the transcripts: :meth:`verbatim_text`)."""
        cfg = self.config
        n = cfg.rehearsals
        forks = [await asyncio.to_thread(episode.fork) for _ in range(n)]  # taken before anything runs
        context = list(await asyncio.to_thread(episode.initial_messages))
        tools = list(await asyncio.to_thread(episode.tools))
        async with contextlib.AsyncExitStack() as stack:
            judge = None if cfg.memory == "verbatim" else await stack.enter_async_context(
                _MeteredPool(self.judge_config, meter))
            if cfg.mode == "parallel":
                attempts = list(await asyncio.gather(
                    *(self._attempt(i + 1, forks[i], [], context, tools, judge, meter) for i in range(n))
                ))
            else:
                attempts = []
                for i in range(n):
                    attempts.append(await self._attempt(i + 1, forks[i], list(attempts), context, tools, judge, meter))
            if judge is None:
                return attempts, None, None
            memory, memory_error = await self._summarize(attempts, context, tools, judge)
        return attempts, memory, memory_error

    async def _attempt(self, index: int, fork: Episode, previous: list[Attempt], context: list[dict[str, Any]],
                       tools: list[dict[str, Any]], judge: LLMPool | None, meter: CostMeter) -> Attempt:
        """One rehearsal (sequential: seeing ``previous``), then its self-evaluation unless ``judge`` is None."""
        note = ""
        if previous and judge is None:
            note = self.verbatim_text("verbatim_history", previous)[0]
        elif previous:
            note = self._prompts["history"].substitute(attempts=self._render_attempts(previous)).strip()
        actor = MeteredPolicy(self.client, meter, {Role.ACT: "act", Role.REHEARSE: "rehearse"},
                              {Role.ACT: self._act_sampling(index)})
        writer = MeteredPolicy(self.rehearsal_client, meter, {Role.ACT: "act", Role.REHEARSE: "rehearse"},
                               {Role.REHEARSE: self._rehearse_sampling(index)})
        source = RehearseSource(writer, self.rehearsal_prompt, on_malformed=self.limits.on_malformed_rehearsal)
        rehearsal = RehearsalEpisode(fork, note)
        try:
            transcript = await TurnEngine(self.limits).run(rehearsal, actor, source)
        finally:  # a remote fork holds a session of its own
            rehearsal.close()
        attempt = Attempt(index=index, transcript=transcript, opening=len(_with_system_note(context, note)))
        if judge is None:
            return attempt
        prompt = self._prompts["evaluate"].substitute(
            context=_context_text(context, self.config.max_context_chars), tools=_tools_text(tools), index=index,
            total=self.config.rehearsals, stop_reason=transcript.stop_reason,
            trajectory=self._trajectory(transcript, attempt.opening),
        )
        attempt.feedback, attempt.evaluation_error = await self._structured(
            judge, prompt, RehearsalFeedback, "evaluate", self.config.evaluate_temperature, self.config.evaluate_top_p
        )
        return attempt

    async def _summarize(self, attempts: list[Attempt], context: list[dict[str, Any]], tools: list[dict[str, Any]],
                         judge: LLMPool) -> tuple[RehearsalMemory | None, str | None]:
        prompt = self._prompts["summarize"].substitute(
            context=_context_text(context, self.config.max_context_chars), tools=_tools_text(tools),
            total=len(attempts), attempts=self._render_attempts(attempts), max_items=self.config.max_memory_items,
        )
        memory, error = await self._structured(judge, prompt, RehearsalMemory, "summarize",
                                               self.config.summarize_temperature, self.config.summarize_top_p)
        if memory is not None:
            k = self.config.max_memory_items
            memory = RehearsalMemory(facts=memory.facts[:k], pitfalls=memory.pitfalls[:k], plan=memory.plan[:k])
        return memory, error

    async def _structured(self, judge: LLMPool, prompt: str, schema: type[BaseModel], role: str,
                          temperature: float, top_p: float) -> tuple[Any, str | None]:
        """A validated reply, or (None, why): format failures after the repair rounds and context overflows are
        masked and reported; infrastructure and configuration errors propagate (retry / abort)."""
        try:
            value = await judge.complete_json(
                [{"role": "user", "content": prompt}], schema, repair_rounds=self.config.repair_rounds,
                temperature=temperature, top_p=top_p, _role=role, **self._seed(0),
            )
        except JudgeFormatError as exc:
            return None, f"JudgeFormatError: {exc}"
        except ConfigurationError as exc:
            if is_context_too_long(exc.status_code, str(exc)):
                return None, f"context too long: {exc}"
            raise
        return value, None

    def _trajectory(self, transcript: Transcript, skip: int) -> str:
        """The attempt after its opening messages, role-prefixed and cut from the oldest end."""
        text = render_history(transcript.messages[skip:], self.config.max_trajectory_chars)
        return text or "(the attempt produced no messages)"

    def verbatim_text(self, name: str, attempts: Sequence[Attempt], **fields: Any) -> tuple[str, int]:
        """The template ``name`` (``verbatim_memory``, ``verbatim_history``) over the attempts' transcripts, and how
        many transcript characters were cut.

        Each transcript (the attempt after its opening, role-prefixed) is cut like every rendered trajectory, to
        ``max_trajectory_chars`` from its oldest end. If the text is still longer than ``max_memory_chars``, every
        transcript is cut to an equal share of what the headers leave, again from its oldest end: each attempt stays
        represented by its last calls, their imagined responses and its final reply, and the text fits the cap unless
        the headers alone exceed it (they are never cut)."""
        full = [render_history(a.transcript.messages[a.opening:], 0) or "(the attempt produced no messages)"
                for a in attempts]

        def render(parts: Sequence[str]) -> str:
            blocks = [self._prompts["transcript"].substitute(index=a.index, stop_reason=a.transcript.stop_reason,
                                                             trajectory=t).strip()
                      for a, t in zip(attempts, parts, strict=True)]
            return self._prompts[name].substitute(attempts="\n\n".join(blocks), **fields).strip()

        limit, cap = self.config.max_trajectory_chars, self.config.max_memory_chars
        cuts = [cut_oldest(t, limit) for t in full]
        text = render([t for t, _ in cuts])
        if len(text) > cap and attempts:
            headers = len(render([""] * len(attempts))) + len(attempts)  # + the newline before each transcript
            share = max(0, cap - headers) // len(attempts)
            cuts = [cut_oldest(t, min(limit, share)) for t in full]
            text = render([t for t, _ in cuts])
        return text, sum(n for _, n in cuts)

    def _render_attempts(self, attempts: Sequence[Attempt]) -> str:
        blocks = []
        for a in attempts:
            fb = a.feedback
            blocks.append(self._prompts["attempt"].substitute(
                index=a.index, stop_reason=a.transcript.stop_reason,
                trajectory=self._trajectory(a.transcript, a.opening),
                assessment=fb.assessment if fb else f"(not assessed: the review failed: {_short(a.evaluation_error)})",
                success=("yes" if fb.success else "no") if fb else "unknown",
                revision=fb.revision if fb else "(none)",
            ).strip())
        return "\n\n".join(blocks)


def _short(text: str | None, limit: int = 200) -> str:
    text = (text or "").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@register_runner("tts")
def _tts_runner(ctx: RunContext) -> RehearsalRunner:
    cfg = ctx.tts
    if cfg is None or cfg.mode == "none":
        raise ValueError("runner 'tts' needs --tts parallel or --tts sequential")
    if ctx.options:
        raise ValueError(f"runner 'tts' takes no --runner-arg options (its settings are the --tts flags), "
                         f"got {sorted(ctx.options)}")
    rehearsal_client = ctx.client
    if cfg.rehearsal_base_url or cfg.rehearsal_model or cfg.rehearsal_api_key:
        ep = ctx.client.config
        base_urls = [cfg.rehearsal_base_url] if cfg.rehearsal_base_url else None
        rehearsal_client = ChatClient(ep.with_overrides(base_urls=base_urls, model=cfg.rehearsal_model,
                                                        api_key=cfg.rehearsal_api_key))
    return RehearsalRunner(ctx.client, cfg, ctx.limits, rehearsal_client=rehearsal_client,
                           start_kwargs=ctx.start_kwargs, keep_transcript=ctx.keep_transcript,
                           env_timeout_s=ctx.env_timeout_s)
