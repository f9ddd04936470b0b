"""Every verl (and TransferQueue) method or class envace overrides or calls outside verl's documented plugin
registries, pinned: the installed version, that it exists on the class envace reaches it through, where it is
defined (module + qualified name) and its exact ``inspect.signature``.

envace plugs into verl 0.9.1 at seams that are partly private (the V1 trainer's ``_compute_advantage`` and
friends, the TaskRunner actor class). A verl upgrade that renames, moves or re-signs one of them would otherwise
fail only in a slow end-to-end run, or silently (an override that no longer overrides anything is never called).
Each row of :data:`PINS` names the envace code that depends on it; :func:`check_pin` is the one check, so a failure
reads "verl 0.9.1: <target>: <what changed> (used by <envace site>)". When verl is upgraded on purpose, re-read
each site, then update the row.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest

VERSIONS = {"verl": "0.9.1", "TransferQueue": "0.1.11"}

TRAINER = "envace/verl/trainers.py EnvaceTrainerMixin"
SCHED = "envace/verl/trainers.py EnvSchedMixin"
RUNNER = "envace/verl/runner.py"
LOSS = "envace/verl/observation_loss.py"
LOOP = "envace/agents/verl_loop.py"
SYNC = "verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync"
COLOCATE = "verl.trainer.ppo.v1.trainer_colocate_async:PPOTrainerColocateAsync"
SEPARATE = "verl.trainer.ppo.v1.trainer_separate_async:PPOTrainerSeparateAsync"
BASE = "verl.trainer.ppo.v1.trainer_base:PPOTrainer"
AGENT_LOOP = "verl.experimental.agent_loop.agent_loop:AgentLoopBase"


@dataclass(frozen=True)
class Pin:
    target: str  # "module:attribute.path" as envace reaches it (the class it subclasses, the function it calls)
    defined: str  # "module:qualname" where the object is defined
    signature: str  # str(inspect.signature(obj))
    used_by: str  # the envace code that overrides or calls it
    dist: str = "verl"  # the distribution whose version the pin holds for


#: verl's three V1 trainers envace's mixins are placed before (envace/verl/trainers.py)
TRAINER_BASES = (SYNC, COLOCATE, SEPARATE)
#: (method, signature, envace site) of every PPOTrainer method the mixins override: each is pinned as reached through
#: each of the three bases, so an override one of verl's trainers starts to shadow fails here
OVERRIDES = [
    ("_build_replay_buffer", "(self) -> verl.trainer.ppo.v1.replay_buffer.ReplayBuffer", f"{TRAINER} overrides"),
    ("_compute_advantage",
     "(self, batch: transfer_queue.metadata.KVBatchMeta, metrics: dict) -> transfer_queue.metadata.KVBatchMeta",
     f"{TRAINER} overrides"),
    ("step", "(self, metrics: dict, timing_raw: dict) -> transfer_queue.metadata.KVBatchMeta",
     f"{TRAINER} and {SCHED} override"),
    ("_dump_generations", "(self, inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path)",
     f"{TRAINER} overrides"),
    ("_validate", "(self) -> dict[str, float]", f"{TRAINER} overrides (HeldoutValidation.batches wraps val_dataloader)"),
    ("_val_metrics_update", ("(self, data_sources, sample_uids, reward_extra_infos_dict, sample_turns, "
     "expected_acc_counts: dict[tuple[str, str], int] | None = None) -> dict[str, float]"),
     f"{TRAINER} overrides (HeldoutValidation.metrics)"),
    ("_init_dataloader", "(self)", f"{SCHED} overrides"),
    ("_next_train_batch", "(self, num_prompts: int | None = None) -> tensordict._td.TensorDict",
     f"{TRAINER} overrides (the prompt ledger; {SCHED}._draw_prompts chooses)"),
    ("_save_checkpoint", "(self)", f"{TRAINER} and {SCHED} override"),
    ("_load_checkpoint", "(self)", f"{TRAINER} and {SCHED} override"),
    ("init", "(self)", f"{LOSS} ObservationLossMixin overrides (installs the loss once verl has built the workers)"),
]

PINS = [
    # -- the V1 trainers envace's mixins are placed before (trainer_mode envace_* / envsched_*) --
    *(Pin(base, base, "(config: omegaconf.dictconfig.DictConfig)", f"{TRAINER} (base class)") for base in TRAINER_BASES),
    *(Pin(f"{base}.{name}", f"{BASE}.{name}", sig, used) for base in TRAINER_BASES for name, sig, used in OVERRIDES),
    # the typed envace config is attached before verl's constructor runs (separate_async defines its own)
    *(Pin(f"{base}.__init__", f"{SEPARATE if base == SEPARATE else BASE}.__init__",
          "(self, config: omegaconf.dictconfig.DictConfig)", f"{TRAINER} overrides") for base in TRAINER_BASES),
    Pin("verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.__init__",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.__init__",
        "(self, trainer_mode: str, trainer_config: omegaconf.dictconfig.DictConfig, "
        "max_off_policy_threshold: int | None, max_off_policy_strategy: str, "
        "sampler_kwargs: omegaconf.dictconfig.DictConfig, poll_interval: float = 2.0, refill_fn=None, "
        "filter_groups_metric: str | None = None, train_batch_size: int | None = None, "
        "gen_batch_size: int | None = None, max_inflight_gen_batches: int = 1, "
        "sync_refill_failed_groups: bool = False)",
        f"{TRAINER}._build_replay_buffer sets the buffer's poll_interval"),
    Pin("verl.trainer.ppo.v1.trainer_base:register_trainer", "verl.trainer.ppo.v1.trainer_base:register_trainer",
        "(name: str)", f"{TRAINER}, {SCHED} register"),
    Pin("verl.utils.dataset.rl_dataset:collate_fn", "verl.utils.dataset.rl_dataset:collate_fn",
        "(data_list: list[dict]) -> dict", f"{SCHED}._next_train_batch"),
    Pin("verl.utils.tensordict_utils:get_tensordict", "verl.utils.tensordict_utils:get_tensordict",
        "(tensor_dict: dict[str, torch.Tensor | list], non_tensor_dict: dict = None) -> tensordict._td.TensorDict",
        f"{SCHED}._next_train_batch"),
    Pin("verl.utils.tensordict_utils:assign_non_tensor_data", "verl.utils.tensordict_utils:assign_non_tensor_data",
        "(tensor_dict: tensordict._td.TensorDict, key, val)", f"{SCHED}._next_train_batch"),
    Pin("transfer_queue:kv_batch_get", "transfer_queue.interface:kv_batch_get",
        "(keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None) "
        "-> tensordict._td.TensorDict", f"{TRAINER}.step, {SCHED}.step read the trained rows", dist="TransferQueue"),
    Pin("transfer_queue:kv_list", "transfer_queue.interface:kv_list",
        "(partition_id: str | None = None) -> dict[str, dict[str, typing.Any]]",
        f"{TRAINER}._settle_prompts lists the prompts still registered (the prompt ledger)", dist="TransferQueue"),
    # -- the advantage-estimator registry --
    Pin("verl.trainer.ppo.core_algos:register_adv_est", "verl.trainer.ppo.core_algos:register_adv_est",
        "(name_or_enum: str | verl.trainer.ppo.core_algos.AdvantageEstimator) -> Any",
        "envace/verl/extensions.py register_rolewise_estimator"),
    # -- the actor's loss function the observation loss replaces (verl's ppo_loss inside it) --
    Pin("verl.workers.engine_workers:ActorRolloutRefWorker.set_loss_fn",
        "verl.workers.engine_workers:ActorRolloutRefWorker.set_loss_fn", "(self, loss_fn)", f"{LOSS} install"),
    Pin("verl.workers.utils.losses:ppo_loss", "verl.workers.utils.losses:ppo_loss",
        "(config: verl.workers.config.actor.ActorConfig, model_output, data: tensordict._td.TensorDict, dp_group=None)",
        f"{LOSS} observation_ppo_loss"),
    Pin("verl.workers.utils.padding:no_padding_2_padding", "verl.workers.utils.padding:no_padding_2_padding",
        "(tensor: torch.Tensor, data: tensordict._td.TensorDict) -> torch.Tensor", f"{LOSS} observation_ppo_loss"),
    Pin("verl.trainer.ppo.core_algos:agg_loss", "verl.trainer.ppo.core_algos:agg_loss",
        "(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1, "
        "batch_num_tokens: Optional[int] = None, global_batch_size: Optional[int] = None, "
        "loss_scale_factor: Optional[int] = None)", f"{LOSS} observation_nll"),
    # -- the TaskRunner and the entry point --
    Pin("verl.trainer.main_ppo:TaskRunnerV1.__ray_actor_class__", "verl.trainer.main_ppo:TaskRunnerV1",
        "(*, _ray_trace_ctx=None)", f"{RUNNER} EnvaceTaskRunner subclasses"),
    Pin("verl.trainer.main_ppo:TaskRunnerV1.__ray_actor_class__.run", "verl.trainer.main_ppo:TaskRunnerV1.run",
        "(self, config: omegaconf.dictconfig.DictConfig, *, _ray_trace_ctx=None)",
        f"{RUNNER} EnvaceTaskRunner overrides"),
    Pin("verl.trainer.main_ppo_v0:TaskRunner.__ray_actor_class__", "verl.trainer.main_ppo_v0:TaskRunner",
        "(*, _ray_trace_ctx=None)", f"{RUNNER} run (trainer.use_v1=false)"),
    Pin("verl.trainer.main_ppo:run_ppo", "verl.trainer.main_ppo:run_ppo", "(config, task_runner_class) -> None",
        f"{RUNNER} run"),
    Pin("verl.trainer.constants_ppo:get_ppo_ray_runtime_env", "verl.trainer.constants_ppo:get_ppo_ray_runtime_env",
        "(config=None)", f"{RUNNER} ray_runtime_env"),
    # -- the agent loop envace registers through agent_loops.yaml --
    Pin(f"{AGENT_LOOP}.__init__", f"{AGENT_LOOP}.__init__",
        "(self, trainer_config: verl.experimental.agent_loop.agent_loop.DictConfigWrap, "
        "server_manager: verl.workers.rollout.llm_server.LLMServerClient, "
        "tokenizer: transformers.models.auto.tokenization_auto.AutoTokenizer, "
        "processor: transformers.models.auto.processing_auto.AutoProcessor, "
        "dataset_cls: type[verl.utils.dataset.rl_dataset.RLHFDataset], "
        "data_config: verl.experimental.agent_loop.agent_loop.DictConfigWrap, hf_model_type: str | None = None, "
        "**kwargs)", f"{LOOP} EnvaceAgentLoop subclasses"),
    Pin(f"{AGENT_LOOP}.run", f"{AGENT_LOOP}.run",
        "(self, sampling_params: dict[str, typing.Any], **kwargs) -> "
        "verl.experimental.agent_loop.agent_loop.AgentLoopOutput", f"{LOOP} EnvaceAgentLoop overrides"),
    Pin(f"{AGENT_LOOP}.ct_build_initial_tokens", f"{AGENT_LOOP}.ct_build_initial_tokens",
        "(self, messages: list[dict], tools: list[dict] = None, images: list[PIL.Image.Image] = None, "
        "videos: list[tuple[torch.Tensor, dict]] = None, audios: list[typing.Any] = None, "
        "mm_inputs_out: dict[str, typing.Any] = None) -> list[int]", f"{LOOP} continuous-token bookkeeping"),
    Pin(f"{AGENT_LOOP}.ct_merge_assistant_token", f"{AGENT_LOOP}.ct_merge_assistant_token",
        "(self, runtime_token_ids: list[int], assistant_token_ids: list[int], response_mask: list[int], "
        "response_logprobs: Optional[list[float]] = None, assistant_logprobs: Optional[list[float]] = None)",
        f"{LOOP} continuous-token bookkeeping"),
    Pin(f"{AGENT_LOOP}.ct_merge_context_msg", f"{AGENT_LOOP}.ct_merge_context_msg",
        "(self, previous_messages: list[dict], updated_messages: list[dict], runtime_token_ids: list[int], "
        "response_mask: list[int], response_logprobs: Optional[list[float]] = None, tools: list[dict] = None)",
        f"{LOOP} continuous-token bookkeeping"),
    Pin("verl.workers.rollout.llm_server:LLMServerClient.generate",
        "verl.workers.rollout.llm_server:LLMServerClient.generate",
        "(self, request_id, *, prompt_ids: list[int], sampling_params: dict[str, typing.Any], "
        "image_data: Optional[list[Any]] = None, video_data: Optional[list[Any]] = None, "
        "audio_data: Optional[list[Any]] = None, mm_processor_kwargs: Optional[dict[str, Any]] = None, "
        "**kwargs: Any) -> verl.workers.rollout.replica.TokenOutput", f"{LOOP} VerlPolicy (server_manager.generate)"),
    Pin("verl.utils.tokenizer.continuous_token_wiring:create_continuous_token_builder",
        "verl.utils.tokenizer.continuous_token_wiring:create_continuous_token_builder",
        "(tokenizer: 'Any', *, model_family: 'str | ContinuousTokenModelFamily' = 'auto', "
        "hf_model_type: 'str | None' = None, chat_template_kwargs: 'dict[str, Any] | None' = None, "
        "mm_processor_kwargs: 'dict[str, Any] | None' = None, processor: 'Any | None' = None, "
        "**builder_kwargs: 'Any') -> 'Any'", "envace/agents/token_policy.py BuilderTokenContext"),
]


def check_pin(pin: Pin, import_module: Callable[[str], ModuleType] = importlib.import_module) -> None:
    """Raise AssertionError naming what no longer holds for ``pin``: the installed version, the attribute on the
    object envace reaches it through, where it is defined, or its signature."""
    where = f"{pin.dist} {VERSIONS[pin.dist]}: {pin.target}"
    installed = md.version(pin.dist)
    assert installed == VERSIONS[pin.dist], (
        f"{pin.dist} {installed} is installed, the pins hold for {VERSIONS[pin.dist]}")
    module_name, _, path = pin.target.partition(":")
    obj: Any = import_module(module_name)
    for i, name in enumerate(path.split(".")):
        if not hasattr(obj, name):
            owner = ".".join([module_name, *path.split(".")[:i]])
            raise AssertionError(f"{where}: {owner} has no attribute {name!r} (used by {pin.used_by})")
        obj = getattr(obj, name)
    found = f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', '?')}"
    assert found == pin.defined, f"{where}: defined in {found}, pinned {pin.defined} (used by {pin.used_by})"
    signature = str(inspect.signature(obj))
    assert signature == pin.signature, (
        f"{where}: signature {signature}, pinned {pin.signature} (used by {pin.used_by})")


def test_the_installed_versions_are_the_pinned_ones():
    import transfer_queue
    import verl

    assert verl.__version__ == VERSIONS["verl"] == md.version("verl")
    assert md.version("TransferQueue") == VERSIONS["TransferQueue"]
    assert transfer_queue.kv_batch_get is not None


@pytest.mark.parametrize("pin", PINS, ids=[p.target.partition(":")[2] or p.target for p in PINS])
def test_pinned_verl_seam(pin):
    check_pin(pin)


def test_every_override_of_envaces_verl_subclasses_is_pinned():
    """A method envace's trainer, TaskRunner or agent loop classes define that their verl base also defines is an
    override: each one must have a pin (a new override without one fails here, naming it)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase
    from verl.trainer.main_ppo import TaskRunnerV1
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    from envace.agents.verl_loop import EnvaceAgentLoop
    from envace.verl.extensions import register_trainer_extensions
    from envace.verl.runner import task_runner_class

    register_trainer_extensions()
    from envace.verl.trainers import TRAINERS

    runner = task_runner_class().__ray_actor_class__
    bases = {
        runner: (TaskRunnerV1.__ray_actor_class__, "verl.trainer.main_ppo:TaskRunnerV1.__ray_actor_class__"),
        EnvaceAgentLoop: (AgentLoopBase, AGENT_LOOP),
    }
    assert sorted(TRAINERS) == sorted(f"{m}_{k}" for m in ("envace", "envsched")
                                      for k in ("sync", "colocate_async", "separate_async"))
    by_mode = dict(zip(("sync", "colocate_async", "separate_async"), TRAINER_BASES, strict=True))
    for name, cls in TRAINERS.items():
        # the mode a trainer presents to verl is its base's registered name, and the mode it is registered under ends in it
        assert name.endswith(f"_{cls.VERL_MODE}") and get_trainer_cls(cls.VERL_MODE) in cls.__mro__
        bases[cls] = (get_trainer_cls(cls.VERL_MODE), by_mode[cls.VERL_MODE])
    pinned = {p.target for p in PINS}
    missing = []
    for cls, (base, target) in bases.items():
        assert issubclass(cls, base)
        for klass in cls.__mro__[: cls.__mro__.index(base)]:  # envace's classes between cls and verl's base
            for name in vars(klass):
                if name.startswith("__") and name != "__init__" or not callable(getattr(base, name, None)):
                    continue
                if f"{target}.{name}" not in pinned:
                    missing.append(f"{klass.__qualname__}.{name} overrides {target}.{name}")
    assert not missing, missing


