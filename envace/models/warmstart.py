"""A supervised warm start of the tiny Qwen3 on gold trajectories of the ``synthetic`` pool.

A random-init tiny model never emits a tool call, so every RL reward is 0 and GRPO has nothing to
learn from. :func:`build_warm_start` fine-tunes the tiny Qwen3 (a larger :data:`WARM_SPEC`) on the
TRAIN split of the procedurally generated pool, with two kinds of examples:

ACT
    One token stream per task, laid out exactly as verl's agent loop builds it (continuous tokens,
    ``QwenContinuousTokenBuilder``): the initial render with the task's tools and the generation
    prompt (``enable_thinking=False``, so ``<think>\\n\\n</think>\\n\\n``), then per gold call the
    generated tokens ``render_tool_call(call) + <|im_end|>`` (loss), the boundary ``\\n`` and the
    tool-response delta with the next generation prompt (no loss), and after each user turn's calls
    the gold final reply (``pool.gold_replies``: ``"Done."`` or the answer the verifier checks) +
    ``<|im_end|>`` (loss), then the next user message's delta.
REHEARSE
    Per gold call, the rehearsal prompt (:func:`envace.agents.sources.rehearsal_messages`, no tools,
    generation prompt) with target ``render_rehearsal(real observation) + <|im_end|>``.

DRILL
    Short copy drills (:func:`copy_drill_examples`): a user message names a tool and argument values,
    the target is the call with exactly those values. Many copy targets per token of context.

Training runs in two phases. Phase 1 trains on drills alone, at a constant (higher) learning rate, until the
drill loss averaged over ``drill_window`` steps falls to ``drill_target_loss`` (at most ``drill_steps``
steps): copying multi-token values (``"F84"`` is three Qwen tokens) needs an induction-style attention circuit,
which forms abruptly (the drill loss drops from ~0.35 to ~0.1 within a few hundred steps) after ~1,000-1,600
steps, and when exactly depends on the machine's floating-point arithmetic. A fixed budget with a decaying
learning rate was fragile: on an AMD EPYC the loss was still 0.29 at step 1,500 (the rate had decayed) and the
model's held-out success was 0.02, where the same recipe on an Intel machine formed the circuit; with a
constant rate it formed at ~1,400 steps (loss 0.10 at 1,500, 0.01 at 2,400). Stopping on the loss makes every
machine leave phase 1 with the circuit formed (the manifest records the steps it took). The target is 0.03, not
0.1: on an AVX-512 AMD EPYC the loss fell slowly, not abruptly (0.19 at step 2,000), and stopping at 0.1 (step 2,431)
left the circuit half-formed: held-out success 0.042 (48 tasks) and 0.083 (96 tasks) at temperature 1.0, 0.135 greedy;
run on to 0.03 (step 3,512, about 150 s more) the same machine gave 0.146, 0.177 and 0.281. Trained on task data
from the start the same budget leaves the model guessing values (held-out success 0.0). Phase 2
(``max_steps``) trains on ACT and REHEARSE examples with some drills mixed in, with a decaying rate.

Phase 1 runs on batches of ``drill_batch_tokens`` = 1,024 padded tokens, half of phase 2's: the circuit forms after
about as many steps either way (3,413 against 3,512 at 2,048 tokens, same phase-2 loss, 0.163 against 0.161), and a
step costs 0.09-0.10 s instead of 0.125 s on the AVX-512 EPYC; with the batched evaluation (:func:`run_episodes`)
that brought the build from 766 s to 593 s, held-out success 0.146 on 48 tasks (0.156 on 96) at temperature 1.0.
Tried and not taken (same machine): 512 tokens (the drill loss was still 0.13 at step 4,300), 768 tokens (0.067 at
step 3,500), a drill rate of 2e-2 (the circuit formed at step 2,867, but phase 2 then learned less: final loss 0.25
against 0.16, held-out success 0.06 on 96 tasks) and of 3e-2 (slower to form: 0.18 at step 2,750).

The tasks are the train split of :data:`LEARNING_POOL_KWARGS` (the ``synthetic`` pool restricted to
one-call tasks and two-call lookup chains, canonical names), the pool the default RL run also draws its tasks
from.

Training is a plain AdamW loop. For speed on CPU the softmax runs over a compact vocabulary: the
token ids that occur in the training sequences (a few thousand) plus a fixed uniform sample of the
other ids, whose log-sum-exp is rescaled to stand for all of them (sampled softmax). The other rows
of the (tied) embedding stay at their random init. The hidden states go through the head only at
target positions.

The result is cached like the tiny model (``$ENVACE_CACHE/models/tiny-qwen3-warm``, atomic directory
build, ``envace_manifest.json`` written last with the recipe hash; the evaluation is not part of the recipe).

The held-out success (:func:`evaluate_policy`, printed by a build and kept in its manifest) is RL validation's
metric: the rollouts run through the turn engine (:class:`~envace.agents.engine.TurnEngine`) with the token-level
policy training runs, over an in-process decoder, under the CPU default run's validation limits
(:class:`EvalSettings`), scored by :func:`envace.rewards.score.score_episode`; there is no second turn loop here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envace.models import tiny as _tiny
from envace.models import tokenizer as _tok

__all__ = [
    "DEFAULT_CONFIG",
    "LEARNING_POOL_KWARGS",
    "WARM_NAME",
    "WARM_RECIPE_VERSION",
    "WARM_SPEC",
    "EvalSettings",
    "SFTExample",
    "WarmStartConfig",
    "act_examples",
    "build_warm_start",
    "default_warm_dir",
    "ensure_warm_model",
    "evaluate_policy",
    "evaluate_rehearsal",
    "learning_pool",
    "rehearse_examples",
    "run_episodes",
    "task_success",
    "token_policy",
    "train_sft",
]

WARM_NAME = "tiny-qwen3-warm"
WARM_RECIPE_VERSION = 3

#: the warm-started model's size (the default tiny spec, 64 wide × 2 layers, learns too little)
WARM_SPEC = _tiny.TinyQwen3Spec(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    rope_theta=10_000.0,  # sharper relative positions at a ~500-token context (copying needs previous-token heads)
)

#: the ``synthetic`` pool options of the learning setup: the warm start trains (and is scored) on
#: these tasks, and the default RL run draws its train/validation tasks from the same pool. One-call
#: tasks (``act``: a write with ids/values given in the instruction, ``query``: a ``get`` then the
#: answer) and two-call lookup chains (``find`` by name, then a write / ``get`` on the returned id),
#: where copying values from the instruction and the observations into arguments is the main skill.
LEARNING_POOL_KWARGS: tuple[tuple[str, Any], ...] = (
    ("shapes", ("act", "query", "lookup_act", "lookup_query")),
    # each domain's canonical tool and parameter names: with per-environment renamings the 20M-parameter
    # policy picks the wrong tool name on most held-out tasks (greedy success 0.17 after the same budget)
    ("renamings", False),
)

_SYN_SYSTEM = {"role": "system", "content": "continuous token synthetic system"}
_SYN_USER = {"role": "user", "content": "continuous token synthetic user"}
_TEMPLATE_KW = {"enable_thinking": False}


@dataclass(frozen=True)
class WarmStartConfig:
    """The training recipe (everything here enters the recipe hash)."""

    spec: _tiny.TinyQwen3Spec = WARM_SPEC
    pool: str = "synthetic"
    pool_kwargs: tuple[tuple[str, Any], ...] = LEARNING_POOL_KWARGS
    max_train_tasks: int = 0  # 0: every train task
    rehearse_per_task: int = 1  # rehearsal examples kept per task (random gold calls; 0: none)
    rehearse_every: int = 1  # rehearsal examples only for every k-th train task (more ACT tokens per step)
    drill_steps: int = 4500  # phase 1: at most this many optimizer steps on copy drills alone (the copying circuit)
    drill_lr: float = 1.2e-2  # phase 1 learning rate (constant after warm-up)
    drill_target_loss: float = 0.03  # phase 1 ends once the drill loss averaged over drill_window steps is this low
    drill_window: int = 50  # steps averaged for drill_target_loss
    copy_drills: int = 2000  # copy drills mixed into the phase-2 data (phase 1 draws its own, 30,000)
    max_history_chars: int = 1500
    epochs: int = 1
    max_steps: int = 1200  # phase 2 (task data): stop after this many optimizer steps (0: run every epoch)
    batch_tokens: int = 2048  # padded tokens per phase-2 batch
    # padded tokens per phase-1 batch: the circuit forms after about as many steps at 1,024 as at 2,048, at 0.1 s a
    # step instead of 0.125 (512 and 768 take more steps)
    drill_batch_tokens: int = 1024
    lr: float = 6e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    negatives: int = 2048  # sampled other-vocabulary ids in the softmax
    seed: int = 0
    # torch CPU threads (fixed, so the build is the same on every machine; 2 halves the time on an idle 2-core box)
    threads: int = 2
    eval_tasks: int = 48  # held-out test tasks scored at the end of the build (T=1.0)

    def recipe(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["spec"] = dataclasses.asdict(self.spec)
        d["pool_kwargs"] = [[k, list(v) if isinstance(v, (tuple, list)) else v] for k, v in self.pool_kwargs]
        d.pop("eval_tasks")
        return d


DEFAULT_CONFIG = WarmStartConfig()
_PHASE1_DRILLS = 30_000


# --------------------------------------------------------------------------------------------------
# SFT examples
# --------------------------------------------------------------------------------------------------


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
        list(messages), tools=tools, tokenize=False, add_generation_prompt=gen, **_TEMPLATE_KW
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


# --------------------------------------------------------------------------------------------------
# Training (compact vocabulary + sampled other ids)
# --------------------------------------------------------------------------------------------------


def _batches(examples: Sequence[SFTExample], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].ids), i))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = len(examples[i].ids)
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def train_sft(
    model: Any,
    examples: Sequence[SFTExample],
    *,
    epochs: int = 1,
    max_steps: int = 0,
    batch_tokens: int = 4096,
    lr: float = 3e-3,
    warmup_steps: int = 20,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    negatives: int = 2048,
    seed: int = 0,
    log_every: int = 0,
    threads: int = 1,
    decay: bool = True,
    stop_below: float = 0.0,
    stop_window: int = 50,
) -> list[float]:
    """Fine-tune ``model`` (a tied-embedding Qwen3ForCausalLM, in place) on ``examples``; per-step losses.

    The softmax covers the ids occurring in ``examples`` plus ``negatives`` other ids drawn once
    (their log-sum-exp is shifted by ``log(#others / negatives)``); only those rows are trained.
    The learning rate warms up linearly over ``warmup_steps``, then decays linearly to 5 % at the last step
    (``decay``) or stays constant. With ``stop_below`` > 0 training ends early, at the first step where the
    mean loss of the last ``stop_window`` steps is at most ``stop_below``.
    """
    with _torch_threads(threads):
        return _train(model, examples, epochs, max_steps, batch_tokens, lr, warmup_steps, weight_decay, grad_clip,
                      negatives, seed, log_every, decay, stop_below, stop_window)


def _window_mean(losses: Sequence[float], window: int) -> float:
    """Mean of the last ``window`` losses (all of them when fewer)."""
    tail = losses[-window:]
    return sum(tail) / len(tail)


def _train(model: Any, examples: Sequence[SFTExample], epochs: int, max_steps: int, batch_tokens: int, lr: float,
           warmup_steps: int, weight_decay: float, grad_clip: float, negatives: int, seed: int,
           log_every: int, decay: bool = True, stop_below: float = 0.0, stop_window: int = 50) -> list[float]:
    import torch
    import torch.nn.functional as F

    emb = model.get_input_embeddings()
    V, H = emb.weight.shape
    if model.get_output_embeddings().weight.data_ptr() != emb.weight.data_ptr():
        raise ValueError("train_sft expects tied input/output embeddings")
    rng = random.Random(seed)
    used = sorted({t for ex in examples for t in ex.ids})
    used_set = set(used)
    others = [i for i in range(V) if i not in used_set]
    k = min(negatives, len(others))
    neg = sorted(random.Random(f"{seed}:neg").sample(others, k)) if k else []
    shift = math.log(len(others) / k) if k else 0.0
    remap = torch.full((V,), -1, dtype=torch.long)
    remap[torch.tensor(used)] = torch.arange(len(used))
    full_w = emb.weight
    with torch.no_grad():
        compact = torch.nn.Parameter(full_w[torch.tensor(used)].clone())
        neg_w = full_w[torch.tensor(neg, dtype=torch.long)].clone() if k else torch.zeros(0, H)
    body = model.model
    params = [compact] + [p for n, p in body.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    total = max_steps or epochs * len(_batches(examples, batch_tokens, random.Random(0)))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)) * (max(0.05, 1 - s / max(1, total)) if decay else 1.0)
    )
    pad_c = max(int(remap[_tok.QWEN3_SPECIAL_START_ID]), 0)
    losses: list[float] = []
    model.train()
    step = 0
    stopped = False
    t0 = time.time()
    with _tiny._fork_rng():
        torch.manual_seed(seed)
        while step < total and not stopped:
            for batch in _batches(examples, batch_tokens, rng):
                if step >= total:
                    break
                L = max(len(examples[i].ids) for i in batch)
                ids = torch.full((len(batch), L), pad_c, dtype=torch.long)
                att = torch.zeros((len(batch), L), dtype=torch.long)
                lab = torch.zeros((len(batch), L), dtype=torch.bool)
                for r, i in enumerate(batch):
                    ex = examples[i]
                    ids[r, : len(ex.ids)] = remap[torch.tensor(ex.ids)]
                    att[r, : len(ex.ids)] = 1
                    lab[r, : len(ex.ids)] = torch.tensor(ex.labels, dtype=torch.bool)
                # position p predicts token p+1: select hidden states before each target token
                sel = lab[:, 1:]
                hidden = body(inputs_embeds=F.embedding(ids, compact), attention_mask=att).last_hidden_state
                h = hidden[:, :-1][sel]
                tgt = ids[:, 1:][sel]
                logits = h @ compact.t()
                if k:
                    logits = torch.cat([logits, h @ neg_w.t() + shift], dim=-1)
                loss = F.cross_entropy(logits, tgt)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if grad_clip:
                    torch.nn.utils.clip_grad_norm_(params, grad_clip)
                opt.step()
                sched.step()
                losses.append(float(loss.detach()))
                step += 1
                if log_every and step % log_every == 0:
                    recent = losses[-log_every:]
                    print(f"step {step}/{total} loss {sum(recent) / len(recent):.4f} ({time.time() - t0:.0f}s)", flush=True)
                if stop_below > 0 and len(losses) >= stop_window:
                    window = _window_mean(losses, stop_window)
                    if window <= stop_below:
                        print(f"step {step}/{total}: loss over the last {stop_window} steps {window:.4f} "
                              f"<= {stop_below}, stopping", flush=True)
                        stopped = True
                        break
    with torch.no_grad():
        full_w[torch.tensor(used)] = compact.detach()
    model.eval()
    return losses


# --------------------------------------------------------------------------------------------------
# Evaluation against the real environment
# --------------------------------------------------------------------------------------------------


def _load(model_dir: str | os.PathLike[str]) -> tuple[Any, Any]:
    _tok._offline_env()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype="float32").eval()
    return model, tok


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` within the block, restored after it."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _policy(model_dir: str | os.PathLike[str] | None, pool: Any) -> tuple[Any, Any, Any]:
    """The evaluated model, its tokenizer and the pool: the warm start and :func:`learning_pool` by default."""
    model, tok = _load(model_dir if model_dir is not None else ensure_warm_model())
    return model, tok, pool if pool is not None else learning_pool()


def _split_test(pool: Any, n: int, seed: int) -> list[str]:
    ids = list(pool.task_ids("test"))
    random.Random(f"{seed}:eval").shuffle(ids)
    return ids[:n] if n else ids


def _default_limits() -> Any:
    from envace.agents.engine import LoopLimits

    return LoopLimits(max_user_turns=2, max_steps_per_turn=4, max_calls_per_message=2, max_observation_chars=1000)


@dataclass(frozen=True)
class EvalSettings:
    """The rules the warm start is evaluated under: those of the CPU default run's RL validation
    (``configs/experiment/cpu_default.yaml``: ``envace.agent.limits`` / ``act_max_tokens`` / ``rehearse_max_tokens`` /
    ``env_timeout_s``, ``data.max_prompt_length`` / ``max_response_length``, ``rollout.max_model_len``), so the
    success printed here is the metric validation reports on the same model and tasks
    (tests/envace/models/test_eval_parity.py keeps the two equal)."""

    limits: Any = field(default_factory=_default_limits)  # envace.agents.engine.LoopLimits
    act_max_tokens: int | None = 64  # tokens one acting message may generate
    rehearse_max_tokens: int = 64  # tokens one rehearsal may generate
    response_length: int = 320  # the acting context's growth over all turns (verl's rollout.response_length)
    prompt_length: int = 1024  # prompts are cut to their last prompt_length tokens (verl's rollout.prompt_length)
    max_model_len: int = 1344  # prompt + generation (the rollout server's context window)
    env_timeout_s: float = 60.0  # one environment call or verification (then: infrastructure)


def _episode_seed(seed: int, task_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{task_id}".encode()).digest()[:8], "little") >> 1


def token_policy(tok: Any, generate: Any, temperature: float, settings: EvalSettings | None = None,
                 logprobs: bool = False) -> Any:
    """The token-level policy training runs (:class:`~envace.agents.token_policy.TokenPolicy`: continuous tokens,
    the response budget, per-message token caps), with ``generate`` plugged in and verl's sampling parameters at
    ``temperature`` (top-p 1, top-k off)."""
    from envace.agents.token_policy import BuilderTokenContext, TokenPolicy

    s = settings if settings is not None else EvalSettings()
    context = BuilderTokenContext(tok, hf_model_type="qwen3", chat_template_kwargs=_TEMPLATE_KW,
                                  prompt_length=s.prompt_length)
    sampling = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": logprobs}
    return TokenPolicy(context, generate, lambda ids: tok.decode(ids, skip_special_tokens=True), sampling=sampling,
                       budget=s.response_length, act_max_tokens=s.act_max_tokens,
                       rehearse_max_tokens=s.rehearse_max_tokens)


def run_episodes(model: Any, tok: Any, pool: Any, task_ids: Sequence[str], temperature: float, seed: int = 0,
                 settings: EvalSettings | None = None, max_rows: int = 32) -> list[dict[str, Any]]:
    """Roll out ``task_ids`` against the real environment through the turn engine, as RL validation does: the
    engine (:class:`~envace.agents.engine.TurnEngine`) with ``settings.limits``, the token-level policy training
    runs (:func:`token_policy`) over an in-process decoder (:class:`~envace.models.decoder.LocalDecoder`, up to
    ``max_rows`` rollouts decoding together), the real environment's source
    (:class:`~envace.agents.sources.RealSource`: the tool bounds, errors as observations) and the one scoring
    path (:func:`envace.rewards.score.score_episode`: the verifier whatever the stop reason).

    Each rollout samples from its own generator, seeded by ``seed`` and its task id, so a task's rollout does not
    depend on which others run beside it. Per task: ``reward``, ``stop`` (the engine's stop reason), the
    transcript's counters and ``generations`` (each generation's prompt and response ids). A rollout that could not
    be judged raises :class:`~envace.rewards.llm.InfrastructureError` (nothing here retries it)."""
    import asyncio

    import torch

    from envace.agents.engine import TurnEngine
    from envace.agents.sources import RealSource
    from envace.models.decoder import LocalDecoder
    from envace.rewards.llm import InfrastructureError
    from envace.rewards.score import score_episode

    s = settings if settings is not None else EvalSettings()

    async def one(decoder: LocalDecoder, slots: asyncio.Semaphore, tid: str) -> dict[str, Any]:
        async with slots:
            episode = await asyncio.to_thread(pool.start, tid)
            generator = torch.Generator().manual_seed(_episode_seed(seed, tid))
            policy = token_policy(tok, decoder.generate_with(generator), temperature, s)
            t = await TurnEngine(s.limits).run(episode, policy, RealSource(timeout_s=s.env_timeout_s))
            score = await score_episode(episode, t, timeout_s=s.env_timeout_s)
        if score.masked:
            raise InfrastructureError(f"task {tid} could not be scored: {score.reason}")
        return {"reward": score.reward, "stop": t.stop_reason, **t.counters(),
                "generations": [(g.prompt_ids, g.response_ids) for g in policy.generations]}

    async def main() -> list[dict[str, Any]]:
        decoder = LocalDecoder(model, max_model_len=s.max_model_len, max_rows=max_rows)
        slots = asyncio.Semaphore(max(1, max_rows))
        return list(await asyncio.gather(*(one(decoder, slots, tid) for tid in task_ids)))

    return asyncio.run(main())


def learning_pool(cfg: WarmStartConfig | None = None) -> Any:
    """The pool the warm start trains on (``cfg.pool`` with ``cfg.pool_kwargs``; default: ``LEARNING_POOL_KWARGS``)."""
    from envace.envs.base import get_pool

    cfg = cfg if cfg is not None else DEFAULT_CONFIG
    return get_pool(cfg.pool, **dict(cfg.pool_kwargs))


def evaluate_policy(model_dir: str | os.PathLike[str] | None = None, n_tasks: int = 64, temperature: float = 1.0,
                    seed: int = 0, pool: Any = None, verbose: bool = False, threads: int = 1,
                    per_category: bool = False, settings: EvalSettings | None = None) -> Any:
    """Mean reward of the model acting on ``n_tasks`` held-out (test split) tasks of ``pool``, under RL
    validation's rules (:func:`run_episodes`, ``settings``: the CPU default run's by default).

    ``pool`` defaults to :func:`learning_pool` (the ``synthetic`` pool with :data:`LEARNING_POOL_KWARGS`).
    With ``per_category`` the result is ``{"success": mean, "tasks": n, "per_category": {category: mean}}``.
    """
    model, tok, pool = _policy(model_dir, pool)
    tids = _split_test(pool, n_tasks, seed)
    with _torch_threads(threads):
        episodes = run_episodes(model, tok, pool, tids, temperature, seed, settings)
    rewards: list[float] = []
    by_cat: dict[str, list[float]] = {}
    for tid, r in zip(tids, episodes, strict=True):
        rewards.append(r["reward"])
        by_cat.setdefault(pool.task(tid).category, []).append(r["reward"])
        if verbose:
            print(tid, pool.task(tid).category, {k: v for k, v in r.items() if k != "generations"}, flush=True)
    mean = sum(rewards) / max(1, len(rewards))
    if per_category:
        return {"success": mean, "tasks": len(rewards),
                "per_category": {c: round(sum(v) / len(v), 4) for c, v in sorted(by_cat.items())}}
    return mean


def task_success(task_ids: Sequence[str], samples: int, model_dir: str | os.PathLike[str] | None = None,
                 temperature: float = 1.0, seed: int = 0, pool: Any = None, threads: int = 1,
                 settings: EvalSettings | None = None) -> dict[str, float]:
    """Each task's success rate over ``samples`` rollouts of the model acting in the real environment
    (:func:`run_episodes`; sample ``s`` of every task uses seed ``seed + s``). Learnability sampling reads it: a task
    the policy solves sometimes but not always (0 < p < 1) gives GRPO groups with reward variance."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    model, tok, pool = _policy(model_dir, pool)
    wins = dict.fromkeys(task_ids, 0.0)
    with _torch_threads(threads):
        for s in range(samples):
            for tid, r in zip(task_ids, run_episodes(model, tok, pool, list(task_ids), temperature, seed + s,
                                                     settings), strict=True):
                wins[tid] += r["reward"]
    return {tid: w / samples for tid, w in wins.items()}


def evaluate_rehearsal(model_dir: str | os.PathLike[str] | None = None, n_tasks: int = 32, temperature: float = 0.0,
                       seed: int = 0, pool: Any = None, max_history_chars: int = 1500,
                       max_new_tokens: int = 128) -> dict[str, float]:
    """Format-valid and exact-match rates of the model's rehearsals of held-out gold calls: the rehearsal prompt
    of :func:`~envace.agents.sources.rehearsal_messages` (no examples), generated by the token-level policy's
    REHEARSE role (the tokens training's rehearsals see) over the in-process decoder, at most ``max_new_tokens``
    tokens each."""
    import asyncio

    import torch

    from envace.agents.engine import Role
    from envace.agents.sources import (
        RehearsalFormatError,
        RehearsalPrompt,
        fidelity,
        parse_rehearsal,
        rehearsal_messages,
    )
    from envace.models.decoder import LocalDecoder

    model, tok, pool = _policy(model_dir, pool)
    settings = dataclasses.replace(EvalSettings(), rehearse_max_tokens=max_new_tokens)
    counts = [0, 0, 0]  # calls, format-valid, exact

    async def main() -> None:
        decoder = LocalDecoder(model, max_model_len=settings.max_model_len, max_rows=1)
        policy = token_policy(tok, decoder.generate_with(torch.Generator().manual_seed(seed)), temperature, settings)
        for tid in _split_test(pool, n_tasks, seed):
            _, calls = act_examples(pool, tid, tok)
            tools = pool.task(tid).tools
            for call, history, obs in calls:
                msgs = rehearsal_messages(call, history, tools, cfg=RehearsalPrompt(max_history_chars=max_history_chars))
                text = (await policy.respond(msgs, None, Role.REHEARSE)).text
                counts[0] += 1
                try:
                    result = parse_rehearsal(text)
                except RehearsalFormatError:
                    continue
                counts[1] += 1
                counts[2] += int(fidelity(result, obs)["exact"])

    with _torch_threads(1):
        asyncio.run(main())
    n, valid, exact = counts
    return {"calls": float(n), "valid": valid / max(1, n), "exact": exact / max(1, n)}


# --------------------------------------------------------------------------------------------------
# Cached build
# --------------------------------------------------------------------------------------------------


def default_warm_dir() -> Path:
    return _tiny.default_cache_dir() / "models" / WARM_NAME


def warm_recipe(cfg: WarmStartConfig = DEFAULT_CONFIG) -> dict[str, Any]:
    return {"warm_recipe_version": WARM_RECIPE_VERSION, "base": _tiny.recipe(cfg.spec), "train": cfg.recipe()}


def warm_recipe_hash(cfg: WarmStartConfig = DEFAULT_CONFIG) -> str:
    blob = json.dumps(warm_recipe(cfg), sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def is_warm_complete(path: str | os.PathLike[str], cfg: WarmStartConfig = DEFAULT_CONFIG, verify: bool = False) -> bool:
    path = Path(path)
    try:
        manifest = json.loads((path / _tiny.MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("recipe_hash") != warm_recipe_hash(cfg):
        return False
    return _tiny.files_intact(path, manifest.get("files"), verify)


def _build_into(out: Path, cfg: WarmStartConfig, log_every: int = 25) -> dict[str, Any]:
    """Random init (tiny recipe) → SFT → save into ``out``; manifest written last. Returns the manifest."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envace.envs.base import get_pool

    t0 = time.time()
    _tiny.build_tiny_model(out, cfg.spec)
    (out / _tiny.MANIFEST_NAME).unlink()
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype="float32")
    pool = get_pool(cfg.pool, **dict(cfg.pool_kwargs))
    tids = list(pool.task_ids("train"))
    if cfg.max_train_tasks:
        tids = random.Random(f"{cfg.seed}:tasks").sample(tids, min(cfg.max_train_tasks, len(tids)))
    examples = build_examples(pool, tids, tok, cfg)
    if cfg.copy_drills:
        examples += copy_drill_examples(tok, cfg.copy_drills, cfg.seed)
    drills = copy_drill_examples(tok, _PHASE1_DRILLS, cfg.seed + 1) if cfg.drill_steps else []
    t_data = time.time() - t0
    print(f"warm start: {len(examples)} examples from {len(tids)} train tasks "
          f"({sum(len(e.ids) for e in examples)} tokens, {sum(sum(e.labels) for e in examples)} targets) in {t_data:.0f}s",
          flush=True)
    common: dict[str, Any] = {"warmup_steps": cfg.warmup_steps, "weight_decay": cfg.weight_decay,
                              "grad_clip": cfg.grad_clip, "negatives": cfg.negatives, "log_every": log_every,
                              "threads": cfg.threads}
    drill_losses = train_sft(model, drills, max_steps=cfg.drill_steps, lr=cfg.drill_lr, seed=cfg.seed + 1,
                             decay=False, stop_below=cfg.drill_target_loss, stop_window=cfg.drill_window,
                             batch_tokens=cfg.drill_batch_tokens, **common) if drills else []
    drill_final = _window_mean(drill_losses, cfg.drill_window) if drill_losses else None
    drill_formed = drill_final <= cfg.drill_target_loss if drill_final is not None else None
    if drill_formed is False:
        print(f"warm start: WARNING the drill loss is still {drill_final:.3f} after "
              f"{len(drill_losses)} steps (target {cfg.drill_target_loss}): the copying circuit did not form and the "
              f"model will guess argument values", flush=True)
    losses = train_sft(model, examples, epochs=cfg.epochs, max_steps=cfg.max_steps, lr=cfg.lr, seed=cfg.seed,
                       batch_tokens=cfg.batch_tokens, **common)
    t_train = time.time() - t0 - t_data
    with _tiny._no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
    tenth = max(1, len(losses) // 10)
    head, tail = losses[:tenth], losses[-tenth:]
    files = {}
    for f in sorted(out.iterdir()):
        if f.is_file() and f.name != _tiny.MANIFEST_NAME:
            os.chmod(f, 0o644)
            files[f.name] = {"size": f.stat().st_size, "sha256": _tiny.file_sha256(f)}
    import transformers

    manifest = {
        "name": WARM_NAME,
        "recipe_hash": warm_recipe_hash(cfg),
        "recipe": warm_recipe(cfg),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "train": {
            "examples": len(examples),
            "act_examples": sum(e.kind == "act" for e in examples),
            "rehearse_examples": sum(e.kind == "rehearse" for e in examples),
            "drill_examples": sum(e.kind == "drill" for e in examples),
            "drill_steps": len(drill_losses),
            "drill_final_loss": round(drill_final, 4) if drill_final is not None else None,
            "drill_formed": drill_formed,
            "steps": len(losses),
            "first_loss": round(sum(head) / len(head), 4) if losses else None,
            "final_loss": round(sum(tail) / len(tail), 4) if losses else None,
            "data_seconds": round(t_data, 1),
            "train_seconds": round(t_train, 1),
        },
        "build_seconds": round(time.time() - t0, 2),
        "files": files,
    }
    return manifest


def _write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    tmp = out / (_tiny.MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / _tiny.MANIFEST_NAME)


def build_warm_start(
    out_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    cfg: WarmStartConfig = DEFAULT_CONFIG,
    evaluate: bool = True,
) -> Path:
    """Return the warm-started checkpoint directory, building it first if missing or stale (deterministic).

    ``out_dir`` defaults to ``$ENVACE_CACHE/models/tiny-qwen3-warm``; ``force`` rebuilds a complete one.
    A fresh build prints its held-out success (``cfg.eval_tasks`` test tasks, temperature 1.0), which
    is also recorded in the manifest.
    """
    return _ensure_warm(out_dir, force=force, cfg=cfg, evaluate=evaluate)[0]


def _ensure_warm(out_dir: str | os.PathLike[str] | None, *, force: bool = False, cfg: WarmStartConfig = DEFAULT_CONFIG,
                 evaluate: bool = True) -> tuple[Path, bool]:
    _tok._offline_env()
    final = (Path(out_dir).expanduser() if out_dir is not None else default_warm_dir()).absolute()
    if not force and is_warm_complete(final, cfg):
        return final, False
    with _tiny._build_lock(final):
        if not force and is_warm_complete(final, cfg):
            return final, False
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.build-", dir=final.parent))
        try:
            manifest = _build_into(tmp, cfg)
            if evaluate and cfg.eval_tasks:
                t0 = time.time()
                ev = evaluate_policy(tmp, n_tasks=cfg.eval_tasks, temperature=1.0, seed=cfg.seed, pool=learning_pool(cfg),
                                     threads=cfg.threads,
                                     per_category=True)
                success = ev["success"]
                manifest["heldout_success"] = {"tasks": ev["tasks"], "temperature": 1.0, "success": success,
                                               "per_category": ev["per_category"], "seconds": round(time.time() - t0, 1)}
                print(f"warm start: held-out success {success:.3f} on {ev['tasks']} test tasks (T=1.0) "
                      f"{ev['per_category']}", flush=True)
            manifest["build_seconds_total"] = round(manifest["build_seconds"] + manifest.get("heldout_success", {}).get("seconds", 0), 1)
            _write_manifest(tmp, manifest)
            os.chmod(tmp, 0o755)
            _tiny._install(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final, True


def ensure_warm_model(path: str | os.PathLike[str] | None = None, *, force: bool = False) -> Path:
    """The warm-started checkpoint directory (``$ENVACE_CACHE/models/tiny-qwen3-warm``), built if needed."""
    return build_warm_start(path, force=force)
