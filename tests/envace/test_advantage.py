"""Role-wise GRPO advantage (EnvACE §4.2): hand-computed cases, verl equivalence, a loop reference."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos

import envace.advantage as adv_mod
from envace.advantage import compute_rolewise_advantage

EPS = 1e-6


def batch(scores, resp_len=4, dtype=torch.float64):
    """token_level_rewards with each row's score on its last response token, and an all-ones mask."""
    scores = torch.as_tensor(scores, dtype=dtype)
    rewards = torch.zeros(len(scores), resp_len, dtype=dtype)
    rewards[:, -1] = scores
    return rewards, torch.ones(len(scores), resp_len, dtype=torch.int64)


def row_adv(scores, index, roles, **kw):
    """Per-row advantages (first token) of compute_rolewise_advantage on a batch built from ``scores``."""
    rewards, mask = batch(scores)
    adv, ret = compute_rolewise_advantage(rewards, mask, np.array(index, dtype=object), roles, **kw)
    assert adv.shape == rewards.shape and torch.equal(adv, ret)
    # Broadcast: the same value on every response token.
    torch.testing.assert_close(adv, adv[:, :1].expand_as(adv))
    return adv[:, 0].tolist()


def approx(values, rel=1e-9, abs=1e-9):
    return pytest.approx(values, rel=rel, abs=abs)


# --------------------------------------------------------------------------- hand-computed cases

# One prompt, two rollouts. Trajectory A (R=1): 3 ACT outputs, 1 REHEARSE output.
# Trajectory B (R=0): 1 ACT output, 2 REHEARSE outputs.
CASE_SCORES = [1, 1, 1, 0, 1, 0, 0]
CASE_ROLES = ["act", "act", "act", "act", "rehearse", "rehearse", "rehearse"]
CASE_TRAJ = ["A", "A", "A", "B", "A", "B", "B"]
CASE_INDEX = ["p"] * 7


def case(**kw):
    return row_adv(CASE_SCORES, CASE_INDEX, np.array(CASE_ROLES, dtype=object), traj_index=np.array(CASE_TRAJ), **kw)


def test_output_baseline_is_row_weighted_per_role():
    # act: mean(1,1,1,0) = 0.75; rehearse: mean(1,0,0) = 1/3.
    assert case() == approx([0.25, 0.25, 0.25, -0.75, 2 / 3, -1 / 3, -1 / 3])


def test_trajectory_baseline_averages_each_rollout_first():
    # act: per-trajectory means A=1, B=0 -> baseline 0.5 (not 0.75 as above);
    # rehearse: A=1, B=mean(0,0)=0 -> 0.5.
    assert case(baseline="trajectory") == approx([0.5, 0.5, 0.5, -0.5, 0.5, -0.5, -0.5])


def test_norm_by_std_output_baseline():
    # act: std(1,1,1,0; ddof=1) = 0.5; rehearse: std(1,0,0) = sqrt(1/3).
    s = math.sqrt(1 / 3)
    expected = [0.25 / (0.5 + EPS)] * 3 + [
        -0.75 / (0.5 + EPS),
        (2 / 3) / (s + EPS),
        (-1 / 3) / (s + EPS),
        (-1 / 3) / (s + EPS),
    ]
    assert case(norm_by_std=True) == approx(expected)


def test_norm_by_std_trajectory_baseline():
    # Both roles: members (1, 0) -> std sqrt(1/2).
    s = math.sqrt(0.5)
    a, b = 0.5 / (s + EPS), -0.5 / (s + EPS)
    assert case(baseline="trajectory", norm_by_std=True) == approx([a, a, a, b, a, b, b])


def test_epsilon_is_added_to_std():
    # act: std 0.5, eps 0.5 -> divide by 1.
    assert case(norm_by_std=True, epsilon=0.5)[:4] == approx([0.25, 0.25, 0.25, -0.75])


