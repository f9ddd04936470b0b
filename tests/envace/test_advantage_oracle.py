"""Role-wise GRPO (EnvACE §4.2) against a plain loop oracle, through the path the trainer takes.

``tests/envace/test_advantage.py::test_matches_loop_reference`` compares the per-row advantage of
:func:`compute_rolewise_advantage` with a loop reference over hypothesis-drawn batches.  This file checks what
that one does not: the whole ``[bs, resp_len]`` output of the estimator registered as verl's ``grpo_rolewise``
(:func:`envace.advantage.rolewise_adv_estimator`, as ``compute_advantage`` calls it: ``index`` only, the roles,
rollout ids, validity and emptiness from the trainer's :func:`envace.advantage.role_labels` context, ``norm_by_std``
from ``norm_adv_by_std_in_grpo``), with rewards spread over several tokens, padded response masks, float32 and
float64, several prompts, both roles, invalid and empty outputs, and both baselines.

The oracle is the paper's definition: every output y_{i,m} of rollout i inherits R_i (here: its row's summed
token rewards, less the empty penalty); its baseline is taken over the outputs of the same prompt and the same
role across the K rollouts (for ``baseline="trajectory"``: over the per-rollout averages of those outputs);
A = (R - mean) / (std + eps) with the unbiased std, or R - mean without normalisation; the advantage is put on
every response token of the output.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from envace.advantage import role_labels, rolewise_adv_estimator


def oracle(rewards, mask, index, roles, traj, valid, empty, *, baseline, norm_by_std, epsilon, singleton, empty_penalty):
    """Plain loops over rows and tokens; returns a list of per-token lists."""
    bs, T = len(rewards), len(rewards[0])
    R = []
    for j in range(bs):
        total = 0.0
        for k in range(T):
            total += rewards[j][k]
        R.append(total - (empty_penalty if empty[j] else 0.0))
    groups: dict[tuple, list[float]] = {}
    if baseline == "output":
        for j in range(bs):
            if valid[j]:
                groups.setdefault((index[j], roles[j]), []).append(R[j])
    else:
        per_rollout: dict[tuple, list[float]] = {}
        for j in range(bs):
            if valid[j]:
                per_rollout.setdefault((index[j], roles[j], traj[j]), []).append(R[j])
        for (p, r, _), vals in per_rollout.items():
            groups.setdefault((p, r), []).append(sum(vals) / len(vals))
    out = []
    for j in range(bs):
        a = 0.0
        if valid[j]:
            g = groups[(index[j], roles[j])]
            if len(g) > 1 or singleton == "raw":
                mean = sum(g) / len(g) if len(g) > 1 else 0.0
                std = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1)) if len(g) > 1 else 1.0
                a = (R[j] - mean) / (std + epsilon) if norm_by_std else R[j] - mean
        out.append([a * mask[j][k] for k in range(T)])
    return out


def random_batch(rng: np.random.Generator, n_prompts: int, K: int):
    """Rows of a shuffled batch: each rollout emits 1-4 outputs with random roles; some invalid or empty."""
    rows = []
    for p in range(n_prompts):
        for k in range(K):
            R = float(rng.choice([0.0, 1.0, rng.integers(-4, 9) / 4]))  # dyadic: exact in float32 too
            for _ in range(int(rng.integers(1, 5))):
                rows.append((f"uid{p}", ("act", "rehearse")[int(rng.integers(2))], f"{p}/{k}", R, rng.random() > 0.15, rng.random() < 0.2))
    rows = [rows[i] for i in rng.permutation(len(rows))]
    T = 5
    lengths = rng.integers(1, T + 1, size=len(rows))
    mask = [[1 if k < n else 0 for k in range(T)] for n in lengths]
    rewards = []
    for (_, _, _, R, _, _), m in zip(rows, mask):
        # the score spread over the real tokens in eighths (verl sums token_level_rewards over the row); the
        # parts and their sums are exact in float32, so equal scores stay equal (a group of equal scores has
        # std 0, and rounding noise divided by std + eps would be noise, not a difference of the two)
        parts = rng.multinomial(8, np.ones(sum(m)) / sum(m)) * R / 8
        rewards.append([float(parts[k]) if m[k] else 0.0 for k in range(T)])
    cols = list(zip(*rows))
    return rewards, mask, list(cols[0]), list(cols[1]), list(cols[2]), list(cols[4]), list(cols[5])


CASES = [
    {"baseline": "output", "norm_by_std": True, "epsilon": 1e-6, "singleton": "zero", "empty_penalty": 0.0},
    {"baseline": "output", "norm_by_std": False, "epsilon": 1e-6, "singleton": "raw", "empty_penalty": 0.5},
    {"baseline": "trajectory", "norm_by_std": True, "epsilon": 0.05, "singleton": "raw", "empty_penalty": 1.0},
    {"baseline": "trajectory", "norm_by_std": False, "epsilon": 1e-6, "singleton": "zero", "empty_penalty": 0.25},
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("opts", CASES, ids=lambda o: f"{o['baseline']}-norm{int(o['norm_by_std'])}-{o['singleton']}")
def test_registered_estimator_equals_the_loop_oracle(opts, dtype):
    fn = rolewise_adv_estimator
    rng = np.random.default_rng(CASES.index(opts))
    for trial in range(12):
        rewards, mask, index, roles, traj, valid, empty = random_batch(rng, n_prompts=int(rng.integers(1, 4)), K=int(rng.integers(2, 6)))
        rewards_t = torch.tensor(rewards, dtype=dtype)
        mask_t = torch.tensor(mask, dtype=torch.int64)
        # NaN where the reward failed: an invalid row's score must reach nothing
        rewards_t[~torch.tensor(valid), 0] = float("nan")
        options = {k: v for k, v in opts.items() if k != "norm_by_std"}
        with role_labels(np.array(roles, dtype=object), traj_index=np.array(traj, dtype=object), valid=np.array(valid), empty=np.array(empty), options=options):
            adv, ret = fn(token_level_rewards=rewards_t, response_mask=mask_t, config={"norm_adv_by_std_in_grpo": opts["norm_by_std"]}, index=np.array(index, dtype=object))
        expected = oracle(rewards, mask, index, roles, traj, valid, empty, **opts)
        tol = 1e-9 if dtype == torch.float64 else 2e-5
        assert adv.dtype == dtype and torch.equal(adv, ret)
        torch.testing.assert_close(adv.double(), torch.tensor(expected, dtype=torch.float64), rtol=tol, atol=tol, msg=lambda m, trial=trial: f"trial {trial}: {m}")


def test_the_oracle_separates_roles():
    """The oracle (and so the comparison) can fail: pooling both roles into one baseline gives other values."""
    rng = np.random.default_rng(11)
    rewards, mask, index, roles, traj, valid, empty = random_batch(rng, n_prompts=2, K=4)
    opts = CASES[0]
    rolewise = oracle(rewards, mask, index, roles, traj, valid, empty, **opts)
    pooled = oracle(rewards, mask, index, ["one"] * len(roles), traj, valid, empty, **opts)
    assert len(set(roles)) == 2 and rolewise != pooled
    fn = rolewise_adv_estimator
    rewards_t, mask_t = torch.tensor(rewards, dtype=torch.float64), torch.tensor(mask)
    with role_labels(np.array(roles, dtype=object), traj_index=np.array(traj, dtype=object), valid=np.array(valid), empty=np.array(empty), options={"empty_penalty": 0.0}):
        adv, _ = fn(token_level_rewards=rewards_t, response_mask=mask_t, config={"norm_adv_by_std_in_grpo": True}, index=np.array(index, dtype=object))
    torch.testing.assert_close(adv, torch.tensor(rolewise, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    assert not torch.allclose(adv, torch.tensor(pooled, dtype=torch.float64))
