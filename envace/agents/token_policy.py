"""The token-level policy: the turn engine's :class:`~envace.agents.engine.Policy` over a token-in / token-out
``generate``.

Training generates with verl's ``server_manager`` (vLLM on GPUs, ``hfcpu`` on CPU; :mod:`envace.agents.verl_loop`)
and the warm start's evaluation with an in-process transformers decoder (:mod:`envace.models.decoder`); both run
the same :class:`TokenPolicy`, so the model sees the same token sequence in both, under the same rules.

The acting context is one growing token sequence: each generation's tokens are appended exactly as generated,
and new context (tool responses, user turns) is appended with verl's Continuous Token builder — earlier turns
are never decoded and re-encoded, and every call checks that the engine's messages extend the ones already
tokenised (:class:`PrefixError` otherwise). A :class:`TokenContext` does the tokenising: in training the agent
loop's own ``ct_*`` methods (:class:`LoopTokenContext`), elsewhere the same builder verl would pick for the
tokenizer (:class:`BuilderTokenContext`).

The budget is the acting context's growth over all turns (verl's ``rollout.response_length``): each acting
generation may use what is left of it (at most ``act_max_tokens``); once it is spent the engine ends the rollout
(stop reason ``token_budget``). A rehearsal (REHEARSE role) is its own prompt, outside the acting context.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from string import Template
from typing import Any, Protocol

from envace.agents.engine import Reply, Role, assistant_message
from envace.agents.sources import RehearsalFormatError, parse_rehearsal
from envace.loop_config import prompt_text
from envace.toolcall import parse_tool_calls

__all__ = [
    "BuilderTokenContext",
    "Generate",
    "Generation",
    "LoopTokenContext",
    "PrefixError",
    "TokenContext",
    "TokenPolicy",
    "announce_tools",
]

logger = logging.getLogger(__name__)

#: ``await generate(prompt_ids, sampling_params, role)`` -> (generated token ids, their log-probs or None)
Generate = Callable[[list[int], dict[str, Any], Role], Awaitable[tuple[list[int], list[float] | None]]]

Merged = tuple[list[int], list[int], list[float] | None]  # token ids, loss mask, log-probs


class PrefixError(RuntimeError):
    """The engine's conversation does not extend what was already tokenised (a bug, never data)."""