def test_norm_off_is_default_and_matches_plain_difference():
    assert case() == case(norm_by_std=False)


def test_all_equal_group_gives_exact_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point; the all-equal group must still give exactly 0.
    for norm in (False, True):
        assert row_adv([0.1, 0.1, 0.1], ["p"] * 3, ["act"] * 3, norm_by_std=norm) == [0.0, 0.0, 0.0]


def test_singleton_zero_and_raw():
    # Prompt "p": one ACT output (score 2) -> singleton; two REHEARSE outputs.
    scores, index, roles = [2.0, 3.0, 1.0], ["p"] * 3, ["act", "rehearse", "rehearse"]
    assert row_adv(scores, index, roles) == approx([0.0, 1.0, -1.0])  # default singleton="zero"
    assert row_adv(scores, index, roles, singleton="zero") == approx([0.0, 1.0, -1.0])
    assert row_adv(scores, index, roles, singleton="raw") == approx([2.0, 1.0, -1.0])
    # raw with norm: verl's mean 0, std 1 -> 2 / (1 + eps).
    s = math.sqrt(2)
    assert row_adv(scores, index, roles, singleton="raw", norm_by_std=True) == approx(
        [2 / (1 + EPS), 1 / (s + EPS), -1 / (s + EPS)]
    )
    assert row_adv(scores, index, roles, singleton="zero", norm_by_std=True) == approx(
        [0.0, 1 / (s + EPS), -1 / (s + EPS)]
    )


def test_singleton_counts_trajectories_under_trajectory_baseline():
    # One rollout with two ACT outputs of different scores (an empty one penalised): under the output
    # baseline that is a group of 2; under the trajectory baseline a group of 1 (one trajectory).
    kw = {"traj_index": np.array([7, 7]), "empty": np.array([False, True]), "empty_penalty": 1.0}
    assert row_adv([1.0, 1.0], ["p", "p"], ["act", "act"], **kw) == approx([0.5, -0.5])
    assert row_adv([1.0, 1.0], ["p", "p"], ["act", "act"], baseline="trajectory", **kw) == approx([0.0, 0.0])
    # raw: mean 0, std 1 -> each output's own score.
    assert row_adv([1.0, 1.0], ["p", "p"], ["act", "act"], baseline="trajectory", singleton="raw", **kw) == approx(
        [1.0, 0.0]
    )


def test_trajectory_baseline_advantage_uses_the_outputs_own_score():
    # Trajectory A: ACT outputs 1 (empty, penalty 1 -> 0) and 1; trajectory B: ACT output 0.
    # Units: A = mean(0, 1) = 0.5, B = 0 -> baseline 0.25.
    adv = row_adv(
        [1, 1, 0],
        ["p"] * 3,
        ["act"] * 3,
        traj_index=np.array(["A", "A", "B"]),
        empty=np.array([True, False, False]),
        empty_penalty=1.0,
        baseline="trajectory",
    )
    assert adv == approx([-0.25, 0.75, -0.25])


def test_empty_penalty_applied_before_baseline():
    # Scores 1, 1, 0 with the first empty, penalty 0.5 -> 0.5, 1, 0; mean 0.5.
    kw = {"empty": np.array([True, False, False])}
    assert row_adv([1, 1, 0], ["p"] * 3, ["act"] * 3, empty_penalty=0.5, **kw) == approx([0.0, 0.5, -0.5])
    # Default penalty 0: the flag alone changes nothing.
    assert row_adv([1, 1, 0], ["p"] * 3, ["act"] * 3, **kw) == approx([1 / 3, 1 / 3, -2 / 3])
    # A torch bool tensor works as well.
    assert row_adv(
        [1, 1, 0], ["p"] * 3, ["act"] * 3, empty_penalty=0.5, empty=torch.tensor([True, False, False])
    ) == approx([0.0, 0.5, -0.5])


