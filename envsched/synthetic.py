"""Synthetic task pools and a simulated learner, for tests and benchmarks (no LLM, no environment).

``synthetic_records(n_envs, tasks_per_env)`` writes pools in the JSONL record format: each environment has
its own domain vocabulary and tools, each task follows one of a few structural archetypes (lookup ->
update, authorize -> lookup -> delete -> create, ...) so that within-environment and cross-environment
similarities are both meaningful.

``SimulatedLearner`` gives each task a latent difficulty (environment + archetype + task noise) and a
success probability sigmoid(skill - difficulty); training on a task raises the skill of its environment
(most), of its archetype (cross-environment transfer) and globally (a little).  Group rewards are partial
credit over the task's verifier checks, so within-group variance is highest for tasks near the learner's
frontier — the situation EnvSched is designed for.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

_DOMAINS = [
    ("policy", "coverage", "claim", "deductible", "insurer"), ("patient", "bed", "ward", "allergy", "clinic"),
    ("order", "shipment", "warehouse", "invoice", "carrier"), ("booking", "room", "guest", "stay", "hotel"),
    ("course", "student", "grade", "enrollment", "campus"), ("account", "card", "transfer", "balance", "branch"),
    ("ticket", "agent", "incident", "priority", "queue"), ("donor", "appointment", "slot", "facility", "drive"),
    ("vehicle", "driver", "route", "depot", "trip"), ("project", "task", "sprint", "member", "board"),
    ("expense", "approver", "receipt", "report", "budget"), ("session", "participant", "meeting", "calendar", "host"),
    ("listing", "seller", "bid", "auction", "lot"), ("recipe", "ingredient", "menu", "kitchen", "chef"),
    ("license", "applicant", "exam", "board", "permit"), ("mood", "entry", "journal", "tracker", "member"),
]
_ADJ = ["active", "pending", "closed", "primary", "urgent", "standard", "premium", "archived", "temporary", "verified"]
_NAMES = ["Ana Ruiz", "Carolyn Ho", "Marta Fong", "Li Wei", "Omar Haddad", "Priya Nair", "Jon Berg", "Sara Kim", "Tom Lutz", "Ines Vidal"]

# archetypes: sequence of (verb, object slot) — object slot indexes the domain tuple
ARCHETYPES = [
    [("get", 0, "name"), ("update", 0, "id")],
    [("verify", 1, "id"), ("get", 0, "name"), ("update", 2, "id"), ("update", 0, "id")],
    [("get", 0, "id"), ("remove", 2, "id"), ("add", 2, "id")],
    [("check", 3, "id"), ("create", 0, "id")],
    [("list", 1, None), ("get", 0, "name"), ("assign", 1, "id")],
    [("get", 0, "name"), ("get", 1, "id"), ("transfer", 0, "id"), ("update", 3, "id"), ("check", 0, "id")],
    [("authorize", 4, "id"), ("get", 0, "id"), ("cancel", 2, "id")],
    [("search", 2, None), ("update", 2, "id"), ("update", 2, "id"), ("delete", 1, "id")],
]


def synthetic_records(n_envs: int, tasks_per_env: int, seed: int = 0, text_words: int = 18) -> list[dict[str, Any]]:
    """Pool records (JSONL format) for ``n_envs`` x ``tasks_per_env`` tasks."""
    return list(iter_synthetic_records(n_envs, tasks_per_env, seed, text_words))


def iter_synthetic_records(n_envs: int, tasks_per_env: int, seed: int = 0, text_words: int = 18) -> Iterator[dict[str, Any]]:
    """The records of ``synthetic_records``, one at a time (a million-task pool without the list of dicts)."""
    rng = np.random.default_rng(seed)
    for e in range(n_envs):
        dom = _DOMAINS[e % len(_DOMAINS)]
        suffix = "" if e < len(_DOMAINS) else f"{e // len(_DOMAINS)}"
        words = [w + suffix for w in dom]
        tools = {}
        for arch in ARCHETYPES:
            for verb, slot, key in arch:
                name = f"{verb}_{words[slot]}" + (f"_by_{key}" if key == "name" else "")
                params = {"properties": {f"{words[slot]}_{key}": {"type": "string"}}} if key else {"properties": {}}
                tools[name] = {"name": name, "description": f"{verb} a {words[slot]} record", "parameters": params}
        env_id = f"env_{e:04d}"
        for k in range(tasks_per_env):
            a = int(rng.integers(len(ARCHETYPES)))
            arch = ARCHETYPES[a]
            person = _NAMES[int(rng.integers(len(_NAMES)))]
            ids = [f"{w[:3].upper()}-{int(rng.integers(10000, 99999))}" for w in words]
            actions, checks = [], []
            for verb, slot, key in arch:
                name = f"{verb}_{words[slot]}" + (f"_by_{key}" if key == "name" else "")
                args = {f"{words[slot]}_{key}": (person if key == "name" else ids[slot])} if key else {}
                actions.append({"name": name, "arguments": args})
                if verb not in ("get", "list", "search"):
                    checks.append(f"{words[slot]} {ids[slot]} is {_ADJ[int(rng.integers(len(_ADJ)))]} after {verb}")
            extra = " ".join(rng.choice(list(words) + _ADJ, size=max(text_words - 10, 2)))
            instr = f"As {person}, {arch[-1][0]} the {words[arch[-1][1]]} {ids[arch[-1][1]]} and {arch[0][0]} the {words[arch[0][1]]}; {extra}."
            code = "\n".join(f"assert db['{words[s]}']['{ids[s]}'].status == '{_ADJ[(s + k) % len(_ADJ)]}'" for _, s, _k in arch if _k)
            yield {
                "task_id": f"{env_id}-task_{k}", "env_id": env_id, "instruction": instr,
                "initial_state": f"{words[0]} {ids[0]} owned by {person}; {words[1]} {ids[1]} {_ADJ[k % len(_ADJ)]}",
                "tools": list(tools.values()), "verifier_checks": checks or [f"{words[0]} unchanged"], "verifier_code": code,
                "gold_actions": actions, "meta": {"archetype": a},
            }


@dataclass
class SimulatedLearner:
    """Latent-difficulty learner whose success probability rises on what it is trained on."""

    env: np.ndarray
    archetype: np.ndarray
    n_checks: np.ndarray
    seed: int = 0
    lr_env: float = 0.02
    lr_arch: float = 0.005
    lr_global: float = 0.0005
    lr_task: float = 0.05

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        n_env, n_arch = int(self.env.max()) + 1, int(self.archetype.max()) + 1
        self.env_difficulty = rng.normal(0.0, 1.2, n_env)
        self.arch_difficulty = rng.normal(0.0, 0.8, n_arch)
        self.difficulty = self.env_difficulty[self.env] + self.arch_difficulty[self.archetype] + rng.normal(0.0, 0.9, len(self.env)) + 0.8
        self.skill_env = np.zeros(n_env)
        self.skill_arch = np.zeros(n_arch)
        self.skill_task = np.zeros(len(self.env))
        self.skill_global = 0.0
        self.rng = np.random.default_rng(self.seed + 1)

    def success_prob(self) -> np.ndarray:
        z = self.skill_global + self.skill_env[self.env] + self.skill_arch[self.archetype] + self.skill_task - self.difficulty
        return 1.0 / (1.0 + np.exp(-z))

    def rollout(self, nodes: np.ndarray, k: int) -> np.ndarray:
        """K partial-credit rewards per node: full success -> 1, else a fraction of checks passed."""
        p = self.success_prob()[nodes][:, None]
        success = self.rng.random((len(nodes), k)) < p
        n = self.n_checks[nodes][:, None]
        partial = self.rng.binomial(np.broadcast_to(n, (len(nodes), k)), 0.5 * p) / n
        return np.where(success, 1.0, np.minimum(partial, 1.0 - 1.0 / n))

    def train(self, nodes: np.ndarray, rewards: np.ndarray) -> None:
        """Learning signal proportional to within-group reward spread (GRPO-like: no spread, no update)."""
        signal = rewards.std(axis=1)
        np.add.at(self.skill_env, self.env[nodes], self.lr_env * signal)
        np.add.at(self.skill_arch, self.archetype[nodes], self.lr_arch * signal)
        np.add.at(self.skill_task, nodes, self.lr_task * signal)
        self.skill_global += self.lr_global * float(signal.sum())


@dataclass
class LatentSkillLearner:
    """Simulated policy for scheduling benchmarks: latent difficulty by environment, by cross-environment
    structure cluster and by task, and learning driven by the realised within-group reward spread.

    Logit of task i: ``z_i = s_global + s_env[e_i] + s_cluster[c_i] + s_task[i] - (D_env[e_i] +
    D_cluster[c_i] + D_task[i] + offset)`` with ``D_* ~ N(0, sd_*)``.  A rollout draws one logistic noise
    ``eps`` (the rollout's luck) and

    * ``reward="partial"``: passes verifier check c when ``z + eps > thresholds[c]`` (``n_checks`` ordered
      checks); the reward is the fraction of checks passed (partial credit);
    * ``reward="binary"``: reward 1 when ``z + eps > 0``.

    ``train(nodes, rewards)``: each trained task moves its environment, cluster, own and global skill by
    ``lr_* * std(group rewards)`` (a GRPO-like update: a group without reward spread teaches nothing).
    Held-out tasks (``heldout_*`` arrays, not in the training pool) share environment and cluster skills but
    have no task skill of their own; ``heldout_success()`` is their mean probability of full success.
    """

    env: np.ndarray
    cluster: np.ndarray
    heldout_env: np.ndarray
    heldout_cluster: np.ndarray
    reward: str = "partial"  # "partial" | "binary"
    n_checks: int = 4
    offset: float = 0.0
    sd_env: float = 1.5
    sd_cluster: float = 1.5
    sd_task: float = 1.0
    lr_env: float = 0.01
    lr_cluster: float = 0.0015
    lr_task: float = 0.05
    lr_global: float = 0.00005
    seed: int = 0

    def __post_init__(self) -> None:
        if self.reward not in ("partial", "binary"):
            raise ValueError(f"reward must be 'partial' or 'binary', got {self.reward!r}")
        rng = np.random.default_rng(self.seed)
        n_env = int(max(self.env.max(), self.heldout_env.max())) + 1
        n_cl = int(max(self.cluster.max(), self.heldout_cluster.max())) + 1
        self.d_env = rng.normal(0.0, self.sd_env, n_env)
        self.d_cluster = rng.normal(0.0, self.sd_cluster, n_cl)
        self.d_task = rng.normal(0.0, self.sd_task, len(self.env)) + self.offset
        self.d_heldout = rng.normal(0.0, self.sd_task, len(self.heldout_env)) + self.offset
        self.s_env, self.s_cluster = np.zeros(n_env), np.zeros(n_cl)
        self.s_task, self.s_global = np.zeros(len(self.env)), 0.0
        half = 0.4 * (self.n_checks - 1)
        self.thresholds = np.linspace(-half, half, self.n_checks) if self.reward == "partial" else np.zeros(1)
        self.rng = np.random.default_rng(self.seed + 10_000)

    def logit(self) -> np.ndarray:
        return self.s_global + self.s_env[self.env] + self.s_cluster[self.cluster] + self.s_task - (self.d_env[self.env] + self.d_cluster[self.cluster] + self.d_task)

    def _success(self, z: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(z - self.thresholds[-1])))

    def success_prob(self) -> np.ndarray:
        """Probability of full success (reward 1) of every training task."""
        return self._success(self.logit())

    def expected_reward(self) -> np.ndarray:
        z = self.logit()[:, None]
        return np.mean(1.0 / (1.0 + np.exp(-(z - self.thresholds[None, :]))), axis=1)

    def expected_variance(self, k: int = 8) -> np.ndarray:
        """Expected population variance of a group of ``k`` rewards (EnvSched Eq. 2) of every training task."""
        z = self.logit()[:, None]
        tail = 1.0 / (1.0 + np.exp(-(z - self.thresholds[None, :])))  # P(reward >= (c + 1) / n), c = 0..n-1
        levels = np.arange(1, len(self.thresholds) + 1) / len(self.thresholds)
        prob = tail - np.append(tail[:, 1:], np.zeros((len(z), 1)), axis=1)  # P(reward == levels[c])
        mean = prob @ levels
        var = prob @ levels**2 - mean**2
        return var * (k - 1) / k

    def heldout_success(self) -> float:
        z = self.s_global + self.s_env[self.heldout_env] + self.s_cluster[self.heldout_cluster] - (self.d_env[self.heldout_env] + self.d_cluster[self.heldout_cluster] + self.d_heldout)
        return float(self._success(z).mean())

    def rollout(self, nodes: np.ndarray, k: int) -> np.ndarray:
        """(len(nodes), k) rewards."""
        z = self.logit()[np.asarray(nodes)][:, None]
        eps = self.rng.logistic(0.0, 1.0, (len(nodes), k))
        passed = (z + eps)[:, :, None] > self.thresholds[None, None, :]
        return passed.mean(axis=2)

    def train(self, nodes: np.ndarray, rewards: np.ndarray) -> None:
        nodes = np.asarray(nodes)
        signal = np.asarray(rewards).std(axis=1)
        np.add.at(self.s_env, self.env[nodes], self.lr_env * signal)
        np.add.at(self.s_cluster, self.cluster[nodes], self.lr_cluster * signal)
        np.add.at(self.s_task, nodes, self.lr_task * signal)
        self.s_global += self.lr_global * float(signal.sum())