class TokenContext(Protocol):
    """Continuous-token bookkeeping (verl's ``ContinuousTokenBuilder`` contract)."""

    async def build_initial(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The prompt ids of ``messages`` with the generation prompt."""
        ...

    async def merge_context(self, previous: list[dict[str, Any]], updated: list[dict[str, Any]], ids: list[int],
                            mask: list[int], logprobs: list[float] | None,
                            tools: list[dict[str, Any]] | None) -> Merged:
        """``ids`` with the messages ``updated`` appends to ``previous`` (loss mask 0) and the generation prompt."""
        ...

    async def merge_assistant(self, ids: list[int], tokens: list[int], mask: list[int], logprobs: list[float] | None,
                              assistant_logprobs: list[float] | None) -> Merged:
        """``ids`` with the generated ``tokens`` (loss mask 1)."""
        ...


class LoopTokenContext:
    """The bookkeeping of a verl agent loop (``AgentLoopBase.ct_*``: its builder, in its executor, with its
    prompt-length cap)."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop

    async def build_initial(self, messages, tools):
        return list(await self.loop.ct_build_initial_tokens(messages, tools=tools))

    async def merge_context(self, previous, updated, ids, mask, logprobs, tools):
        merge, mask, logprobs = await self.loop.ct_merge_context_msg(previous, updated, ids, mask, logprobs,
                                                                     tools=tools)
        return list(merge.token_ids), mask, logprobs

    async def merge_assistant(self, ids, tokens, mask, logprobs, assistant_logprobs):
        merge, mask, logprobs = await self.loop.ct_merge_assistant_token(ids, tokens, mask, logprobs,
                                                                         assistant_logprobs=assistant_logprobs)
        return list(merge.token_ids), mask, logprobs


class BuilderTokenContext:
    """The same bookkeeping without an agent loop: the Continuous Token builder verl picks for ``tokenizer`` and
    ``hf_model_type``, the same calls ``AgentLoopBase.ct_*`` make (prompts over ``prompt_length`` keep their last
    ``prompt_length`` tokens, as verl's ``_cap_text_prompt_length`` does). The parity test
    (tests/envace/models/test_eval_parity.py) checks that it yields the verl loop's token sequences."""

    def __init__(self, tokenizer: Any, *, hf_model_type: str = "qwen3", chat_template_kwargs: dict[str, Any] | None = None,
                 prompt_length: int | None = None) -> None:
        from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

        self.builder = create_continuous_token_builder(tokenizer, hf_model_type=hf_model_type,
                                                       chat_template_kwargs=dict(chat_template_kwargs or {}))
        self.prompt_length = prompt_length

    async def build_initial(self, messages, tools):
        ids = list(self.builder.build_initial_tokens(messages, tools=tools))
        if self.prompt_length is not None and len(ids) > self.prompt_length:
            logger.warning("Prompt of %d tokens exceeds prompt_length=%d; left-truncating.", len(ids), self.prompt_length)
            ids = ids[-self.prompt_length:]
        return ids

    async def merge_context(self, previous, updated, ids, mask, logprobs, tools):
        merge = self.builder.merge_context_tokens(previous, updated, ids, tools=tools)
        mask, logprobs = self.builder.align_response_metadata(merge, mask, logprobs)
        return list(merge.token_ids), mask, logprobs

    async def merge_assistant(self, ids, tokens, mask, logprobs, assistant_logprobs):
        merge = self.builder.merge_assistant_tokens(ids, tokens)
        mask, logprobs = self.builder.align_response_metadata(merge, mask, logprobs,
                                                              assistant_logprobs=assistant_logprobs)
        return list(merge.token_ids), mask, logprobs


@dataclass
class Generation:
    """One ``generate`` call: one training output."""

    role: Role
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float] | None
    text: str
    format_error: bool = False


@dataclass
class _ActState:
    ids: list[int]
    prompt_len: int
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


def _tool_name(tool: dict[str, Any]) -> str:
    return str((tool.get("function") or tool).get("name"))


def _added_tools(before: list[dict[str, Any]] | None, after: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    known = {_tool_name(t) for t in before or []}
    return [t for t in after or [] if _tool_name(t) not in known]


def announce_tools(tools: list[dict[str, Any]], version: str = "v1") -> str:
    """The text that hands the model tools added mid-episode (e.g. BFCL ``miss_func``), in the chat template's
    own ``<tools>`` notation: the versioned file ``envace/prompts/tools_added_<version>.txt``
    (``envace.agent.tools_added_version``; its final newline is not part of the text). An OpenAI endpoint re-renders
    the system prompt with the new tool list on every request; a token-in/token-out context cannot change its
    tokenised system prompt, so the tools are announced in the next user message instead (BFCL's own format for
    prompted models does the same)."""
    body = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)  # one tool per line, as the template does
    return Template(prompt_text("tools_added", version).removesuffix("\n")).substitute(tools=body)