@pytest.mark.parametrize("bad", [5.0, float("nan"), float("inf")])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("baseline", ["output", "trajectory"])
def test_invalid_rows_get_zero_and_do_not_move_baselines(bad, norm, baseline):
    scores = [1.0, bad, 0.0, 2.0, 4.0]
    index = ["p", "p", "p", "q", "q"]
    roles = ["act"] * 5
    traj = np.arange(5)
    valid = np.array([True, False, True, True, True])
    got = row_adv(scores, index, roles, traj_index=traj, valid=valid, norm_by_std=norm, baseline=baseline)
    keep = valid.nonzero()[0]
    ref = row_adv(
        [scores[i] for i in keep],
        [index[i] for i in keep],
        ["act"] * 4,
        traj_index=traj[keep],
        norm_by_std=norm,
        baseline=baseline,
    )
    assert got[1] == 0.0
    assert [got[i] for i in keep] == approx(ref)
    assert got[0] == approx(0.5 / ((math.sqrt(0.5) + EPS) if norm else 1.0))


def test_invalid_rows_can_make_a_group_singleton_or_empty():
    valid = torch.tensor([True, False, False])
    assert row_adv([3.0, 1.0, 2.0], ["p"] * 3, ["act"] * 3, valid=valid) == [0.0, 0.0, 0.0]
    assert row_adv([3.0, 1.0, 2.0], ["p"] * 3, ["act"] * 3, valid=valid, singleton="raw") == approx([3.0, 0.0, 0.0])
    assert row_adv([3.0, 1.0], ["p"] * 2, ["act"] * 2, valid=[False, False], singleton="raw") == [0.0, 0.0]


@pytest.mark.parametrize("baseline", ["output", "trajectory"])
@pytest.mark.parametrize("norm", [False, True])
def test_integer_role_codes_match_strings(baseline, norm):
    kw = {"traj_index": np.array(CASE_TRAJ), "baseline": baseline, "norm_by_std": norm}
    codes = [0 if r == "act" else 1 for r in CASE_ROLES]
    by_str = row_adv(CASE_SCORES, CASE_INDEX, np.array(CASE_ROLES), **kw)
    assert row_adv(CASE_SCORES, CASE_INDEX, np.array(codes), **kw) == by_str
    assert row_adv(CASE_SCORES, CASE_INDEX, torch.tensor(codes), **kw) == by_str
    assert row_adv(CASE_SCORES, CASE_INDEX, codes, **kw) == by_str  # plain list
    assert row_adv(CASE_SCORES, CASE_INDEX, list(CASE_ROLES), **kw) == by_str
    # A mix of codes and names in one object array: 0 and "act" are the same role.
    mixed = np.array([c if i % 2 else r for i, (c, r) in enumerate(zip(codes, CASE_ROLES))], dtype=object)
    assert row_adv(CASE_SCORES, CASE_INDEX, mixed, **kw) == by_str
    # Any hashable labels work (grouping only).
    assert row_adv(CASE_SCORES, CASE_INDEX, [("r", c) for c in codes], **kw) == by_str


@pytest.mark.parametrize("baseline", ["output", "trajectory"])
@pytest.mark.parametrize("norm", [False, True])
def test_two_prompts_do_not_mix(baseline, norm):
    kw = {"baseline": baseline, "norm_by_std": norm}
    other_scores = [5.0, -1.0, 2.0, 0.0]
    other_roles = ["act", "act", "rehearse", "rehearse"]
    other_traj = ["A", "B", "A", "B"]  # the same trajectory ids as prompt "p": keyed per prompt
    alone_p = case(**kw)
    alone_q = row_adv(other_scores, ["q"] * 4, other_roles, traj_index=np.array(other_traj), **kw)
    # Interleave the two prompts' rows.
    rows = [("p", s, r, t) for s, r, t in zip(CASE_SCORES, CASE_ROLES, CASE_TRAJ)]
    rows += [("q", s, r, t) for s, r, t in zip(other_scores, other_roles, other_traj)]
    order = [0, 7, 1, 8, 2, 9, 3, 10, 4, 5, 6]
    rows = [rows[i] for i in order]
    together = row_adv(
        [r[1] for r in rows],
        [r[0] for r in rows],
        [r[2] for r in rows],
        traj_index=np.array([r[3] for r in rows]),
        **kw,
    )
    got_p = [a for a, r in zip(together, rows) if r[0] == "p"]
    got_q = [a for a, r in zip(together, rows) if r[0] == "q"]
    assert got_p == approx(alone_p) and got_q == approx(alone_q)