#: lines of verl's source envace relies on, and where. envace's held-out validation (``HeldoutValidation`` in
#: envace/verl/trainer.py): ``_validate`` draws its batches from ``self.val_dataloader`` and stamps their uids on the
#: drawn dict in place (the wrapper reads them back after each yield), and takes each row's sample count from its
#: ``__rollout_n__`` (the greedy copy's one sample), which the agent-loop worker pops per prompt. The observation loss
#: (envace/verl/observation_loss.py): the actor worker's own loss function is ``ppo_loss`` with the actor's config,
#: which the installed one wraps, and verl's engine calls it with these keywords
VALIDATION = "envace/verl/trainer.py"
SOURCE_LINES = [
    ("verl.trainer.ppo.v1.trainer_base:PPOTrainer._validate", "for batch_dict in self.val_dataloader:", VALIDATION),
    ("verl.trainer.ppo.v1.trainer_base:PPOTrainer._validate", 'batch_dict["uid"] = np.array(', VALIDATION),
    ("verl.trainer.ppo.v1.trainer_base:PPOTrainer._validate", '"__rollout_n__", [self.config.actor_rollout_ref',
     VALIDATION),
    ("verl.trainer.ppo.v1.agent_loop_tq:AgentLoopWorkerTQ._run_prompt", 'n = prompt.pop("__rollout_n__", ',
     VALIDATION),
    ("verl.workers.engine_workers:ActorRolloutRefWorker.init_model",
     "self.loss_fn = partial(ppo_loss, config=actor_config)", LOSS),
    ("verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.forward_step",
     "model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()", LOSS),
]