class TokenPolicy:
    """The engine's :class:`~envace.agents.engine.Policy` over token ids (see module docstring).

    ``sampling`` is the rollout's sampling parameters (``max_tokens`` is set per call; ``logprobs`` asks for the
    generated tokens' log-probs); ``rehearse_temperature`` overrides the temperature of REHEARSE generations
    (None: the rollout's). ``generations`` lists every call, in order; ``act`` is the acting context.
    """

    def __init__(self, context: TokenContext, generate: Generate, decode: Callable[[list[int]], str], *,
                 sampling: dict[str, Any], budget: int, act_max_tokens: int | None = None,
                 rehearse_max_tokens: int = 256, rehearse_temperature: float | None = None,
                 tools_added_version: str = "v1") -> None:
        self.context = context
        self.generate = generate
        self.decode = decode
        self.sampling = dict(sampling)
        self.budget = int(budget)  # acting-context growth, all turns
        self.act_max_tokens = act_max_tokens
        self.rehearse_max_tokens = int(rehearse_max_tokens)
        self.rehearse_temperature = rehearse_temperature
        self.tools_added_version = tools_added_version  # the mid-episode tool announcement's prompt file version
        self.act: _ActState | None = None
        self.generations: list[Generation] = []

    # -- token bookkeeping ---------------------------------------------------------------------
    async def _sync_context(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        st = self.act
        if st is None:
            ids = await self.context.build_initial(messages, tools)
            want_lp = bool(self.sampling.get("logprobs"))
            self.act = _ActState(ids=list(ids), prompt_len=len(ids), logprobs=[] if want_lp else None,
                                 seen=[dict(m) for m in messages], tools=tools)
            return
        n = len(st.seen)
        if len(messages) < n or messages[:n] != st.seen:
            raise PrefixError("the conversation does not extend the tokenised acting context")
        if len(messages) > n:
            appended = [dict(m) for m in messages[n:]]
            added = _added_tools(st.tools, tools)
            if added:  # the chat template put the tools in the system prompt, which is already tokenised
                for m in appended:
                    if m.get("role") == "user":
                        m["content"] = announce_tools(added, self.tools_added_version) + "\n\n" + str(
                            m.get("content") or "")
                        break
            st.ids, st.mask, st.logprobs = await self.context.merge_context(
                st.seen, st.seen + appended, st.ids, st.mask, st.logprobs, tools
            )
            st.seen = [dict(m) for m in messages]
            st.tools = tools

    async def _generate(self, prompt_ids: list[int], max_tokens: int, role: Role) -> tuple[list[int], list[float] | None]:
        params = dict(self.sampling)
        params["max_tokens"] = int(max_tokens)
        if role is Role.REHEARSE and self.rehearse_temperature is not None:
            params["temperature"] = float(self.rehearse_temperature)
        tokens, logprobs = await self.generate(list(prompt_ids), params, role)
        logprobs = list(logprobs) if (logprobs is not None and self.sampling.get("logprobs")) else None
        return list(tokens), logprobs

    # -- the Policy interface --------------------------------------------------------------------
    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, role: Role) -> Reply:
        if role is Role.REHEARSE:
            return await self._rehearse(messages)
        await self._sync_context(messages, tools)
        st = self.act
        assert st is not None
        left = self.budget - len(st.mask)
        if left <= 0:
            return Reply(text="", budget_exhausted=True, generated=False)
        max_tokens = min(left, self.act_max_tokens) if self.act_max_tokens else left
        prompt = list(st.ids)
        tokens, logprobs = await self._generate(prompt, max_tokens, Role.ACT)
        st.ids, st.mask, st.logprobs = await self.context.merge_assistant(
            st.ids, tokens, st.mask, st.logprobs, logprobs if st.logprobs is not None else None
        )
        text = self.decode(tokens)
        parsed = parse_tool_calls(text)
        reply = Reply(
            text=text,
            content=parsed.content,
            calls=parsed.calls,
            errors=parsed.errors,
            reasoning=parsed.reasoning,
            budget_exhausted=len(st.mask) >= self.budget,
            completion_tokens=len(tokens),
            prompt_tokens=len(prompt),
        )
        self.generations.append(Generation(Role.ACT, prompt, tokens, logprobs, text, format_error=bool(parsed.errors)))
        # what the engine will append next; the next call's prefix check compares against it
        n_before = sum(len(m.get("tool_calls") or []) for m in st.seen if m.get("role") == "assistant")
        ids = [f"call_{n_before + i}" for i in range(len(parsed.calls))]
        st.seen = [dict(m) for m in messages] + [assistant_message(reply, ids)]
        return reply

    async def _rehearse(self, messages: list[dict[str, Any]]) -> Reply:
        prompt = await self.context.build_initial(messages, None)
        tokens, logprobs = await self._generate(prompt, self.rehearse_max_tokens, Role.REHEARSE)
        text = self.decode(tokens)
        try:
            parse_rehearsal(text)
            bad = False
        except RehearsalFormatError:
            bad = True
        self.generations.append(Generation(Role.REHEARSE, list(prompt), tokens, logprobs, text, format_error=bad))
        return Reply(text=text, content=text, completion_tokens=len(tokens), prompt_tokens=len(prompt))