def test_score_is_sum_over_tokens_and_mask_applies():
    rewards = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float32)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv, _ = compute_rolewise_advantage(rewards, mask, np.array(["p", "p"], dtype=object), ["act", "act"])
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]]))


def test_bad_options_raise():
    rewards, mask = batch([1.0, 0.0])
    idx = np.array(["p", "p"], dtype=object)
    with pytest.raises(ValueError, match="baseline"):
        compute_rolewise_advantage(rewards, mask, idx, ["act"] * 2, baseline="prompt")
    with pytest.raises(ValueError, match="singleton"):
        compute_rolewise_advantage(rewards, mask, idx, ["act"] * 2, singleton="one")
    with pytest.raises(ValueError, match="traj_index"):
        compute_rolewise_advantage(rewards, mask, idx, ["act"] * 2, baseline="trajectory")
    with pytest.raises(ValueError, match="roles"):
        compute_rolewise_advantage(rewards, mask, idx, ["act"] * 3)
    with pytest.raises(ValueError, match="valid"):
        compute_rolewise_advantage(rewards, mask, idx, ["act"] * 2, valid=[True])


@pytest.mark.parametrize("baseline", ["output", "trajectory"])
def test_empty_batch(baseline):
    rewards, mask = torch.zeros(0, 3), torch.zeros(0, 3)
    adv, ret = compute_rolewise_advantage(
        rewards, mask, np.array([], dtype=object), [], traj_index=np.array([]), baseline=baseline
    )
    assert adv.shape == (0, 3) and ret.shape == (0, 3)


# --------------------------------------------------------------------------- verl equivalence


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_single_role_one_output_per_trajectory_equals_verl_grpo(seed, norm, binary):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 6, size=12)
    index = np.array([f"uid-{g}" for g, k in enumerate(sizes) for _ in range(k)], dtype=object)
    rng.shuffle(index)
    bs, resp_len = len(index), 6
    scores = rng.integers(0, 2, size=bs).astype(np.float32) if binary else rng.normal(size=bs).astype(np.float32)
    # Spread each score over two response tokens (the score is the row sum), ragged masks.
    rewards = torch.zeros(bs, resp_len)
    rewards[:, 0] = torch.from_numpy(scores) * 0.25
    rewards[:, 3] = torch.from_numpy(scores) * 0.75
    lengths = torch.from_numpy(rng.integers(4, resp_len + 1, size=bs))
    mask = (torch.arange(resp_len)[None, :] < lengths[:, None]).to(torch.int64)

    expected, expected_ret = core_algos.compute_grpo_outcome_advantage(
        rewards.clone(), mask, index, norm_adv_by_std_in_grpo=norm
    )
    got, got_ret = compute_rolewise_advantage(
        rewards,
        mask,
        index,
        np.array(["act"] * bs, dtype=object),
        traj_index=np.arange(bs),
        baseline="output",
        singleton="raw",
        norm_by_std=norm,
    )
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_ret, expected_ret)
    # One output per trajectory: the trajectory baseline is the same thing.
    got_traj, _ = compute_rolewise_advantage(
        rewards,
        mask,
        index,
        ["act"] * bs,
        traj_index=np.arange(bs),
        baseline="trajectory",
        singleton="raw",
        norm_by_std=norm,
    )
    torch.testing.assert_close(got_traj, expected)