@pytest.mark.parametrize("target,line,site", SOURCE_LINES, ids=[f"{t.split(':')[1]}:{i}" for i, (t, _, _) in
                                                               enumerate(SOURCE_LINES)])
def test_pinned_verl_source_line(target, line, site):
    assert md.version("verl") == VERSIONS["verl"]
    module_name, _, path = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for name in path.split("."):
        obj = getattr(obj, name)
    obj = getattr(obj, "__ray_actor_class__", obj)
    source = inspect.getsource(obj)
    assert line in source, f"verl {VERSIONS['verl']}: {target} no longer contains {line!r} ({site})"


#: the registries pre-flight reads to resolve a configured name before Ray starts
#: (``envace/verl/config.py`` check_registries): module, attribute, and whether a key is a (name, mode) pair
REGISTRIES = [
    ("verl.workers.rollout.base", "_ROLLOUT_REGISTRY", True),
    ("verl.trainer.ppo.core_algos", "ADV_ESTIMATOR_REGISTRY", False),
    ("verl.trainer.ppo.v1.trainer_base", "TRAINER_REGISTRY", False),
]


@pytest.mark.parametrize(("module", "name", "pairs"), REGISTRIES)
def test_the_registries_preflight_reads_are_where_it_reads_them(module, name, pairs):
    registry = getattr(importlib.import_module(module), name, None)
    assert isinstance(registry, dict) and registry, f"verl {VERSIONS['verl']}: {module}.{name} is gone or empty"
    keys = [k for key in registry for k in (key if pairs else (key,))]
    assert all(isinstance(k, str) for k in keys) and (not pairs or all(len(k) == 2 for k in registry)), list(registry)
