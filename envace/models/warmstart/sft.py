"""Supervised fine-tuning over a compact vocabulary: the token ids the examples use plus a fixed sample of the
other ids, whose log-sum-exp is rescaled to stand for all of them (sampled softmax)."""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

from envace.models import tiny as _tiny
from envace.models import tokenizer as _tok
from envace.models.warmstart.examples import SFTExample


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` within the block, restored after it."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


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
    anneal_steps: int = 0,
) -> list[float]:
    """Fine-tune ``model`` (a tied-embedding Qwen3ForCausalLM, in place) on ``examples``; per-step losses.

    The softmax covers the ids occurring in ``examples`` plus ``negatives`` other ids drawn once
    (their log-sum-exp is shifted by ``log(#others / negatives)``); only those rows are trained.
    The learning rate warms up linearly over ``warmup_steps``, then decays linearly to 5 % at the last step
    (``decay``) or stays constant. With ``stop_below`` > 0 training ends early, at the first step where the
    mean loss of the last ``stop_window`` steps is at most ``stop_below``.

    ``anneal_steps`` > 0 (with a constant rate) makes the budget's last ``anneal_steps`` steps a linear anneal to
    5 % of ``lr``: a run that ``stop_below`` has not ended by then settles at a falling rate instead of going on at
    a rate too high for its noise.
    """
    if anneal_steps and decay:
        raise ValueError("anneal_steps needs a constant rate (decay=False)")
    with torch_threads(threads):
        return _train(model, examples, epochs, max_steps, batch_tokens, lr, warmup_steps, weight_decay, grad_clip,
                      negatives, seed, log_every, decay, stop_below, stop_window, anneal_steps)


def window_mean(losses: Sequence[float], window: int) -> float:
    """Mean of the last ``window`` losses (all of them when fewer)."""
    tail = losses[-window:]
    return sum(tail) / len(tail)


def _train(model: Any, examples: Sequence[SFTExample], epochs: int, max_steps: int, batch_tokens: int, lr: float,
           warmup_steps: int, weight_decay: float, grad_clip: float, negatives: int, seed: int,
           log_every: int, decay: bool = True, stop_below: float = 0.0, stop_window: int = 50,
           anneal_steps: int = 0) -> list[float]:
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
    anneal_start = max(0, total - anneal_steps) if anneal_steps else math.inf

    def factor(s: int) -> float:
        if decay:
            tail = max(0.05, 1 - s / max(1, total))
        else:
            tail = max(0.05, 1 - (s - anneal_start) / anneal_steps) if s >= anneal_start else 1.0
        return min(1.0, (s + 1) / max(1, warmup_steps)) * tail

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
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
                    window = window_mean(losses, stop_window)
                    if window <= stop_below:
                        print(f"step {step}/{total}: loss over the last {stop_window} steps {window:.4f} "
                              f"<= {stop_below}, stopping", flush=True)
                        stopped = True
                        break
    with torch.no_grad():
        full_w[torch.tensor(used)] = compact.detach()
    model.eval()
    return losses