# --------------------------------------------------------------------------- loop reference


def reference(scores, index, roles, traj, valid, empty, *, baseline, norm_by_std, epsilon, singleton, empty_penalty):
    """Straight from the formula: dicts of group members, then (R - mean) / (std + eps)."""
    names = {0: "act", 1: "rehearse"}
    role = [names.get(r, r) if isinstance(r, int) else r for r in roles]
    score = [s - empty_penalty if e else s for s, e in zip(scores, empty)]
    members = defaultdict(list)
    if baseline == "output":
        for j in range(len(score)):
            if valid[j]:
                members[(index[j], role[j])].append(score[j])
    else:
        per_traj = defaultdict(list)
        for j in range(len(score)):
            if valid[j]:
                per_traj[(index[j], role[j], traj[j])].append(score[j])
        for (i, r, _t), vals in per_traj.items():
            members[(i, r)].append(sum(vals) / len(vals))
    out = []
    for j in range(len(score)):
        if not valid[j]:
            out.append(0.0)
            continue
        group = members[(index[j], role[j])]
        if len(group) == 1:
            if singleton == "zero":
                out.append(0.0)
                continue
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        a = score[j] - mean
        out.append(a / (std + epsilon) if norm_by_std else a)
    return out


score_values = st.one_of(
    st.sampled_from([0.0, 1.0, 0.5, -1.0, 2.0]),
    st.floats(-3, 3, allow_nan=False, allow_infinity=False),
)


@st.composite
def rollouts(draw):
    """Rows of a batch: prompts x K rollouts x several outputs, each with a role, valid and empty flag."""
    rows = []
    global_traj = draw(st.booleans())  # trajectory ids unique over the batch, or reused across prompts
    for p in range(draw(st.integers(1, 3))):
        for k in range(draw(st.integers(1, 4))):
            reward = draw(score_values)
            per_output = draw(st.booleans())  # outputs of a rollout may also carry different scores
            for _ in range(draw(st.integers(1, 4))):
                rows.append(
                    {
                        "index": f"uid{p}",
                        "traj": f"{p}-{k}" if global_traj else k,
                        "role": draw(st.sampled_from([0, 1])),
                        "score": draw(score_values) if per_output else reward,
                        "valid": draw(st.integers(0, 3)) > 0,  # mostly valid
                        "empty": draw(st.booleans()),
                    }
                )
    order = draw(st.permutations(range(len(rows))))
    return [rows[i] for i in order]


@settings(max_examples=300, deadline=None)
@given(
    rows=rollouts(),
    role_style=st.sampled_from(["str", "int", "torch", "list-int", "mixed"]),
    baseline=st.sampled_from(["output", "trajectory"]),
    norm_by_std=st.booleans(),
    singleton=st.sampled_from(["zero", "raw"]),
    empty_penalty=st.sampled_from([0.0, 0.5, 2.0]),
    epsilon=st.sampled_from([1e-6, 0.1]),
    mask_style=st.sampled_from(["numpy", "torch", "none"]),
)
def test_matches_loop_reference(rows, role_style, baseline, norm_by_std, singleton, empty_penalty, epsilon, mask_style):
    codes = [r["role"] for r in rows]
    names = ["act" if c == 0 else "rehearse" for c in codes]
    roles = {
        "str": np.array(names, dtype=object),
        "int": np.array(codes),
        "torch": torch.tensor(codes),
        "list-int": codes,
        "mixed": np.array([c if i % 3 == 0 else n for i, (c, n) in enumerate(zip(codes, names))], dtype=object),
    }[role_style]
    valid = [r["valid"] for r in rows]
    empty = [r["empty"] for r in rows]
    if mask_style == "none":  # defaults: all valid, none empty
        valid, empty = [True] * len(rows), [False] * len(rows)
        valid_arg = empty_arg = None
    elif mask_style == "torch":
        valid_arg, empty_arg = torch.tensor(valid), torch.tensor(empty)
    else:
        valid_arg, empty_arg = np.array(valid), np.array(empty)
    # Invalid rows carry garbage scores; they must not leak anywhere.
    scores = [r["score"] if v else float("nan") for r, v in zip(rows, valid)]
    index = np.array([r["index"] for r in rows], dtype=object)
    traj = np.array([r["traj"] for r in rows], dtype=object)
    options = {
        "baseline": baseline,
        "norm_by_std": norm_by_std,
        "singleton": singleton,
        "empty_penalty": empty_penalty,
        "epsilon": epsilon,
    }

    rewards, mask = batch(scores, resp_len=3)
    got, _ = compute_rolewise_advantage(rewards, mask, index, roles, traj, valid_arg, empty_arg, **options)
    expected = reference(scores, list(index), codes, list(traj), valid, empty, **options)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got[:, 0], torch.tensor(expected, dtype=torch.float64), rtol=1e-7, atol=1e-7)


