"""Role-wise GRPO advantage (EnvACE §4.2, role-wise advantage).

For a prompt ``x`` the policy produces ``K`` rollouts ``τ_1..τ_K`` with trajectory rewards
``R_i``. Every policy output ``y_{i,m}`` of rollout ``i`` (each ACT message and each REHEARSE
response is its own row of the batch) has a role ``r ∈ {act, rehearse}`` and inherits ``R_i``.
The baseline of an output is computed over the outputs *of the same role* across the ``K``
rollouts of the same prompt::

    A_{i,m} = (R_i − mean_{G(x, r)}) / (std_{G(x, r)} + ε)        G(x, r) = outputs of prompt x, role r

(without the division when ``norm_by_std`` is False). Outputs of both roles then update one
shared policy; this module only computes the advantages.

Options of :func:`compute_rolewise_advantage`:

* the row's score is ``token_level_rewards.sum(-1)`` (as verl's GRPO), minus ``empty_penalty``
  when the row is flagged ``empty`` (decoded to empty text); the penalty is applied before the
  baselines (as the reference's invalid-action penalty), so it moves them.
* ``valid`` — rows whose reward failed (verifier/judge error) are left out of every mean and
  std and get advantage 0 (a NaN score on such a row is harmless).
* ``baseline="output"`` (paper) — mean/std over the valid outputs of the (prompt, role) group,
  one member per output (long rollouts weigh more).
  ``baseline="trajectory"`` — first average each trajectory's valid same-role scores (needs
  ``traj_index``), then take mean/std over those per-trajectory averages, so a rollout with many
  outputs counts once. Each output's advantage is still its own score minus that baseline.
* ``norm_by_std`` — divide by the group std (unbiased, ddof=1, like ``torch.std``) plus
  ``epsilon``; the EnvACE reference launches with False. A group whose members are all equal
  has mean exactly equal to them, hence advantage 0.
* ``singleton`` — a group with one member (one output, or one trajectory in the trajectory
  baseline): ``"zero"`` gives advantage 0; ``"raw"`` uses verl's convention mean 0, std 1, so the
  advantage is the raw score (divided by ``1 + ε`` when normalising).

With a single role, one output per trajectory, ``baseline="output"`` and ``singleton="raw"`` this
is verl's ``compute_grpo_outcome_advantage``.

Under an asynchronous trainer (``trainer.v1.trainer_mode=envace_colocate_async`` and the like) a group may span
policy versions: its K rollouts are generated together but each turn on whatever weights the server holds then, and
verl trains a group only whole (its replay buffer samples by prompt uid once all K have finished). The baseline is
still formed over the whole (prompt, role) group, whatever the versions, as verl's own GRPO and its fully-async recipe
do: splitting the group by version would leave singletons, whose advantage is 0, and lose most of the signal at small
K. How far each rollout lags is corrected per token by verl's rollout correction (importance weights or the bypass
loss, act and rehearse tokens alike) and bounded by ``trainer.v1.sampler.max_off_policy_threshold``; the trainer
reports how many versions a group spans (``envace/groups/version_span_*``, :mod:`envace.verl.trainer`).

This module is the math only; it imports no verl. Roles are :class:`envace.roles.Role` (the one role enum) from the
agent loop to here; the estimator also takes their names or integer codes, turned into roles in one place
(:func:`_canonical_roles`), and groups any other hashable label as a role of its own.
:func:`envace.verl.extensions.register_rolewise_estimator` registers :func:`rolewise_adv_estimator` in verl's
advantage-estimator registry as ``grpo_rolewise`` (in the TaskRunner process, before verl looks the estimator up).
verl 0.9.1 calls a registered estimator with ``index`` only; envace's trainer (:mod:`envace.verl.trainer`) supplies
the role labels, trajectory ids, validity and emptiness of the batch it is computing through :func:`role_labels`, a
context the estimator reads when they are not passed explicitly.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from envace.roles import Role

__all__ = [
    "ESTIMATOR_NAME",
    "compute_rolewise_advantage",
    "role_labels",
    "rolewise_adv_estimator",
]

ESTIMATOR_NAME = "grpo_rolewise"
_LABELS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("envace_role_labels", default=None)
BASELINES = ("output", "trajectory")
SINGLETONS = ("zero", "raw")


def _to_numpy(values: Any) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    return np.asarray(values)


def _factorize(values: Any, n: int, what: str) -> np.ndarray:
    """Integer codes ``0..k-1`` such that rows with equal labels share a code."""
    arr = _to_numpy(values)
    if arr.ndim == 1 and len(arr) == n:
        try:
            return np.unique(arr, return_inverse=True)[1].reshape(-1).astype(np.int64)
        except TypeError:  # unorderable mix of labels (e.g. str and None): hash them instead
            items = arr.tolist()
    else:  # e.g. a list of tuples turned into a 2-D array
        items = list(values)
    if len(items) != n:
        raise ValueError(f"{what} has {len(items)} entries, expected {n} (one per row)")
    codes: dict[Any, int] = {}
    return np.fromiter((codes.setdefault(v, len(codes)) for v in items), dtype=np.int64, count=n)


def _canonical_roles(roles: Any) -> Any:
    """Each row's grouping label: a :class:`~envace.roles.Role`, its name or its integer code (0 or 1; a ``bool`` is
    not a code) becomes the role — the one place the estimator turns its input into the role type, so names, codes
    and roles group alike — and any other hashable label stays a group of its own."""
    arr = _to_numpy(roles)
    if arr.ndim != 1:  # e.g. a list of tuples: labels of their own, as given
        return roles
    out = np.empty(len(arr), dtype=object)
    for i, value in enumerate(arr.tolist()):
        out[i] = _role_or_label(value.item() if isinstance(value, np.generic) else value)
    return out


def _role_or_label(value: Any) -> Any:
    try:
        return Role.parse(value)
    except ValueError:
        return value


def _bool_mask(mask: Any, n: int, default: bool, what: str) -> np.ndarray:
    if mask is None:
        return np.full(n, default, dtype=bool)
    arr = _to_numpy(mask).astype(bool).reshape(-1)
    if len(arr) != n:
        raise ValueError(f"{what} has {len(arr)} entries, expected {n} (one per row)")
    return arr


def _group_stats(group: np.ndarray, value: np.ndarray, member: np.ndarray, n_groups: int):
    """Count, mean and unbiased std of ``value[member]`` per ``group`` (vectorised)."""
    w = member.astype(np.float64)
    v = np.where(member, value, 0.0)
    count = np.bincount(group, weights=w, minlength=n_groups)
    safe = np.maximum(count, 1.0)
    mean = np.bincount(group, weights=v, minlength=n_groups) / safe
    # All-equal groups: use the common value itself so that their advantages are exactly 0.
    lo = np.full(n_groups, np.inf)
    hi = np.full(n_groups, -np.inf)
    np.minimum.at(lo, group[member], value[member])
    np.maximum.at(hi, group[member], value[member])
    mean = np.where(lo == hi, lo, mean)
    sq = np.bincount(group, weights=w * (v - mean[group]) ** 2, minlength=n_groups)
    std = np.sqrt(sq / np.maximum(count - 1.0, 1.0))
    return count, mean, std


def compute_rolewise_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    roles: np.ndarray | torch.Tensor | Sequence,
    traj_index: np.ndarray | None = None,
    valid: np.ndarray | torch.Tensor | None = None,
    empty: np.ndarray | torch.Tensor | None = None,
    *,
    baseline: str = "output",
    norm_by_std: bool = False,
    epsilon: float = 1e-6,
    singleton: str = "zero",
    empty_penalty: float = 0.0,
    trained_roles: Sequence[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Role-wise GRPO advantage, EnvACE §4.2: ``A = (R − mean_{prompt, role}) / (std_{prompt, role} + ε)``.

    Args:
        token_level_rewards: ``[bs, resp_len]``; a row's score is its sum over tokens.
        response_mask: ``[bs, resp_len]``; the advantage is broadcast over the row times this mask.
        index: ``[bs]`` prompt-group uid.
        roles: ``[bs]`` roles: :class:`~envace.roles.Role`, their names (``"act"``/``"rehearse"``) or integer
            codes (0=act, 1=rehearse), or any other hashable label (a group of its own).
        traj_index: ``[bs]`` rollout id (within or across prompts); required for
            ``baseline="trajectory"``.
        valid: ``[bs]`` bool, False where the reward failed: such rows join no baseline or std
            and get advantage 0. Default: all valid.
        empty: ``[bs]`` bool, True where the output decoded to empty text. Default: none.
        baseline: ``"output"`` (mean/std over the role's outputs) or ``"trajectory"`` (over the
            per-trajectory averages of the role's outputs).
        norm_by_std: divide by the group std + ``epsilon``.
        epsilon: added to the std.
        singleton: for a one-member group, ``"zero"`` (advantage 0) or ``"raw"`` (mean 0, std 1).
        empty_penalty: subtracted from the score of ``empty`` rows before the baselines.
        trained_roles: role names whose rows keep their advantage; the other roles' rows get 0, so they carry no
            policy-gradient loss (an ablation: EnvACE without the rehearse role's loss). Default: every role.

    Returns:
        ``(advantages, returns)``, both ``[bs, resp_len]`` and equal, as verl's GRPO.
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    if singleton not in SINGLETONS:
        raise ValueError(f"singleton must be one of {SINGLETONS}, got {singleton!r}")
    if baseline == "trajectory" and traj_index is None:
        raise ValueError('baseline="trajectory" needs traj_index (the rollout id of every row)')

    scores_t = token_level_rewards.sum(dim=-1)
    n = scores_t.shape[0]
    valid_np = _bool_mask(valid, n, True, "valid")
    empty_np = _bool_mask(empty, n, False, "empty")
    scores = scores_t.detach().to(torch.float64).cpu().numpy() - empty_penalty * empty_np
    scores = np.where(valid_np, scores, 0.0)  # a failed reward may be NaN

    # One group per (prompt, role): the rows whose baseline is shared.
    prompt_code = _factorize(index, n, "index")
    roles = _canonical_roles(roles)
    role_code = _factorize(roles, n, "roles")
    keys = np.stack([prompt_code, role_code], axis=1)
    if n:
        group_of_key, group = np.unique(keys, axis=0, return_inverse=True)
        n_groups = len(group_of_key)
    else:
        group, n_groups = np.zeros(0, dtype=np.int64), 0
    group = group.reshape(-1)

    if baseline == "output":
        count, mean, std = _group_stats(group, scores, valid_np, n_groups)
    else:  # one member per (prompt, role, trajectory): the average of its valid scores
        traj_code = _factorize(traj_index, n, "traj_index")
        unit_keys, unit = np.unique(np.stack([group, traj_code], axis=1), axis=0, return_inverse=True)
        unit = unit.reshape(-1)
        n_units = len(unit_keys)
        unit_count = np.bincount(unit, weights=valid_np.astype(np.float64), minlength=n_units)
        unit_score = np.bincount(unit, weights=scores, minlength=n_units) / np.maximum(unit_count, 1.0)
        count, mean, std = _group_stats(unit_keys[:, 0], unit_score, unit_count > 0, n_groups)

    is_singleton = count == 1
    if singleton == "raw":
        mean = np.where(is_singleton, 0.0, mean)
        std = np.where(is_singleton, 1.0, std)
    adv = scores - mean[group]
    if norm_by_std:
        adv = adv / (std[group] + epsilon)
    keep = valid_np & ~(is_singleton[group] & (singleton == "zero"))
    if trained_roles is not None:
        kept = {_role_or_label(r) for r in trained_roles}
        keep &= np.array([role in kept for role in roles], dtype=bool)
    adv = np.where(keep, adv, 0.0)

    adv_t = torch.as_tensor(adv, dtype=token_level_rewards.dtype, device=token_level_rewards.device)
    advantages = adv_t.unsqueeze(-1) * response_mask.to(token_level_rewards.dtype)
    return advantages, advantages


def rolewise_adv_estimator(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    index: np.ndarray | None = None,
    reward_baselines: torch.Tensor | None = None,
    roles: Any = None,
    traj_index: Any = None,
    valid: Any = None,
    empty: Any = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl estimator ``grpo_rolewise``: :func:`compute_rolewise_advantage` with verl's call signature.

    ``options`` are the keyword options of :func:`compute_rolewise_advantage`; ``norm_by_std``
    defaults to ``config.get("norm_adv_by_std_in_grpo", True)`` when ``config`` is given.
    ``reward_baselines`` is accepted for signature compatibility and unused.
    """
    labels = _LABELS.get()
    if roles is None and labels is not None:
        n = int(token_level_rewards.shape[0])
        if len(labels["roles"]) != n:
            raise ValueError(f"role labels cover {len(labels['roles'])} rows but the batch has {n}")
        roles, traj_index, valid, empty = labels["roles"], labels["traj_index"], labels["valid"], labels["empty"]
        options = {**labels["options"], **options}
    if roles is None:
        raise ValueError(
            f"advantage estimator {ESTIMATOR_NAME!r} needs role labels (roles=[bs] 'act'/'rehearse' per row); "
            "verl's generic compute_advantage does not pass them, the envace trainer supplies them"
        )
    if index is None:
        raise ValueError(f"advantage estimator {ESTIMATOR_NAME!r} needs index (the prompt-group uid of every row)")
    if config is not None and "norm_by_std" not in options:
        options["norm_by_std"] = bool(config.get("norm_adv_by_std_in_grpo", True))
    return compute_rolewise_advantage(
        token_level_rewards, response_mask, index, roles, traj_index, valid, empty, **options
    )


@contextlib.contextmanager
def role_labels(
    roles: Any,
    traj_index: Any = None,
    valid: Any = None,
    empty: Any = None,
    options: Mapping[str, Any] | None = None,
) -> Iterator[None]:
    """Within this block, :func:`rolewise_adv_estimator` called without ``roles`` uses these labels
    (one per batch row, in batch order) and ``options`` (keyword options of
    :func:`compute_rolewise_advantage`; explicit keyword arguments still win)."""
    token = _LABELS.set(
        {"roles": roles, "traj_index": traj_index, "valid": valid, "empty": empty, "options": dict(options or {})}
    )
    try:
        yield
    finally:
        _LABELS.reset(token)
