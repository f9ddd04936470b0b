"""SFT examples: ACT streams laid out as verl's agent loop builds them, REHEARSE examples and copy drills."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from envace.models import tokenizer as _tok
from envace.models.warmstart.config import DEFAULT_CONFIG, TEMPLATE_KW, WarmStartConfig

_SYN_SYSTEM = {"role": "system", "content": "continuous token synthetic system"}
_SYN_USER = {"role": "user", "content": "continuous token synthetic user"}


@dataclass
class SFTExample:
    """One token sequence; ``labels[i]`` is 1 where token ``i`` is a generated (trained) token."""

    kind: str  # "act" | "rehearse"
    ids: list[int]
    labels: list[int]
    task_id: str = ""
    targets: list[str] = field(default_factory=list)  # the generated texts, in order (tests, debugging)


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _render(tok: Any, messages: Sequence[Mapping[str, Any]], tools: Any = None, gen: bool = False) -> str:
    return tok.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=gen, **TEMPLATE_KW
    )


def _delta(tok: Any, prefix: list[dict[str, Any]], appended: list[dict[str, Any]]) -> list[int]:
    """Tokens the template adds for ``appended`` (plus the generation prompt) after ``prefix``."""
    a = _encode(tok, _render(tok, prefix))
    b = _encode(tok, _render(tok, prefix + appended, gen=True))
    if b[: len(a)] != a:
        raise ValueError("chat template render is not append-only")
    return b[len(a) :]


def tool_delta(tok: Any, observations: Sequence[str]) -> list[int]:
    """verl continuous tokens for a group of tool messages (after the ``\\n`` boundary)."""
    synthetic = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "reasoning",
        "tool_calls": [
            {"id": f"dummy_{i}", "type": "function", "function": {"name": "continuous_token_tool", "arguments": {}}}
            for i in range(len(observations))
        ],
    }
    return _delta(tok, [_SYN_SYSTEM, _SYN_USER, synthetic], [{"role": "tool", "content": o} for o in observations])


def user_delta(tok: Any, text: str) -> list[int]:
    """verl continuous tokens for an appended user message (after the ``\\n`` boundary)."""
    return _delta(tok, [_SYN_SYSTEM, _SYN_USER], [{"role": "user", "content": text}])


def _ids_of(tok: Any, token: str) -> int:
    return int(tok.convert_tokens_to_ids(token))


def _call_message(call: Any, call_id: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": call.name, "arguments": dict(call.arguments)}}],
    }


def act_examples(pool: Any, task_id: str, tok: Any) -> tuple[SFTExample, list[tuple[Any, list[dict[str, Any]], str]]]:
    """The ACT stream of one task's gold trajectory, and ``(call, history, real observation)`` per gold call.

    ``history`` is the engine's conversation up to and including the assistant message of the call
    (what :class:`~envace.agents.sources.RehearseSource` shows the rehearsal role).
    """
    from envace.toolcall import render_tool_call

    spec = pool.task(task_id)
    ep = pool.start(task_id)
    im_end, nl = _ids_of(tok, _tok.EOS_TOKEN), _encode(tok, "\n")
    messages = list(ep.initial_messages())
    ids = _encode(tok, _render(tok, messages, spec.tools, gen=True))
    labels = [0] * len(ids)
    targets: list[str] = []
    calls: list[tuple[Any, list[dict[str, Any]], str]] = []

    def emit(text: str) -> None:
        t = _encode(tok, text) + [im_end]
        ids.extend(t)
        labels.extend([1] * len(t))
        targets.append(text)

    def context(delta: list[int]) -> None:
        t = nl + delta  # QwenContinuousTokenBuilder inserts the "\n" after a generated <|im_end|>
        ids.extend(t)
        labels.extend([0] * len(t))

    n_ids = 0
    replies = pool.gold_replies(task_id)
    for t, turn in enumerate(pool.gold_actions(task_id)):
        for call in turn:
            emit(render_tool_call(call))
            msg = _call_message(call, f"call_{n_ids}")
            n_ids += 1
            obs = ep.execute(call)
            calls.append((call, messages + [msg], obs))
            messages += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": obs}]
            context(tool_delta(tok, [obs]))
        reply = replies[t]
        emit(reply)
        messages.append({"role": "assistant", "content": reply})
        nxt = ep.end_turn(reply)
        if nxt is None:
            break
        messages.append({"role": "user", "content": nxt})
        context(user_delta(tok, nxt))
    reward = ep.verify().reward
    if reward != 1.0:
        raise RuntimeError(f"gold trajectory of {task_id} scores {reward}")
    return SFTExample("act", ids, labels, task_id, targets), calls


def rehearse_example(tok: Any, call: Any, history: list[dict[str, Any]], tools: Any, observation: str,
                     max_history_chars: int = 1500, task_id: str = "") -> SFTExample:
    from envace.agents.sources import RehearsalPrompt, rehearsal_messages, render_rehearsal

    msgs = rehearsal_messages(call, history, tools, examples=(), cfg=RehearsalPrompt(max_history_chars=max_history_chars))
    prompt = _encode(tok, _render(tok, msgs, None, gen=True))
    text = render_rehearsal(observation)
    target = _encode(tok, text) + [_ids_of(tok, _tok.EOS_TOKEN)]
    return SFTExample("rehearse", prompt + target, [0] * len(prompt) + [1] * len(target), task_id, [text])


def rehearse_examples(pool: Any, task_id: str, tok: Any, max_history_chars: int = 1500) -> list[SFTExample]:
    """One REHEARSE example per gold call of the task."""
    tools = pool.task(task_id).tools
    _, calls = act_examples(pool, task_id, tok)
    return [rehearse_example(tok, c, h, tools, o, max_history_chars, task_id) for c, h, o in calls]


def build_examples(pool: Any, task_ids: Sequence[str], tok: Any, cfg: WarmStartConfig = DEFAULT_CONFIG) -> list[SFTExample]:
    rng = random.Random(f"{cfg.seed}:rehearse")
    out: list[SFTExample] = []
    for n, tid in enumerate(task_ids):
        ex, calls = act_examples(pool, tid, tok)
        out.append(ex)
        if n % max(1, cfg.rehearse_every):
            continue
        tools = pool.task(tid).tools
        for c, h, o in rng.sample(calls, min(cfg.rehearse_per_task, len(calls))):
            out.append(rehearse_example(tok, c, h, tools, o, cfg.max_history_chars, tid))
    return out


def copy_drill_examples(tok: Any, n: int, seed: int = 0) -> list[SFTExample]:
    """``n`` short drills that teach copying: a user message names a tool and argument values, the target is
    the call with exactly those values (``render_tool_call`` + ``<|im_end|>``). Names and values come from the
    ``synthetic`` domains (tool names, parameter names, ids, entity names, numbers, statuses) in random
    combinations, so only copying (not memorising) solves them. Many copy targets per token of context.
    """
    from envace.envs.base import ToolCall
    from envace.envs.synthetic import DOMAINS
    from envace.toolcall import render_tool_call

    rng = random.Random(f"{seed}:drill")
    tools = sorted({t for d in DOMAINS for v in d.tools.values() for t in v})
    params = sorted({p for d in DOMAINS for p in (*d.idp, *d.amtp, d.namef, d.numf, d.statf)} | {"name", "value", "new_status"})
    names = sorted({x for d in DOMAINS for x in d.names})
    statuses = sorted({x for d in DOMAINS for x in d.statuses})
    letters = sorted({x for d in DOMAINS for x in d.letters})

    def value() -> Any:
        r = rng.random()
        if r < 0.4:
            return f"{rng.choice(letters)}{rng.randint(10, 99)}"
        if r < 0.7:
            return rng.randint(1, 999)
        if r < 0.85:
            return rng.choice(names)
        return rng.choice(statuses)

    im_end = _ids_of(tok, _tok.EOS_TOKEN)
    prompts, targets = [], []
    for _ in range(n):
        tool = rng.choice(tools)
        args = {p: value() for p in rng.sample(params, rng.randint(1, 3))}
        parts = [f"{p} {v}" for p, v in args.items()]
        text = rng.choice(("Call {t} with {a}.", "Use {t}: {a}.", "Run {t} ({a})."))
        text = text.format(t=tool, a=" and ".join(parts))
        prompts.append(_render(tok, [{"role": "user", "content": text}], None, gen=True))
        targets.append(render_tool_call(ToolCall(tool, args)))
    if not prompts:
        return []
    # one batched call each (the Rust tokenizer encodes a batch in parallel): 30,000 drills in seconds
    prompt_ids = tok(prompts, add_special_tokens=False)["input_ids"]
    target_ids = tok(targets, add_special_tokens=False)["input_ids"]
    out: list[SFTExample] = []
    for prompt, target, target_text in zip(prompt_ids, target_ids, targets, strict=True):
        target = [*target, im_end]
        out.append(SFTExample("drill", [*prompt, *target], [0] * len(prompt) + [1] * len(target), "", [target_text]))
    return out