# --------------------------------------------------------------------------- verl's call signature


def test_estimator_with_verls_call_signature_matches():
    """The function verl's registry hands its trainer (envace/verl/extensions.py registers it), called as verl
    calls an estimator, equals :func:`compute_rolewise_advantage`."""
    fn = adv_mod.rolewise_adv_estimator
    rewards, mask = batch(CASE_SCORES)
    index = np.array(CASE_INDEX, dtype=object)
    roles = np.array(CASE_ROLES, dtype=object)
    traj = np.array(CASE_TRAJ)
    for norm in (False, True):
        direct, _ = compute_rolewise_advantage(
            rewards, mask, index, roles, traj, norm_by_std=norm, baseline="trajectory"
        )
        # norm_by_std from the config (dict or verl's AlgoConfig) when not passed explicitly.
        for config in ({"norm_adv_by_std_in_grpo": norm}, AlgoConfig(norm_adv_by_std_in_grpo=norm)):
            via, ret = fn(
                token_level_rewards=rewards,
                response_mask=mask,
                config=config,
                index=index,
                roles=roles,
                traj_index=traj,
                baseline="trajectory",
            )
            torch.testing.assert_close(via, direct)
            torch.testing.assert_close(ret, direct)
        # An explicit option wins over the config.
        via, _ = fn(
            rewards,
            mask,
            config={"norm_adv_by_std_in_grpo": not norm},
            index=index,
            roles=roles,
            traj_index=traj,
            baseline="trajectory",
            norm_by_std=norm,
        )
        torch.testing.assert_close(via, direct)
    # verl's default when the config lacks the key is True; without a config the function's default (False).
    via, _ = fn(rewards, mask, config={}, index=index, roles=roles)
    torch.testing.assert_close(via, compute_rolewise_advantage(rewards, mask, index, roles, norm_by_std=True)[0])
    via, _ = fn(rewards, mask, index=index, roles=roles, valid=None, empty=None, reward_baselines=None)
    torch.testing.assert_close(via, compute_rolewise_advantage(rewards, mask, index, roles)[0])


def test_estimator_without_roles_raises_clear_error():
    rewards, mask = batch([1.0, 0.0])
    fn = adv_mod.rolewise_adv_estimator
    with pytest.raises(ValueError, match="needs role labels"):
        fn(
            token_level_rewards=rewards,
            response_mask=mask,
            config=AlgoConfig(),
            index=np.array(["p", "p"], dtype=object),
        )


