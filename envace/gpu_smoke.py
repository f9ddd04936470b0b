"""GPU smoke test: ``scripts/gpu_smoke.sh MODEL [--recipe NAME] [--nodes N] [--out DIR]``.

One node (``--nodes 1``, the default) runs a GPU recipe (``--recipe``, default ``envace_qwen3_8b_h20_2x8``) with its
own memory settings, token budgets and tensor-parallel size, and prints one summary table:

1. the checkpoint (a local Qwen3/Qwen2 directory: the recipe's own model exercises the recipe's memory);
2. the recipe on this node: composed and validated by envace's and verl's own checks (:mod:`envace.verl.config`),
   shrunk only where one node needs it (:func:`smoke_config`: the number of nodes, the node's GPUs, the batch, the
   number of steps, validation and checkpoint frequency, the data pool and the learning rate), every change named
   in the row; everything that sizes memory (:data:`MEMORY_KEYS`: ``gpu_memory_utilization``, prompt, response and
   context lengths, the micro-batch token budgets, offload, gradient checkpointing, tensor-parallel size) is the
   recipe's;
3. -- from here on a CUDA GPU is needed; without one the smoke test stops here, says so, and exits 3 --
   imports: torch with CUDA, vLLM, the attention backend (SDPA; flash-attn when installed);
4. verl picks its CUDA platform in the driver and inside a Ray actor that holds a GPU;
5. the training run: 2 steps at learning rate :data:`SMOKE_LR` with a validation pass and a checkpoint at step 2
   (complete as a relaunch checks it, :func:`check_saved`), then a second launch resumes from it and runs step 3
   (:func:`resume_problem`). The rollouts of steps 2 and 3 come after an update, at the recipe's tensor-parallel
   size (2 for the 8B recipes), so the weight sync after an update is checked there;
6. what the runs wrote (verl's metrics JSONL, the rollout dumps), per step: the rollout held the actor's weights
   (:func:`sync_problems`), the update ran, validation reported, rollouts have several ACT messages and a tool
   call, rewards lie in [0, 1], losses are finite, and verl's FSDP2 engine's peak stayed within the GPU;
7. vLLM at the recipe's ``gpu_memory_utilization``, ``max_model_len`` and tensor-parallel size: sleeping frees its
   memory (and it wakes up and generates again); decode tokens/s;
8. the peak memory of one update at the recipe's micro-batch token budget (``ppo_max_token_len_per_gpu``), FSDP2
   over this node's GPUs (:func:`child_peak`), plus what vLLM keeps while asleep, against the GPU's memory
   (:func:`memory_problem`): a recipe whose update does not fit fails here, not hours into the run.

``--nodes N`` (N >= 2) checks the cluster instead, on the head node, with the real run's worker command on the
others (``NNODES=N NODE_RANK=k MASTER_ADDR=... scripts/train.sh``, see ``docs/gpu.md``): it starts a
token-authenticated Ray head, waits for the workers, and checks that a client with the cluster's token connects and
one without it (or with another) is refused (:func:`check_token_auth`), that every node sees ``--out`` and the model
(:func:`envace.launch.check_shared_storage`, the check the run itself makes), and an NCCL all-reduce over every GPU of
every node through Ray (:func:`check_allreduce`); without CUDA it stops before the all-reduce, exit 3.

The checkpoint and resume rows of 5 and the checks of 6 read only the run directory and the second launch's output,
and the row logic of 8 and of the cluster checks are functions of measured values, so
``tests/envace/test_gpu_smoke.py`` makes each row fail on CPU; the nodes joining, token authentication, shared
storage and the all-reduce (over gloo) run there for real on Ray nodes on loopback.

Every stage has a time-out (:data:`STAGE_TIMEOUTS`): one node's smoke test ends within their sum,
:data:`TIME_BOUND_S`, plus its imports; the cluster checks within ``RAY_JOIN_TIMEOUT`` plus
:data:`CLUSTER_BOUND_S` (the bounds ``docs/gpu.md`` states).

Exit status: 0 all passed, 1 a check failed, 2 bad arguments or recipe, 3 no CUDA GPU (stopped before the GPU
checks).

The arguments, the recipe's name and the checkpoint's config.json are checked before anything else
(:func:`parse_args`, standard library only): ``scripts/gpu_smoke.sh`` runs that check with the system ``python3``
before ``bootstrap.sh`` installs the GPU lock, so ``--help`` and a usage mistake (no MODEL, a missing folder, a
config.json that is not a text-only Qwen3/Qwen2 decoder, an unknown or CPU recipe, ``--nodes`` without the head's
address or a Ray token, an ``--out`` that cannot be created) answer at once, one line naming it, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

PROG = "scripts/gpu_smoke.sh"
REPO = Path(__file__).resolve().parents[1]
#: the recipes ``--recipe`` names: ``configs/experiment/NAME.yaml``
EXPERIMENTS = REPO / "configs" / "experiment"
DEFAULT_RECIPE = "envace_qwen3_8b_h20_2x8"
#: the model types the smoke test accepts: a text-only Qwen3 or Qwen2 decoder
MODEL_TYPES = ("qwen3", "qwen2")
#: the config.json sizes :func:`estimate_params` reads: required, and optional (absent or null: derived)
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")
OPTIONAL_SIZE_KEYS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")

#: the settings that size a run's memory: the smoke test keeps the recipe's value of each (a test pins that)
MEMORY_KEYS = (
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.max_model_len",
    "actor_rollout_ref.rollout.free_cache_engine",
    "data.max_prompt_length",
    "data.max_response_length",
    "envace.agent.rehearse_max_tokens",
    "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.actor.fsdp_config.param_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    "actor_rollout_ref.ref.fsdp_config.param_offload",
    "actor_rollout_ref.model.enable_gradient_checkpointing",
    "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.model.override_config.attn_implementation",
)
#: the settings the smoke test changes to fit one node and a short run (:func:`smoke_config` names each change)
SHRUNK_KEYS = (
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "data.train_batch_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.rollout.agent.num_workers",
    "envace.data.max_tasks_per_pool",
    "data.val_max_samples",
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.max_actor_ckpt_to_keep",
    "actor_rollout_ref.actor.optim.lr",
)
#: the smoke run's learning rate: ten times the paper's 1e-6. Adam's first step moves every weight by exactly the
#: learning rate (m/sqrt(v) = sign(g) at step 1, whatever the gradient's scale or clipping), all in the direction
#: that raises the sampled tokens' advantage-weighted log-probability, so a rollout that missed the update disagrees
#: with the trainer by far more than bf16 rounding does (:data:`PROBS_DIFF_MEAN_MAX`)
SMOKE_LR = 1e-5
#: steps of the first launch (validation and a checkpoint at the last), and of the resumed one
STEPS, RESUME_STEPS = 2, 3

# -- the weight-sync thresholds, for bf16 on GPU (derived in :func:`sync_problems`' docstring) --------------------
#: the mean |p_actor - p_rollout| on synced weights stays below this: bf16 rounding gives ~0.008 on average and at
#: most ~0.02 per token; one missed update at SMOKE_LR gives several hundredths
PROBS_DIFF_MEAN_MAX = 0.02
#: and their correlation above this: ~0.98 or more under bf16 rounding, about 0 on weights that were never synced
PROBS_CORR_MIN = 0.9

# -- time-outs --------------------------------------------------------------------------------------------------
#: seconds each stage of one node's smoke test may take. Training: Ray's start, the FSDP2 actor's and vLLM's
#: initialisation (CUDA graphs: minutes on a cold cache), two steps whose rollouts decode up to the recipe's
#: 8,000-token responses (about 270 s at 30 tokens/s per sequence), a validation pass and a checkpoint (8B: ~100 GB
#: of weights and Adam state); the resumed launch: the same start, loading that checkpoint, one step; vLLM and the
#: update's peak: one model load each
STAGE_TIMEOUTS = {"Ray actor": 180, "train": 1200, "resume": 900, "vllm": 300, "peak": 300}
#: one node's smoke test ends within this (the bound docs/gpu.md states)
TIME_BOUND_S = sum(STAGE_TIMEOUTS.values())
#: ``--nodes N``, after the nodes joined (``RAY_JOIN_TIMEOUT``): seconds each of the three token-authentication
#: clients, the shared-storage probe and the all-reduce (its rendezvous included) may take
AUTH_CLIENT_TIMEOUT_S = 60
STORAGE_TIMEOUT_S = 120
ALLREDUCE_TIMEOUT_S = 300
#: the cluster checks end within this after the nodes joined (the bound docs/gpu.md states)
CLUSTER_BOUND_S = 3 * AUTH_CLIENT_TIMEOUT_S + STORAGE_TIMEOUT_S + ALLREDUCE_TIMEOUT_S
#: the all-reduce's buffer: 256 MiB of fp32, large enough that its time measures the network, not the latency
ALLREDUCE_NUMEL = 64 * 2**20


@dataclass
class Report:
    rows: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, check: str, ok: bool | None, detail: str) -> bool:
        self.rows.append((check, {True: "ok", False: "FAIL", None: "-"}[ok], detail))
        print(f"gpu_smoke: [{self.rows[-1][1]}] {check}: {detail}", flush=True)
        return bool(ok)

    def table(self) -> str:
        w = max(len(r[0]) for r in self.rows)
        lines = [f"{'check':<{w}}  result  detail", f"{'-' * w}  ------  {'-' * 40}"]
        lines += [f"{c:<{w}}  {s:<6}  {d}" for c, s, d in self.rows]
        return "\n".join(lines)

    @property
    def failed(self) -> bool:
        return any(s == "FAIL" for _, s, _ in self.rows)


def estimate_params(config: dict[str, Any]) -> float:
    """Parameters of a decoder-only checkpoint from its config.json (embeddings, attention, MLP)."""
    h, n, v = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    inter = config.get("intermediate_size") or 4 * h
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads") or heads
    attn = h * head_dim * (heads * 2 + kv * 2)
    emb = v * h * (1 if config.get("tie_word_embeddings", False) else 2)
    return float(emb + n * (attn + 3 * h * inter))


@dataclass(frozen=True)
class Checkpoint:
    """The MODEL argument: a local checkpoint folder and its config.json (checked by :func:`checkpoint_arg`)."""

    path: Path
    config: dict[str, Any]


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``PROG: error: MESSAGE (see --help)``, exit 2: the form of
    ``trace2env.cliargs.ArgumentParser``, restated because the pre-check runs with the system ``python3``, which
    may lack pydantic and the rest that importing the trace2env package brings in."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")


def checkpoint_arg(text: str) -> Checkpoint:
    """argparse ``type=`` of MODEL: a folder whose config.json is a JSON object describing a text-only Qwen3 or
    Qwen2 decoder with positive integer sizes; a multimodal config (its text model nested in ``text_config``) is
    refused, since the recipe trains a text-only model."""
    path = Path(text).expanduser().resolve()
    cfg_path = path / "config.json"
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: no such checkpoint folder (a local Hugging Face checkpoint)")
    if not cfg_path.is_file():
        raise argparse.ArgumentTypeError(f"{path} has no config.json (a local Hugging Face checkpoint is required)")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{cfg_path}: line {exc.lineno} column {exc.colno}: not JSON "
                                         f"({exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"{cfg_path}: cannot read: {exc}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}")
    if config.get("model_type") not in MODEL_TYPES:
        kind = "a multimodal checkpoint (text_config), " if "text_config" in config else ""
        raise argparse.ArgumentTypeError(f"{cfg_path}: model_type {config.get('model_type')!r}, {kind}but the smoke "
                                         "test trains a text-only Qwen3 or Qwen2 (model_type qwen3 or qwen2)")
    for key in SIZE_KEYS + OPTIONAL_SIZE_KEYS:
        value = config.get(key)
        if (key in SIZE_KEYS or value is not None) and (type(value) is not int or value <= 0):
            raise argparse.ArgumentTypeError(f"{cfg_path}: {key} is {value!r}, expected a positive integer")
    return Checkpoint(path, config)


def out_arg(text: str) -> Path:
    """argparse ``type=`` of ``--out``: a folder that is or can be created (not a file, not under one, in a folder
    this process may write)."""
    out = Path(text).expanduser().resolve()
    base = next(p for p in (out, *out.parents) if p.exists())
    if not base.is_dir():
        raise argparse.ArgumentTypeError(f"{out}: {base} is a file, not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{out}: {base} is not writable (read-only or permission denied)")
    return out


def recipe_names() -> list[str]:
    """Every recipe: the names of ``configs/experiment/*.yaml``."""
    return sorted(p.stem for p in EXPERIMENTS.glob("*.yaml"))


_DEFAULT_ITEM = re.compile(r"^\s+-\s+(.+?)\s*$")


def recipe_defaults(name: str) -> list[str]:
    """The entries of a recipe's Hydra ``defaults:`` list (``override /platform: gpu``, a parent recipe's name,
    ``_self_``), read line by line: the pre-check has no YAML parser."""
    items, inside = [], False
    for line in (EXPERIMENTS / f"{name}.yaml").read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            inside = line.rstrip() == "defaults:"
        elif inside and (m := _DEFAULT_ITEM.match(line)):
            items.append(m.group(1))
    return items


def is_gpu_recipe(name: str, _seen: frozenset[str] = frozenset()) -> bool:
    """Does the recipe select the GPU platform, itself or through the recipes it extends?"""
    if name in _seen or not (EXPERIMENTS / f"{name}.yaml").is_file():
        return False
    items = recipe_defaults(name)
    return any(re.fullmatch(r"override\s+/platform\s*:\s*gpu", item) for item in items) or any(
        is_gpu_recipe(item, _seen | {name}) for item in items if re.fullmatch(r"[\w.-]+", item))


def recipe_arg(text: str) -> str:
    """argparse ``type=`` of ``--recipe``: a GPU recipe of ``configs/experiment/`` (the whole config is composed and
    validated later, by :func:`smoke_config`)."""
    names = recipe_names()
    gpu = [n for n in names if is_gpu_recipe(n)]
    if text not in names:
        raise argparse.ArgumentTypeError(f"no recipe {text!r} in {EXPERIMENTS} (GPU recipes: {', '.join(gpu)})")
    if text not in gpu:
        raise argparse.ArgumentTypeError(f"{text} is not a GPU recipe (its defaults select no `override /platform: "
                                         f"gpu`); GPU recipes: {', '.join(gpu)}")
    return text


def nodes_arg(text: str) -> int:
    """argparse ``type=`` of ``--nodes``: a whole number >= 1."""
    if not re.fullmatch(r"\d{1,4}", text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def cluster_env_problem(environ: dict[str, str]) -> str | None:
    """Why ``--nodes N`` cannot start its head with these variables (the ones ``scripts/train.sh``'s head reads),
    or None: the head's address, this node being the head, a port, and Ray's token authentication, which the smoke
    test checks and so cannot run without."""
    if not environ.get("MASTER_ADDR"):
        return "MASTER_ADDR (this head node's address, as for scripts/train.sh) is required"
    if environ.get("NODE_RANK", "0") != "0":
        return (f"NODE_RANK={environ['NODE_RANK']}: the smoke test runs on the head (NODE_RANK=0); on the other "
                "nodes run the real run's worker command, NNODES=N NODE_RANK=k MASTER_ADDR=... scripts/train.sh")
    port = environ.get("RAY_PORT", "6379")
    if not re.fullmatch(r"\d{1,5}", port) or not 1 <= int(port) <= 65535:
        return f"RAY_PORT={port!r} must be a whole number from 1 to 65535"
    if environ.get("RAY_AUTH_MODE", "token") != "token":
        return (f"RAY_AUTH_MODE={environ['RAY_AUTH_MODE']}: the smoke test checks Ray's token authentication, so the "
                "cluster must use it (RAY_AUTH_MODE unset or token)")
    if not (environ.get("RAY_AUTH_TOKEN") or environ.get("RAY_AUTH_TOKEN_PATH")):
        return ("export RAY_AUTH_TOKEN=<secret> or RAY_AUTH_TOKEN_PATH=<file on shared storage>, as for "
                "scripts/train.sh: the smoke test checks Ray's token authentication")
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, MODEL's config.json, the recipe's name, ``--out`` and, with ``--nodes N``, the head's
    variables checked (standard library only: the pre-check)."""
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=checkpoint_arg, help="local Qwen3 checkpoint directory (the recipe's model)")
    parser.add_argument("--recipe", type=recipe_arg, default=DEFAULT_RECIPE,
                        help=f"GPU recipe of configs/experiment/ (default {DEFAULT_RECIPE})")
    parser.add_argument("--nodes", type=nodes_arg, default=1,
                        help="1: train the recipe on this node; N >= 2: check the N-node cluster from its head")
    parser.add_argument("--out", type=out_arg, default="outputs/gpu_smoke",
                        help="run directory and logs (with --nodes: on the storage the nodes share)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-spec", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--preflight", action="store_true", help=argparse.SUPPRESS)  # only check the arguments
    args = parser.parse_args(argv)
    if args.nodes > 1 and not args.child and (problem := cluster_env_problem(dict(os.environ))):
        parser.error(f"argument --nodes: {problem}")
    return args


def check_checkpoint(report: Report, model: Checkpoint) -> None:
    report.add("checkpoint", True, f"{model.config['model_type']}, ~{estimate_params(model.config) / 1e9:.2f}B "
               f"parameters ({model.path})")


# -- the recipe on one node ---------------------------------------------------------------------------------------
class SmokeError(ValueError):
    """The recipe cannot run on this node as the smoke test runs it (exit 2: a usage mistake, not a GPU failure)."""


@dataclass(frozen=True)
class SmokeConfig:
    """The recipe as the smoke test runs it: the composed config, the overrides that made it (``envace.train``'s
    command line), and each value it changed from the recipe's, as ``key recipe -> smoke``."""

    cfg: Any
    overrides: list[str]
    changes: list[str]
    #: the GPUs the recipe itself trains on (its nodes x GPUs per node)
    recipe_gpus: int


def smoke_gpus(recipe_gpus: int, tp: int, available: int | None) -> int:
    """The GPUs the smoke run uses: this node's (``available``; None: a full node of the recipe's), at most the
    recipe's per node, rounded down to whole vLLM replicas of ``tp`` GPUs."""
    gpus = min(recipe_gpus, recipe_gpus if available is None else available) // tp * tp
    if gpus < 1:
        raise SmokeError(f"argument --recipe: its tensor-parallel size {tp} needs {tp} GPUs per vLLM replica, and "
                         f"this node has {available}")
    return gpus


def smoke_config(recipe: str, model: str, run_dir: Path, steps: int, available_gpus: int | None) -> SmokeConfig:
    """``recipe`` composed for one node of this node's GPUs: ``SHRUNK_KEYS`` changed, every other value (the memory
    settings of ``MEMORY_KEYS`` among them) the recipe's. The batch is the smallest that verl can split over the
    GPUs (prompts x ``rollout.n`` a multiple of the GPU count, at least 2 prompts, so each step has a GRPO group
    per prompt), all of it one mini-batch (one update per step, as in the recipe)."""
    from omegaconf import OmegaConf

    from envace.verl.config import compose

    base = [f"experiment={recipe}", f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={run_dir}"]
    full = compose(base)
    a = full.actor_rollout_ref
    gpus = smoke_gpus(int(full.trainer.n_gpus_per_node), int(a.rollout.tensor_model_parallel_size), available_gpus)
    n = int(a.rollout.n)
    prompts = max(2, math.lcm(gpus, n) // n)
    shrink = {
        "trainer.nnodes": 1,
        "trainer.n_gpus_per_node": gpus,
        "data.train_batch_size": prompts,
        "actor_rollout_ref.actor.ppo_mini_batch_size": prompts,
        "actor_rollout_ref.rollout.agent.num_workers": min(int(a.rollout.agent.num_workers), prompts * n),
        "envace.data.max_tasks_per_pool": 32,
        "data.val_max_samples": 4,
        "trainer.total_training_steps": steps,
        "trainer.save_freq": STEPS,  # one checkpoint, the one the resumed launch loads
        "trainer.test_freq": STEPS,  # one validation pass, at step 2
        "trainer.val_before_train": False,
        "trainer.max_actor_ckpt_to_keep": 2,
        "actor_rollout_ref.actor.optim.lr": SMOKE_LR,
    }
    assert set(shrink) == set(SHRUNK_KEYS)
    overrides = [*base, *(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in shrink.items()),
                 "trainer.logger=[console,file]"]
    cfg = compose(overrides)
    changes = []
    for key in SHRUNK_KEYS:
        old, new = OmegaConf.select(full, key), OmegaConf.select(cfg, key)
        if old != new:
            changes.append(f"{key.rsplit('.', 1)[-1]} {old} -> {new}")
    return SmokeConfig(cfg, overrides, changes, int(full.trainer.nnodes) * int(full.trainer.n_gpus_per_node))


def memory_settings(cfg: Any) -> str:
    """The recipe's memory settings, as the recipe row prints them."""
    a = cfg.actor_rollout_ref
    return (f"gpu_memory_utilization {a.rollout.gpu_memory_utilization}, prompt/response/context "
            f"{cfg.data.max_prompt_length}/{cfg.data.max_response_length}/{a.rollout.max_model_len} tokens, "
            f"ppo_max_token_len_per_gpu {a.actor.ppo_max_token_len_per_gpu}, TP "
            f"{a.rollout.tensor_model_parallel_size}, offload param/optimizer {a.actor.fsdp_config.param_offload}/"
            f"{a.actor.fsdp_config.optimizer_offload}, gradient checkpointing {a.model.enable_gradient_checkpointing}")


def check_recipe(report: Report, recipe: str, model: Path, run_dir: Path, gpus: int | None) -> SmokeConfig | None:
    """Compose ``recipe`` for this node and validate it with envace's and verl's own checks; None (and a FAIL row)
    when it does not compose or validate."""
    from envace.config import validate_envace_config
    from envace.verl.config import compose, validate_verl_config

    try:
        smoke = smoke_config(recipe, str(model), run_dir, STEPS, gpus)
        validate_envace_config(smoke.cfg)
        validate_verl_config(smoke.cfg, model=False)
    except Exception as exc:  # noqa: BLE001 (composition or validation error: the recipe, not the GPU)
        report.add("recipe", False, f"{recipe} on one node does not validate: {' '.join(str(exc).split())}")
        return None
    cfg, a = smoke.cfg, smoke.cfg.actor_rollout_ref
    named = compose([f"experiment={recipe}"]).actor_rollout_ref.model.path
    own = "" if Path(str(named)).name == model.name else f"; the recipe's model is {named}: memory figures are MODEL's"
    report.add("recipe", True, f"{recipe} -> {cfg.trainer.nnodes}x{cfg.trainer.n_gpus_per_node} GPU, batch "
               f"{cfg.data.train_batch_size}x{a.rollout.n}; the recipe's {memory_settings(cfg)}; shrunk: "
               f"{', '.join(smoke.changes) or 'nothing'}{own}")
    return smoke


# -- GPU, platform --------------------------------------------------------------------------------------------------
def check_imports(report: Report) -> bool:
    import torch

    ok = report.add("torch", torch.cuda.is_available(),
                    f"{torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    try:
        import vllm

        ok &= report.add("vllm", True, vllm.__version__)
    except Exception as exc:  # noqa: BLE001 (any failure is a reported check)
        ok &= report.add("vllm", False, f"import failed: {exc}")
    sdpa = hasattr(torch.nn.functional, "scaled_dot_product_attention")
    try:
        import flash_attn

        fa = f"flash-attn {flash_attn.__version__} installed"
    except ImportError:
        fa = "flash-attn not installed (optional)"
    ok &= report.add("attention", sdpa, f"sdpa available; {fa}")
    return ok


def _actor_platform() -> dict[str, Any]:
    import torch
    from verl.utils.device import get_device_name

    return {"device": get_device_name(), "cuda": torch.cuda.is_available()}


def check_platform(report: Report) -> bool:
    import ray
    from verl.utils.device import get_device_name

    ok = report.add("verl platform (driver)", get_device_name() == "cuda", get_device_name())
    try:
        ray.init(address="local", num_gpus=1, include_dashboard=False, log_to_driver=False)
        got = ray.get(ray.remote(num_gpus=1)(_actor_platform).remote(), timeout=STAGE_TIMEOUTS["Ray actor"])
        ok &= report.add("verl platform (Ray actor)", got["device"] == "cuda" and got["cuda"], str(got))
    except Exception as exc:  # noqa: BLE001 (any failure is a reported check)
        ok &= report.add("verl platform (Ray actor)", False, str(exc))
    finally:
        ray.shutdown()
    return ok


# -- the training run ---------------------------------------------------------------------------------------------
def run_training(report: Report, name: str, overrides: list[str], log: Path, timeout: int) -> str:
    cmd = [sys.executable, "-m", "envace.train", *overrides]
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        parts = [p.decode(errors="replace") if isinstance(p, bytes) else (p or "") for p in (exc.stdout, exc.stderr)]
        out, rc = "".join(parts) + f"\n(timed out after {timeout} s)", -1
    log.write_text(out)
    report.add(name, rc == 0, f"exit {rc} in {time.time() - t0:.0f} s (limit {timeout} s; log {log})")
    return out


def check_saved(report: Report, run_dir: Path, step: int = STEPS, trainer_mode: str = "envace_sync") -> bool:
    """The checkpoint row: ``run_dir/global_step_{step}`` is complete by the check a relaunch makes before it
    resumes (:func:`envace.verl.resume.checkpoint_problems`: every rank's shards and the dataloader's state intact
    ``torch.save`` archives, EnvSched's state with an EnvSched trainer, TransferQueue's with an async one), and verl's
    tracker
    (``latest_checkpointed_iteration.txt``, written last) names ``step``, so the resumed launch loads it."""
    from envace.verl.config import trainer_kind
    from envace.verl.resume import TRACKER, checkpoint_problems

    folder = run_dir / f"global_step_{step}"
    envsched, kind = trainer_kind(trainer_mode)
    problems = checkpoint_problems(folder, envsched=envsched, asynchronous=kind != "sync")
    try:
        tracked = (run_dir / TRACKER).read_text().strip()
    except OSError:
        problems.append(f"no {TRACKER} in {run_dir} (verl writes it after the checkpoint)")
    else:
        if tracked != str(step):
            problems.append(f"{TRACKER} names step {tracked!r}, not {step}")
    return report.add(f"checkpoint at step {step}", not problems, "; ".join(problems) or (
        f"{folder} complete (every rank's shards, data.pt{', envsched.pt' if envsched else ''}), {TRACKER} names it"))


#: verl's trainer names the checkpoint it loads: ``Resuming from FOLDER`` (v0), ``..., setting global step to N`` (v1)
_RESUMING = re.compile(r"Resuming from (.+?)(?:, setting global step to \d+)?\s*$", re.MULTILINE)


def resume_problem(log: str, run_dir: Path, step: int = STEPS) -> str | None:
    """Why the resumed launch's output does not show it continuing from ``run_dir/global_step_{step}``, or None:
    verl names the folder it loads, and the first step the launch logs is ``step + 1``. A launch that found no
    checkpoint trains from scratch, logging steps 1 to 3 again: the metrics files would still cover steps 1, 2 and
    3, so this row is what catches it."""
    from envace.launch import STEP_LINE

    loaded = _RESUMING.findall(log)
    want = run_dir / f"global_step_{step}"
    if not loaded:
        scratch = ": it trained from scratch" if "Training from scratch" in log else ""
        return f"no 'Resuming from' line in its output{scratch}"
    if Path(loaded[-1]).resolve() != want.resolve():
        return f"it resumed from {loaded[-1]}, not {want}"
    first = STEP_LINE.search(log)
    if first is None or int(first.group(1)) != step + 1:
        return f"its first logged step is {first.group(1) if first else 'none'}, not {step + 1}"
    return None


def check_resumed(report: Report, log: str, run_dir: Path, step: int = STEPS) -> bool:
    """The resume row: :func:`resume_problem` of the second launch's output."""
    problem = resume_problem(log, run_dir, step)
    return report.add(f"resumed from step {step}", problem is None,
                      problem or f"loaded {run_dir / f'global_step_{step}'}, first step {step + 1}")


def read_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """{step: metrics} from every metrics/*.jsonl (verl's file logger, one file per launch), raw values."""
    steps: dict[int, dict[str, Any]] = {}
    for path in sorted((run_dir / "metrics").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                steps.setdefault(int(rec["step"]), {}).update(rec.get("data", {}))
    return steps


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def sync_problems(m: dict[str, Any]) -> list[str]:
    """Why a step's rollout did not hold the actor's weights (empty: it did), from verl's rollout-vs-trainer
    metrics of that step: ``training/rollout_probs_diff_mean``, the mean over response tokens of
    |p_actor - p_rollout|, the probability the FSDP actor recomputes for the sampled token against the one vLLM
    sampled it with, and ``training/rollout_actor_probs_pearson_corr``, their correlation
    (``verl/utils/debug/metrics.py``).

    The thresholds are derived for bf16 on GPU. On synced weights the two engines differ only by arithmetic:

    1. bf16 keeps 8 significant bits: each stored value carries a relative rounding error of up to u = 2^-8
       (3.9e-3). vLLM's kernels (fused, tensor-parallel, CUDA-graph) and FSDP's bf16 forward (SDPA, cuBLAS at other
       tile sizes) round different intermediate sums, so a logit z differs between them by about one rounding of
       its own size, |dz| <= u |z|: about 0.04 for the logits of order 10 that compete for a sampled token.
    2. The sampled token's log-probability is z_t - logsumexp(z), so the two engines' log-probabilities differ by
       d = (1 - p) dz_t - sum_{i != t} p_i dz_i, hence |d| <= 2 (1 - p) max|dz|: at most 0.08 nats, RMS about
       0.04. Published measurements agree: RMS 0.03 nats between a bf16 trainer and vLLM on identical input
       (ServiceNow/Fast-LLM#525), mean |d| 0.011 for Qwen3-4B between Megatron and vLLM (vllm-project/vime#64).
    3. In probability, p_actor - p_rollout = p (e^d - 1) ~ p d, so |dp| <= 2 p (1 - p) max|dz| <= max|dz| / 2, about
       0.02 per token at worst. The mean weighs each token by 2 p (1 - p), small for the many sampled tokens with p
       near 1 (a mean p (1 - p) of ~0.1 gives ~0.008); verl's own bf16 runs report rollout_probs_diff_mean 0.0064
       (verl-project/verl#7749). :data:`PROBS_DIFF_MEAN_MAX` = 0.02, the per-token worst case, which no mean of
       bf16 rounding exceeds.
    4. A rollout that missed one Adam step at :data:`SMOKE_LR` is another policy: Adam's first step moves every weight
       by exactly the learning rate, towards raising the sampled tokens' advantage-weighted log-probabilities, which
       shifts each weight matrix's outputs by ~lr x sum_j |x_j| ~ 1e-5 x 4,096, some 4% of their scale per matrix
       and compounding over the layers: O(1) nats on the sampled tokens, |dp| ~ p (1 - p) x O(1), a mean of
       several hundredths, above the threshold.
    5. The correlation: bf16's |dp| <= 0.02 against the spread of sampled tokens' probabilities (std >= 0.1: most
       near 1, a tail towards 0) keeps it >= 1 / sqrt(1 + (0.02 / 0.1)^2) = 0.98. A rollout on weights that were
       never synced samples tokens the actor does not favour, and the correlation falls to about 0, while its
       difference can stay small (both probabilities near 0): :data:`PROBS_CORR_MIN` = 0.9 catches that case.

    These are derivations and others' measurements, not measurements on our GPUs."""
    diff, corr = m.get("training/rollout_probs_diff_mean"), m.get("training/rollout_actor_probs_pearson_corr")
    problems = []
    if not _finite(diff) or diff >= PROBS_DIFF_MEAN_MAX:
        problems.append(f"mean probability difference {diff} (< {PROBS_DIFF_MEAN_MAX} needed)")
    if not _finite(corr) or corr <= PROBS_CORR_MIN:
        problems.append(f"probability correlation {corr} (> {PROBS_CORR_MIN} needed)")
    return problems


def check_run_outputs(report: Report, run_dir: Path, expect_steps: tuple[int, ...] = (1, 2, 3),
                      validate_at: tuple[int, ...] = (STEPS,), gpu_gb: float | None = None, tp: int = 1) -> None:
    steps = read_metrics(run_dir)
    report.add("steps logged", tuple(sorted(steps)) == expect_steps, f"{sorted(steps)}")
    for step in validate_at:
        val = sorted(k for k in steps.get(step, {}) if k.startswith("val-core/"))
        report.add(f"step {step} validation", bool(val), ", ".join(val[:3]) or "no val-core/ metric")
    peak = max((m.get("actor/perf/max_memory_allocated_gb") or 0.0 for m in steps.values()), default=0.0)
    if gpu_gb is not None:
        report.add("peak memory, FSDP2 engine", 0 < peak < gpu_gb,
                   f"{peak:.1f} GB allocated by verl's actor (the GPU has {gpu_gb:.1f} GB)")
    for step, m in sorted(steps.items()):
        problems = sync_problems(m)
        when = "before any update" if step == 1 else f"after update {step - 1}"
        report.add(f"step {step} weight sync (TP {tp}, {when})", not problems, "; ".join(problems) or (
            f"mean diff {m['training/rollout_probs_diff_mean']:.2e}, max {m.get('training/rollout_probs_diff_max')}, "
            f"correlation {m['training/rollout_actor_probs_pearson_corr']:.4f}"))
        grad = m.get("actor/grad_norm")
        report.add(f"step {step} update", _finite(grad) and grad > 0, f"actor/grad_norm {grad} at lr {SMOKE_LR:g}")
        losses = {k: v for k, v in m.items() if k.startswith("actor/") and k.endswith(("pg_loss", "kl_loss",
                                                                                      "grad_norm"))}
        finite = len(losses) >= 3 and all(_finite(v) for v in losses.values())
        report.add(f"step {step} loss/KL/grad-norm", finite, ", ".join(f"{k}={v:.4g}" for k, v in losses.items()))
        score = m.get("critic/score/mean")
        calls = m.get("envace/act/calls_per_trajectory")
        report.add(f"step {step} reward, tool calls", _finite(score) and 0 <= score <= 1 and bool(calls),
                   f"critic/score/mean {score}, tool calls per rollout {calls}")
    rows = []
    for path in sorted((run_dir / "rollouts").glob("*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    per_traj: dict[str, int] = {}
    for r in rows:
        if r.get("role", "act") == "act" and not str(r.get("uid", "")).startswith("pad"):
            per_traj[str(r.get("trajectory_id"))] = per_traj.get(str(r.get("trajectory_id")), 0) + 1
    multi = sum(1 for n in per_traj.values() if n > 1)
    calls = sum(1 for r in rows if "<tool_call>" in str(r.get("output", "")))
    scores = [float(r["score"]) for r in rows if r.get("score") is not None]
    report.add("rollout dumps: turns", multi > 0, f"{multi}/{len(per_traj)} rollouts with >1 ACT message")
    report.add("rollout dumps: tool calls", calls > 0, f"{calls} of {len(rows)} outputs carry a <tool_call>")
    report.add("rollout dumps: rewards in [0, 1]", bool(scores) and all(0 <= s <= 1 for s in scores),
               f"{len(scores)} scores, min {min(scores, default=float('nan')):.3g}, "
               f"max {max(scores, default=float('nan')):.3g}")


# -- measurements in fresh processes ----------------------------------------------------------------------------
def child_vllm(model: str, spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM at the recipe's ``gpu_memory_utilization``, ``max_model_len`` and tensor-parallel size: its memory
    awake and asleep (level 1, as verl's ``free_cache_engine`` puts it to sleep while the actor trains), whether it
    generates after waking, and its decode speed."""
    import torch
    from vllm import LLM, SamplingParams

    total, free0 = torch.cuda.mem_get_info()[1], torch.cuda.mem_get_info()[0]
    llm = LLM(model=model, enable_sleep_mode=True, gpu_memory_utilization=spec["gpu_memory_utilization"],
              max_model_len=spec["max_model_len"], tensor_parallel_size=spec["tp"], enforce_eager=False)
    params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=1.0)
    prompts = [f"Write a story about tool number {i}." for i in range(64)]
    llm.generate(prompts[:4], params)  # warm-up
    t0 = time.time()
    outs = llm.generate(prompts, params)
    tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.time() - t0)
    free_awake = torch.cuda.mem_get_info()[0]
    llm.sleep(level=1)
    free_asleep = torch.cuda.mem_get_info()[0]
    llm.wake_up()
    again = llm.generate(prompts[:2], SamplingParams(max_tokens=8))
    return {"total_gb": total / 1e9, "vllm_gb": (free0 - free_awake) / 1e9, "freed_gb": (free_asleep - free_awake) / 1e9,
            "asleep_gb": (free0 - free_asleep) / 1e9, "decode_tps": tps,
            "woke": all(len(o.outputs[0].token_ids) > 0 for o in again)}


def check_vllm(report: Report, v: dict[str, Any], gpu_memory_utilization: float, tp: int) -> bool:
    """The vLLM rows of :func:`child_vllm`'s measurement: sleeping must free most of what vLLM holds awake (the
    actor's update needs that room: verl puts vLLM to sleep for it), and it must generate again after waking."""
    ok = report.add("vLLM sleep frees memory", v["freed_gb"] > 0.8 * v["vllm_gb"] and v["woke"],
                    f"awake {v['vllm_gb']:.1f} GB, sleep freed {v['freed_gb']:.1f} GB, woke up: {v['woke']} "
                    f"(gpu_memory_utilization {gpu_memory_utilization}, TP {tp})")
    report.add("vLLM decode", None, f"{v['decode_tps']:.0f} tokens/s (64 sequences x 256 tokens)")
    return ok


def child_peak(model: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One update at the recipe's micro-batch token budget, as verl's FSDP2 actor runs it, on every GPU of this node
    (one process per GPU, started by ``torch.distributed.run``): fp32 parameters, gradients and AdamW state sharded
    by ``fully_shard`` per decoder layer, bf16 compute (FSDP2's mixed precision), ``spec["tokens"]`` tokens packed
    into one row of sequences of at most ``max_model_len`` (``use_remove_padding``), gradient checkpointing as the
    recipe sets it, log-probabilities by verl's own function. The weights are random (from config.json alone): the
    peak depends on the shapes, not the values. verl's parameter and optimizer offload move the state off the GPU
    between phases and back onto it for the update (``FSDPEngine.to``), so they do not lower this peak.

    Returns the largest peak over the ranks (reserved by PyTorch's allocator plus what the process holds outside
    it: CUDA context, NCCL buffers), or ``oom`` and the message when it did not fit. Without CUDA (the CPU test) it
    runs the same update over gloo and reports no memory."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    from verl.utils.torch_functional import logprobs_from_logits

    cuda = torch.cuda.is_available()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    config = AutoConfig.from_pretrained(model)
    config.use_cache = False
    result: dict[str, Any] = {"gpus": world, "tokens": spec["tokens"], "oom": False}
    try:
        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                   attn_implementation=spec["attn_implementation"])
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in net.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(net, mp_policy=policy)
        net.to_empty(device=device)
        with torch.no_grad():
            for p in net.parameters():
                p.normal_(0.0, 0.02)
        net.model.rotary_emb = type(net.model.rotary_emb)(config=config, device=device)  # its buffers were on meta
        if spec["gradient_checkpointing"]:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(net.parameters(), lr=1e-6)
        lens = [spec["max_model_len"]] * (spec["tokens"] // spec["max_model_len"])
        lens += [spec["tokens"] - sum(lens)] if spec["tokens"] > sum(lens) else []
        ids = torch.randint(0, config.vocab_size, (1, spec["tokens"]), device=device)
        pos = torch.cat([torch.arange(n, device=device) for n in lens]).unsqueeze(0)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.time()
        logits = net(input_ids=ids, position_ids=pos, use_cache=False).logits[0, :-1]
        logp = logprobs_from_logits(logits, ids[0, 1:])
        (-logp.mean()).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        result.update(seconds=time.time() - t0, finite=bool(torch.isfinite(logp.detach()).all()),
                      params=sum(p.numel() for p in net.parameters()))  # DTensors: global sizes
        peak = torch.zeros(1, device=device)
        if cuda:  # the process's memory outside the allocator (CUDA context, NCCL buffers), read after the update
            free, total = torch.cuda.mem_get_info(device)
            outside = total - free - torch.cuda.memory_reserved(device)
            peak += (torch.cuda.max_memory_reserved(device) + outside) / 1e9
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result["peak_gb"] = float(peak.item()) if cuda else None
    except torch.OutOfMemoryError as exc:
        result.update(oom=True, error=" ".join(str(exc).split())[:300])
    finally:
        dist.destroy_process_group()
    return result if rank == 0 else {}


def memory_problem(update: dict[str, Any], vllm: dict[str, Any] | None, gpu_gb: float) -> str | None:
    """Why the recipe's update does not fit the GPU, or None: it ran out of memory, or its peak plus what the
    colocated vLLM keeps while it sleeps exceeds the GPU's memory."""
    if update.get("oom"):
        return (f"out of memory in one {update['tokens']}-token update over {update['gpus']} GPU(s) "
                f"({update.get('error', '')})")
    if not _finite(update.get("peak_gb")):
        return f"no peak measured ({update})"
    asleep = (vllm or {}).get("asleep_gb") or 0.0
    if update["peak_gb"] + asleep > gpu_gb:
        return (f"{update['peak_gb']:.1f} GB + vLLM asleep {asleep:.1f} GB = {update['peak_gb'] + asleep:.1f} GB > "
                f"the GPU's {gpu_gb:.1f} GB")
    return None


def check_peak(report: Report, name: str, update: dict[str, Any], vllm: dict[str, Any] | None, gpu_gb: float,
               recipe_gpus: int) -> bool:
    """The peak-memory row: :func:`memory_problem` of :func:`child_peak`'s measurement."""
    problem = memory_problem(update, vllm, gpu_gb)
    return report.add(name, problem is None, problem or (
        f"{update['peak_gb']:.1f} GB + vLLM asleep {(vllm or {}).get('asleep_gb', 0.0):.1f} GB of {gpu_gb:.1f} GB "
        f"(FSDP2 over {update['gpus']} GPU(s), {update['params'] / 1e9:.2f}B parameters, {update['seconds']:.1f} s; "
        f"the recipe shards over {recipe_gpus} GPUs, so its state per GPU is at most this)"))


def run_child(kind: str, model: Path, spec: dict[str, Any], timeout: int, gpus: int = 1) -> dict[str, Any]:
    """Run :func:`child_vllm` or :func:`child_peak` in a fresh process (its GPU memory is released when it exits);
    with ``gpus`` > 1, one process per GPU under ``torch.distributed.run``."""
    me = ["-m", "envace.gpu_smoke", f"--child={kind}", f"--child-spec={json.dumps(spec)}", str(model)]
    launcher = (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"] if kind == "peak"
                else [])
    proc = subprocess.run([sys.executable, *launcher, *me], capture_output=True, text=True, timeout=timeout,
                          check=False)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("GPU_SMOKE_RESULT "):
            return json.loads(line[len("GPU_SMOKE_RESULT "):])
    raise RuntimeError(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")


# -- --nodes N: the cluster -----------------------------------------------------------------------------------------
_CONNECT = "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); print('connected')"


def _client(address: str, env: dict[str, str]) -> tuple[bool, str]:
    """Does a fresh Ray driver with this environment connect to ``address``? (and its last line of output)"""
    try:
        proc = subprocess.run([sys.executable, "-c", _CONNECT, address], env=env, capture_output=True, text=True,
                              timeout=AUTH_CLIENT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return False, f"no connection within {AUTH_CLIENT_TIMEOUT_S} s"
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return proc.returncode == 0 and "connected" in proc.stdout, (lines[-1][:200] if lines else f"exit {proc.returncode}")


def check_token_auth(report: Report, address: str, environ: dict[str, str] | None = None) -> bool:
    """The cluster at ``address`` admits a driver with its token (``environ``: this process's, which holds it) and
    refuses one without a token and one with another token: Ray's token authentication is on, not merely
    configured."""
    import secrets

    env = dict(os.environ if environ is None else environ)
    env.pop("RAY_ADDRESS", None)
    bare = {k: v for k, v in env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    clients = (env, bare, {**bare, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    # at once: a refused client retries for about 20 s before it gives up (Ray's GCS connection retries)
    with ThreadPoolExecutor(len(clients)) as pool:
        (with_token, why_with), (without, why_without), (other, why_other) = pool.map(
            lambda e: _client(address, e), clients)
    problems = ([] if with_token else [f"a client with the cluster's token could not connect ({why_with})"]) + [
        f"a client {who} connected" for who, got in (("without a token", without), ("with another token", other))
        if got]
    return report.add("Ray token auth", not problems, "; ".join(problems) or (
        f"a client with the token connects; without one: refused ({why_without}); with another: refused "
        f"({why_other})"))


def check_storage(report: Report, run_dir: Path, model: Path) -> bool:
    """Every node sees ``run_dir`` and the model: :func:`envace.launch.check_shared_storage`, the check the run
    itself makes before training."""
    from envace.config import ConfigError
    from envace.launch import check_shared_storage

    try:
        check_shared_storage(run_dir, {"model": str(model)}, timeout=STORAGE_TIMEOUT_S)
    except ConfigError as exc:
        return report.add("shared storage", False, str(exc))
    return report.add("shared storage", True, f"every node reads {run_dir} (a marker the head wrote) and {model}")


def _allreduce_rank(master: str, port: int, rank: int, world: int, backend: str, numel: int) -> dict[str, Any]:
    """One rank of :func:`check_allreduce`, in a Ray task: joins the process group, checks one all-reduce's sum,
    then times a few."""
    import datetime
    import socket

    import ray
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")  # Ray gives the task its GPU as 0
    dist.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=ALLREDUCE_TIMEOUT_S))
    try:
        x = torch.full((numel,), float(rank + 1), device=device)
        dist.all_reduce(x)
        total = world * (world + 1) / 2
        sum_ok = bool((x == total).all())
        iters = 5
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / iters
    finally:
        dist.destroy_process_group()
    # ring all-reduce bus bandwidth: each rank sends and receives 2 (n - 1) / n of the buffer
    bus = numel * 4 * 2 * (world - 1) / world / seconds / 1e9 if world > 1 else float("inf")
    return {"rank": rank, "node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
            "sum_ok": sum_ok, "bus_gbps": bus}


def allreduce_problems(results: list[dict[str, Any]], nodes: int, world: int) -> list[str]:
    """Why an all-reduce did not check the cluster: a rank missing, a wrong sum, or ranks on fewer nodes than the
    cluster has (then it never crossed a node boundary)."""
    problems = []
    if len(results) != world:
        problems.append(f"{len(results)} of {world} ranks answered")
    wrong = [r["rank"] for r in results if not r["sum_ok"]]
    if wrong:
        problems.append(f"ranks {wrong} got a wrong sum")
    spanned = len({r["node_id"] for r in results})
    if spanned < nodes:
        problems.append(f"the ranks ran on {spanned} node(s), not {nodes}")
    return problems


def check_allreduce(report: Report, backend: str = "nccl", numel: int = ALLREDUCE_NUMEL) -> bool:
    """An all-reduce over every GPU of every alive node of the connected Ray cluster (``backend`` gloo: one CPU rank
    per node, as the CPU test runs it), one Ray task per rank pinned to its node, with the network variables every
    Ray worker of a run gets (:func:`envace.launch.passthrough_env`)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from envace.eval.server import free_port
    from envace.launch import passthrough_env

    nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: "node:__internal_head__"
                   not in (n.get("Resources") or {}))
    per_node = [int((n.get("Resources") or {}).get("GPU", 0)) if backend == "nccl" else 1 for n in nodes]
    world = sum(per_node)
    name = f"{backend.upper()} all-reduce across nodes"
    if backend == "nccl" and min(per_node, default=0) < 1:
        return report.add(name, False, f"GPUs per node {per_node}: every node needs one")
    pin = [NodeAffinitySchedulingStrategy(n["NodeID"], soft=False) for n in nodes]
    runtime_env = {"env_vars": passthrough_env()}
    deadline = time.monotonic() + ALLREDUCE_TIMEOUT_S
    try:
        # a free port on the first node, on every interface: the other nodes' ranks connect to it
        port = ray.get(ray.remote(num_cpus=0)(free_port).options(scheduling_strategy=pin[0]).remote(""),
                       timeout=ALLREDUCE_TIMEOUT_S)
        task = ray.remote(_allreduce_rank)
        refs, rank = [], 0
        for strategy, count in zip(pin, per_node):
            for _ in range(count):
                opts = {"num_gpus": 1} if backend == "nccl" else {"num_cpus": 0}
                refs.append(task.options(scheduling_strategy=strategy, runtime_env=runtime_env, **opts).remote(
                    nodes[0]["NodeManagerAddress"], port, rank, world, backend, numel))
                rank += 1
        results = ray.get(refs, timeout=max(1.0, deadline - time.monotonic()))
    except Exception as exc:  # noqa: BLE001 (a hang past the time-out or a failed rank is the finding)
        return report.add(name, False, f"{world} ranks on {len(nodes)} nodes: {' '.join(str(exc).split())[:400]}")
    problems = allreduce_problems(results, len(nodes), world)
    return report.add(name, not problems, "; ".join(problems) or (
        f"{world} ranks on {len(nodes)} nodes, sum correct, bus bandwidth "
        f"{min(r['bus_gbps'] for r in results):.1f} GB/s ({numel * 4 / 2**20:.0f} MiB)"))


def check_joined(report: Report, nodes: int, address: str, timeout: float, head: subprocess.Popen | None = None,
                 head_log: Path | None = None) -> bool:
    """The "Ray cluster" row: ``nodes`` alive nodes at ``address`` within ``timeout`` seconds
    (:func:`envace.launch.wait_nodes`); when the head's ``ray start`` (``head``) has exited, the cluster never forms,
    and the row fails at once, saying so."""
    from envace.launch import wait_nodes

    joined = wait_nodes(nodes, timeout, address=address, node_pid=None if head is None else head.pid) == 0
    log = f"; the head's log: {head_log}" if head_log else ""
    if not joined and head is not None and head.poll() is not None:
        return report.add("Ray cluster", False, f"the head's ray start exited (status {head.returncode}) before "
                          f"{nodes} nodes joined {address}{log}")
    return report.add("Ray cluster", joined, f"{nodes} nodes joined {address}" if joined else
                      f"fewer than {nodes} nodes joined {address} within {timeout:g} s (RAY_JOIN_TIMEOUT{log})")


def check_cluster(report: Report, nodes: int, out: Path, model: Path, cuda: bool) -> None:
    """``--nodes N`` on the head: a token-authenticated Ray head on ``MASTER_ADDR:RAY_PORT`` (bound to this
    process, as ``scripts/train.sh`` binds its own; :func:`main` has set ``RAY_AUTH_MODE=token`` and the token
    before anything imported Ray), the workers' ``train.sh`` joining it, then token authentication, shared storage
    and, with CUDA, the NCCL all-reduce; the head stops at the end, and the workers' ``train.sh`` end with 0 when
    it does."""
    import signal

    import ray

    from envace.launch import gpus_here

    address = f"{os.environ['MASTER_ADDR']}:{os.environ.get('RAY_PORT', '6379')}"
    join_timeout = float(os.environ.get("RAY_JOIN_TIMEOUT", "600"))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "ray_head.log", "w") as log:
        head = subprocess.Popen(
            [sys.executable, "-m", "envace.launch", "bound-exec", "--parent", str(os.getpid()), "--", sys.executable,
             "-m", "ray.scripts.scripts", "start", "--head", f"--node-ip-address={os.environ['MASTER_ADDR']}",
             f"--port={address.rpartition(':')[2]}", f"--num-gpus={gpus_here() if cuda else 0}",
             "--disable-usage-stats", "--include-dashboard=false", "--block"], stdout=log, stderr=subprocess.STDOUT)
    try:
        if not check_joined(report, nodes, address, join_timeout, head, out / "ray_head.log"):
            return
        check_token_auth(report, address)
        ray.init(address=address, log_to_driver=False)
        try:
            check_storage(report, out / "run", model)
            if cuda:
                check_allreduce(report)
        finally:
            ray.shutdown()
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()


# -- main -----------------------------------------------------------------------------------------------------------
def no_cuda(report: Report, what: str) -> int:
    import torch

    report.add("CUDA", False, f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda})")
    print(report.table())
    print(f"gpu_smoke: stopped before {what}: this machine has no CUDA GPU. Run it on a GPU node (NVIDIA, "
          "requirements/gpu-cu13.lock or gpu-cu12.lock installed by scripts/bootstrap.sh).", file=sys.stderr)
    return 3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.preflight:
        return 0
    if args.child:
        spec = json.loads(args.child_spec)
        result = {"vllm": child_vllm, "peak": child_peak}[args.child](str(args.model.path), spec)
        if result:
            print("GPU_SMOKE_RESULT " + json.dumps(result), flush=True)
        return 0

    if args.nodes > 1:  # before Ray is imported: it reads its authentication settings once per process
        os.environ["RAY_AUTH_MODE"] = "token"
        if os.environ.get("RAY_AUTH_TOKEN_PATH") and not os.environ.get("RAY_AUTH_TOKEN"):
            from envace.launch import write_auth_token

            write_auth_token(os.environ["RAY_AUTH_TOKEN_PATH"])  # as train.sh's head: the workers wait for it
    import torch

    report = Report()
    model, out = args.model.path, args.out
    run_dir = out / "run"
    cuda = torch.cuda.is_available()
    check_checkpoint(report, args.model)
    smoke = check_recipe(report, args.recipe, model, run_dir, torch.cuda.device_count() if cuda else None)
    if smoke is None:
        print(report.table())
        return 2
    if args.nodes > 1:
        check_cluster(report, args.nodes, out, model, cuda)
        if not cuda and not report.failed:
            return no_cuda(report, "the NCCL all-reduce (token authentication and shared storage passed)")
        print(report.table())
        return 1 if report.failed else 0
    if not cuda:
        return no_cuda(report, "the GPU checks (the checkpoint and the recipe are fine)")
    t_start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    check_imports(report)
    check_platform(report)
    cfg, a = smoke.cfg, smoke.cfg.actor_rollout_ref
    tp, gpus = int(a.rollout.tensor_model_parallel_size), int(cfg.trainer.n_gpus_per_node)
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    run_training(report, f"train {STEPS} steps, validate and save at {STEPS}", smoke.overrides, out / "train_1.log",
                 timeout=STAGE_TIMEOUTS["train"])
    check_saved(report, run_dir, trainer_mode=str(cfg.trainer.v1.trainer_mode))
    resume = [o for o in smoke.overrides if not o.startswith("trainer.total_training_steps=")]
    log2 = run_training(report, f"resume to step {RESUME_STEPS}", [*resume,
                        f"trainer.total_training_steps={RESUME_STEPS}"], out / "train_2.log",
                        timeout=STAGE_TIMEOUTS["resume"])
    check_resumed(report, log2, run_dir)
    check_run_outputs(report, run_dir, expect_steps=tuple(range(1, RESUME_STEPS + 1)), gpu_gb=gpu_gb, tp=tp)
    v = None
    try:
        v = run_child("vllm", model, {"gpu_memory_utilization": float(a.rollout.gpu_memory_utilization),
                                      "max_model_len": int(a.rollout.max_model_len), "tp": tp},
                      timeout=STAGE_TIMEOUTS["vllm"])
        check_vllm(report, v, float(a.rollout.gpu_memory_utilization), tp)
    except Exception as exc:  # noqa: BLE001 (any failure is a reported check)
        report.add("vLLM sleep / decode", False, " ".join(str(exc).split())[-600:])
    tokens = int(a.actor.ppo_max_token_len_per_gpu)
    name = f"peak memory, one {tokens}-token update"
    try:
        p = run_child("peak", model, {"tokens": tokens, "max_model_len": int(a.rollout.max_model_len),
                                      "gradient_checkpointing": bool(a.model.enable_gradient_checkpointing),
                                      "attn_implementation": str(a.model.override_config.attn_implementation)},
                      timeout=STAGE_TIMEOUTS["peak"], gpus=gpus)
        check_peak(report, name, p, v, gpu_gb, smoke.recipe_gpus)
    except Exception as exc:  # noqa: BLE001 (any failure is a reported check)
        report.add(name, False, " ".join(str(exc).split())[-600:])
    report.add("wall time", None, f"{time.time() - t_start:.0f} s (bound {TIME_BOUND_S} s)")
    print(report.table())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
