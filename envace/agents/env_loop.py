"""``envace_env``: the multi-turn tool-use agent loop against a real environment pool.

One rollout of one task: the policy generates; every ``<tool_call>`` in its message is executed
in the episode's own environment state and the observations are appended as ``tool`` messages;
a message without tool calls ends the user turn and the environment hands out the next user
message (BFCL: the next question; τ²: the simulated user); at the end the benchmark's official
verifier scores the episode and its reward becomes the trajectory's ``reward_score``.

Only ``self.server_manager.generate`` touches the model, so the loop runs unchanged on vLLM
(GPU) and on the ``hfcpu`` rollout (CPU). Tokens are assembled with verl's Continuous Token
builder (``ct_*`` helpers), so what the actor trains on is exactly what the rollout saw:
model tokens carry mask 1 and their rollout log-probs, environment tokens mask 0.

Failures never pass silently: malformed tool calls become error observations the model reads;
a verifier crash marks the sample ``envace/verify_failed`` and zeroes its loss mask, so it
contributes no gradient instead of a fabricated reward of 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput
from verl.utils.profiler import simple_timer

from envace.config import AgentConfig
from envace.envs.base import END_TURN, EnvironmentPool, Episode, ToolCall, get_pool
from envace.toolcall import parse_tool_calls

logger = logging.getLogger(__name__)

_POOLS: dict[str, EnvironmentPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(name: str, kwargs: dict[str, Any] | None = None) -> EnvironmentPool:
    """One pool object per process and name (pools are read-only; episodes hold the state)."""
    key = f"{name}:{json.dumps(kwargs or {}, sort_keys=True)}"
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = get_pool(name, **(kwargs or {}))
        return _POOLS[key]


def truncate_middle(text: str, limit: int) -> str:
    if limit <= 0 or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n...({len(text) - limit} characters truncated)...\n{text[-half:]}"


def task_ref(kwargs: dict[str, Any]) -> tuple[str, str]:
    """(pool, task_id) of a dataset row; raises a clear error when the row lacks them."""
    info = kwargs.get("extra_info") or {}
    pool, task_id = info.get("pool"), info.get("task_id")
    if not pool or not task_id:
        raise ValueError(
            "envace_env rows need extra_info.pool and extra_info.task_id "
            "(build datasets with `python -m envace.envs build-data`)"
        )
    return str(pool), str(task_id)


class EnvAgentLoop(AgentLoopBase):
    """ACT against the real environment: generate → execute tool calls → observe → ... → verify."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        envace_cfg = self.config.get("envace", {}) or {}
        agent = envace_cfg.get("agent", {}) or {}
        self.agent_cfg = AgentConfig(**{k: v for k, v in dict(agent).items()})
        self.response_length = self.rollout_config.response_length

    # -- helpers -------------------------------------------------------------------------------
    def _execute(
        self, episode: Episode, calls: list[ToolCall], errors: list[str]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Run the parsed calls; parse errors and calls over the cap become error observations.

        Returns the tool messages and the executed actions (``name``, ``arguments``, ``output``: the
        observation, which EnvSched's identifier filter treats as context the agent was given).
        """
        messages: list[dict[str, Any]] = []
        executed: list[dict[str, Any]] = []
        for err in errors:
            messages.append({"role": "tool", "content": f"Error: malformed tool call: {err}"})
        cap = self.agent_cfg.max_calls_per_step
        for i, call in enumerate(calls):
            if i >= cap:
                text = f"Error: at most {cap} tool calls are executed per message; '{call.name}' was skipped."
            else:
                try:
                    text = episode.execute(call)
                except Exception as exc:  # an environment bug must not kill the whole batch
                    logger.exception("environment raised on %s", call.name)
                    text = f"Error: the environment failed on '{call.name}': {type(exc).__name__}: {exc}"
                executed.append({**call.to_dict(), "output": str(text)})
            messages.append(
                {"role": "tool", "content": truncate_middle(str(text), self.agent_cfg.max_observation_chars)}
            )
        return messages, executed

    async def _append_context(self, state: dict[str, Any], new_messages: list[dict[str, Any]], tools) -> bool:
        """Append environment/user messages as mask-0 tokens. Returns False when out of budget."""
        previous = state["messages"]
        updated = previous + new_messages
        merge, state["mask"], state["logprobs"] = await self.ct_merge_context_msg(
            previous, updated, state["ids"], state["mask"], state["logprobs"], tools=tools
        )
        state["ids"] = merge.token_ids
        state["messages"] = updated
        return len(state["mask"]) < self.response_length

    # -- the loop ------------------------------------------------------------------------------
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        pool_name, task_id = task_ref(kwargs)
        pool = shared_pool(pool_name, dict(self.agent_cfg.pool_kwargs.get(pool_name, {}) or {}))
        episode = await asyncio.to_thread(pool.start, task_id)
        tools = episode.tools()
        messages = episode.initial_messages()
        metrics: dict[str, Any] = {}
        request_id = uuid4().hex

        prompt_ids = await self.ct_build_initial_tokens(messages, tools=tools)
        state: dict[str, Any] = {
            "ids": list(prompt_ids),
            "mask": [],
            "logprobs": [] if sampling_params.get("logprobs") else None,
            "messages": list(messages),
        }
        extra: dict[str, Any] = {}
        n_calls = n_parse_errors = user_turns = assistant_turns = 0
        last_text = ""
        actions: list[dict[str, Any]] = []  # executed calls with outputs, END_TURN between user turns
        budget_left = True
        while budget_left:
            for _step in range(self.agent_cfg.max_steps_per_turn):
                with simple_timer("generate_sequences", metrics):
                    out = await self.server_manager.generate(
                        request_id=request_id, prompt_ids=state["ids"], sampling_params=dict(sampling_params)
                    )
                # weight versions seen by this trajectory (verl V1 reads them for staleness control)
                fields = out.extra_fields
                if "min_global_steps" in fields:
                    extra.setdefault("min_global_steps", fields["min_global_steps"])
                extra.update({k: fields[k] for k in ("max_global_steps", "global_steps") if k in fields})
                merge, state["mask"], state["logprobs"] = await self.ct_merge_assistant_token(
                    state["ids"],
                    out.token_ids,
                    state["mask"],
                    state["logprobs"],
                    assistant_logprobs=out.log_probs if state["logprobs"] is not None else None,
                )
                state["ids"] = merge.token_ids
                assistant_turns += 1
                text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                parsed = parse_tool_calls(text)
                assistant_msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
                if parsed.calls:
                    assistant_msg["tool_calls"] = [
                        {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                        for c in parsed.calls
                    ]
                state["messages"].append(assistant_msg)
                last_text = parsed.content
                if len(state["mask"]) >= self.response_length:
                    budget_left = False
                    break
                if not parsed.calls and not parsed.errors:
                    break  # the assistant ended its turn
                n_calls += len(parsed.calls)
                n_parse_errors += len(parsed.errors)
                observations, executed = await asyncio.to_thread(self._execute, episode, parsed.calls, parsed.errors)
                actions.extend(executed)
                if not await self._append_context(state, observations, tools):
                    budget_left = False
                    break
            if not budget_left:
                break
            next_user = await asyncio.to_thread(episode.end_turn, last_text)
            if next_user is None or user_turns + 1 >= self.agent_cfg.max_user_turns:
                break
            user_turns += 1
            actions.append({"name": END_TURN, "arguments": {}})
            new_tools = episode.tools()
            if new_tools != tools:  # e.g. BFCL miss_func reveals a withheld function
                tools = new_tools
                extra.setdefault("tools_changed_at_turn", user_turns)
            if not await self._append_context(state, [{"role": "user", "content": next_user}], tools):
                break

        verify_failed = False
        try:
            verdict = await asyncio.to_thread(episode.verify)
            reward, details = float(verdict.reward), dict(verdict.details)
        except Exception as exc:
            logger.exception("verifier failed for %s/%s", pool_name, task_id)
            verify_failed, reward, details = True, 0.0, {"error": f"{type(exc).__name__}: {exc}"}

        n_resp = len(state["mask"])
        response_ids = state["ids"][len(state["ids"]) - n_resp :][: self.response_length]
        response_mask = state["mask"][: self.response_length]
        if verify_failed:
            response_mask = [0] * len(response_mask)  # no gradient from an unscored sample
        extra.update(
            {
                "task_id": task_id,
                "pool": pool_name,
                "env_id": episode.spec.env_id,
                "reward_extra_info": {
                    "acc": reward,
                    "verify_failed": float(verify_failed),
                    "tool_calls": float(n_calls),
                    "tool_call_parse_errors": float(n_parse_errors),
                    "user_turns": float(user_turns + 1),
                },
                "verdict": json.dumps(details, default=str)[:4000],
                # the executed action sequence, replayable through the pool (EnvSched identifier filter)
                "actions": json.dumps(actions, ensure_ascii=False, default=str),
                "turn_scores": [],
                "tool_rewards": [],
            }
        )
        return AgentLoopOutput(
            prompt_ids=list(prompt_ids),
            response_ids=response_ids,
            response_mask=response_mask,
            response_logprobs=state["logprobs"][: self.response_length] if state["logprobs"] is not None else None,
            reward_score=reward,
            num_turns=assistant_turns + user_turns + 1,
            metrics=AgentLoopMetrics(**{k: v for k, v in metrics.items() if k in AgentLoopMetrics.model_fields}),
            extra_fields=extra,
        )