def test_role_labels_context_supplies_what_verl_does_not_pass():
    """verl calls the registered estimator with index only; the trainer's context supplies the rest."""
    from envace.advantage import role_labels

    fn = adv_mod.rolewise_adv_estimator
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.ones(4, 3)
    index = np.array(["p", "p", "p", "p"], dtype=object)
    roles = np.array(["act", "act", "rehearse", "rehearse"], dtype=object)
    with role_labels(roles, traj_index=np.array(["a", "b", "a", "b"], dtype=object),
                     valid=np.array([True, True, True, False]), options={"norm_by_std": False}):
        adv, _ = fn(token_level_rewards=rewards, response_mask=mask, config={"norm_adv_by_std_in_grpo": True},
                    index=index)
    # act: 1 - 0.5, 0 - 0.5; rehearse: one valid member -> singleton zero; the invalid row 0
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    with pytest.raises(ValueError, match="role labels"):
        fn(token_level_rewards=rewards, response_mask=mask, config=None, index=index)
    with role_labels(roles[:3]), pytest.raises(ValueError, match="cover 3 rows"):
        fn(token_level_rewards=rewards, response_mask=mask, config=None, index=index)


# --------------------------------------------------------------------------- edges found by mutation testing


def test_explicit_arguments_win_over_the_role_labels_context():
    from envace.advantage import role_labels

    fn = adv_mod.rolewise_adv_estimator
    rewards, mask = batch(CASE_SCORES)
    index = np.array(CASE_INDEX, dtype=object)
    roles = np.array(CASE_ROLES, dtype=object)
    traj = np.array(CASE_TRAJ)
    other_roles = ["act"] * 7  # one group: differs from the context's two roles
    with role_labels(roles, traj_index=traj, options={"norm_by_std": True, "baseline": "trajectory"}):
        # an explicit option wins over the context's options (and the context still supplies the labels)
        via, _ = fn(rewards, mask, config=None, index=index, norm_by_std=False)
        want, _ = compute_rolewise_advantage(rewards, mask, index, roles, traj, baseline="trajectory")
        torch.testing.assert_close(via, want)
        # explicit roles: the context (labels and options) is not used at all
        via, _ = fn(rewards, mask, config=None, index=index, roles=other_roles)
        torch.testing.assert_close(via, compute_rolewise_advantage(rewards, mask, index, other_roles)[0])
    # the context ends with the block
    with pytest.raises(ValueError, match="needs role labels"):
        fn(rewards, mask, config=None, index=index)


def test_numpy_integer_codes_and_bool_labels_in_object_arrays():
    scores, index = [1.0, 0.0, 3.0, 0.0], ["p"] * 4
    by_name = row_adv(scores, index, np.array(["act", "rehearse", "act", "rehearse"], dtype=object))
    codes = np.array([np.int64(0), "rehearse", "act", np.int32(1)], dtype=object)  # numpy integers are codes too
    assert row_adv(scores, index, codes) == by_name == [-1.0, 0.0, 1.0, 0.0]
    # a bool is a label of its own, not the role code 1 (True == 1 in Python)
    assert row_adv(scores, index, np.array([True, 1, True, 1], dtype=object)) == [-1.0, 0.0, 1.0, 0.0]
    assert row_adv(scores, index, np.array([True, "rehearse", True, "rehearse"], dtype=object)) == [-1.0, 0.0, 1.0, 0.0]


def test_wrong_lengths_name_the_argument():
    rewards, mask = batch([1.0, 0.0, 2.0])
    idx = np.array(["p"] * 3, dtype=object)
    with pytest.raises(ValueError, match="index has 2 entries, expected 3"):
        compute_rolewise_advantage(rewards, mask, np.array(["p", "p"], dtype=object), ["act"] * 3)
    with pytest.raises(ValueError, match="roles has 4 entries, expected 3"):
        compute_rolewise_advantage(rewards, mask, idx, [("a", 1)] * 4)  # hashable labels (a 2-D array)
    with pytest.raises(ValueError, match="traj_index has 2 entries, expected 3"):
        compute_rolewise_advantage(rewards, mask, idx, ["act"] * 3, traj_index=np.array([0, 1]), baseline="trajectory")
    with pytest.raises(ValueError, match="empty has 4 entries, expected 3"):
        compute_rolewise_advantage(rewards, mask, idx, ["act"] * 3, empty=[False] * 4)
    with pytest.raises(ValueError, match="valid has 1 entries, expected 3"):
        compute_rolewise_advantage(rewards, mask, idx, ["act"] * 3, valid=np.array([True]))


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float64])
def test_advantages_take_the_rewards_dtype_whatever_the_mask(mask_dtype):
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float32)
    mask = torch.ones(2, 2, dtype=mask_dtype)
    adv, ret = compute_rolewise_advantage(rewards, mask, np.array(["p", "p"], dtype=object), ["act", "act"])
    assert adv.dtype == ret.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5], [-0.5, -0.5]]))


def test_column_shaped_masks_are_flattened():
    scores, index, roles = [3.0, 1.0, 2.0, 0.0], ["p"] * 4, ["act"] * 4
    valid, empty = [True, True, False, True], [False, True, False, False]
    flat = row_adv(scores, index, roles, valid=valid, empty=empty, empty_penalty=1.0)
    assert flat == approx([2.0, -1.0, 0.0, -1.0])  # scores 3, 0 (penalised), -, 0: mean 1
    column = row_adv(scores, index, roles, valid=torch.tensor(valid).unsqueeze(-1),
                     empty=np.array(empty).reshape(-1, 1), empty_penalty=1.0)
    assert column == flat


def test_other_integer_labels_are_labels_of_their_own():
    """Only 0 and 1 are role codes; any other integer is a label of its own (not merged with a role or with
    its string form)."""
    scores, index = [1.0, 0.0, 3.0, 0.0, 5.0, 7.0], ["p"] * 6
    ints = [0, 2, 0, 2, 3, 3]  # groups {0, 2}, {1, 3}, {4, 5}
    want = [-1.0, 0.0, 1.0, 0.0, -1.0, 1.0]
    assert row_adv(scores, index, np.array(ints)) == want
    assert row_adv(scores, index, np.array(["act", 2, "act", 2, 3, 3], dtype=object)) == want
    assert row_adv(scores, index, np.array([0, 2, "act", 2, "3", "3"], dtype=object)) == want
    # 2 and "2" are different labels (group means 2 and 3; merged, their mean would be 2.5)
    mixed = np.array([2, "2", 2, "2", "act", 0], dtype=object)
    assert row_adv([1.0, 4.0, 3.0, 2.0, 5.0, 7.0], index, mixed) == [-1.0, 1.0, 1.0, -1.0, -1.0, 1.0]


def test_estimator_without_index_raises_clear_error():
    rewards, mask = batch([1.0, 0.0])
    fn = adv_mod.rolewise_adv_estimator
    with pytest.raises(ValueError, match="needs index"):
        fn(token_level_rewards=rewards, response_mask=mask, config=None, roles=["act", "act"])


def test_trained_roles_zero_the_other_roles_and_leave_the_trained_roles_baselines_alone():
    rewards = torch.tensor([[1.0], [0.0], [1.0], [0.0], [0.5], [0.5]])
    mask = torch.ones(6, 1)
    index = np.array(["p"] * 6, dtype=object)
    roles = np.array(["act", "act", "rehearse", "rehearse", "act", "rehearse"], dtype=object)
    both, _ = compute_rolewise_advantage(rewards, mask, index, roles)
    act_only, _ = compute_rolewise_advantage(rewards, mask, index, roles, trained_roles=["act"])
    is_act = torch.tensor([r == "act" for r in roles])
    assert torch.equal(act_only[is_act], both[is_act])  # the act baseline is unchanged
    assert torch.count_nonzero(act_only[~is_act]) == 0 and torch.count_nonzero(both[~is_act]) > 0
    codes, _ = compute_rolewise_advantage(rewards, mask, index, np.array([0, 0, 1, 1, 0, 1]), trained_roles=["act"])
    assert torch.equal(codes, act_only)  # integer role codes select alike
