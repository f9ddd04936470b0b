"""GPU smoke test: ``scripts/gpu_smoke.sh /models/Qwen3-1.7B [--out DIR]`` (one GPU, about 10 minutes).

Checks, in order, and prints one summary table:

1. the checkpoint (a local Qwen3 directory, 0.6B-1.7B parameters is the intended size);
2. the paper's recipe (``envace_qwen3_8b_h20_2x8``) overridden to 1 node x 1 GPU, TP 1, batch 4 prompts x 2
   rollouts, 2 steps: it composes and passes envace's and verl's validation;
3. -- from here on a CUDA GPU is needed; without one the smoke test stops here, says so, and exits 3 --
   imports: torch with CUDA, vLLM, the attention backend (SDPA; flash-attn when installed);
4. verl picks its CUDA platform in the driver and inside a Ray actor that holds a GPU;
5. the training run: 2 steps at learning rate ``SMOKE_LR`` (ten times the paper's, so one update moves the
   policy's token probabilities far enough for a stale weight sync to show) with a validation pass and a
   checkpoint at step 2, then a second launch resumes it and runs step 3; with two GPUs or more, a third launch
   runs one step at tensor-parallel 2 (the 8B recipe's layout);
6. what the runs wrote (verl's metrics JSONL, the per-step rollout dumps), per step: the rollout held the actor's
   weights (``sync_problems``: mean probability difference, and the correlation of the two probabilities, which a
   rollout on never-synced weights loses), the update ran (gradient norm > 0), the validation pass reported,
   rollouts have more than one ACT message and a tool call, rewards lie in [0, 1], loss, KL loss and gradient
   norm are finite, and verl's FSDP2 engine's peak memory stayed within the GPU;
7. vLLM: sleeping frees its memory (and it wakes up and generates again); decode tokens/s;
8. peak memory of one 24,000-token update (packed, SDPA, gradient checkpointing, AdamW) on one GPU.

The checks of 6 read only the run directory, so ``tests/envace/test_gpu_smoke.py`` runs them on CPU against
written metrics: a stale sync, a never-synced rollout, a missing validation or an engine over the GPU's memory each
make the smoke test fail.

Exit status: 0 all passed, 1 a check failed, 2 bad arguments or recipe, 3 no CUDA GPU (stopped after step 2).

The arguments and the checkpoint's config.json are checked before anything else (:func:`parse_args`, standard
library only): ``scripts/gpu_smoke.sh`` runs that check with the system ``python3`` before ``bootstrap.sh``
installs the GPU lock, so ``--help`` and a usage mistake (no MODEL, a missing folder, a config.json that is not
JSON or not a text-only Qwen3/Qwen2 decoder, an ``--out`` that cannot be created) answer at once, one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

PROG = "scripts/gpu_smoke.sh"
RECIPE = "envace_qwen3_8b_h20_2x8"
#: the model types the smoke test accepts: a text-only Qwen3 or Qwen2 decoder
MODEL_TYPES = ("qwen3", "qwen2")
#: the config.json sizes :func:`estimate_params` reads: required, and optional (absent or null: derived)
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")
OPTIONAL_SIZE_KEYS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
#: the 1-GPU shrink of the recipe; everything else (lr, KL, entropy, turns, attention, ...) is the paper's
SHRINK = [
    "trainer.nnodes=1",
    "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "trainer.save_freq=2",
    # one validation pass, at step 2
    "trainer.test_freq=2",
    "data.val_max_samples=4",
    "trainer.val_before_train=false",
    "trainer.logger=[console,file]",
    "trainer.max_actor_ckpt_to_keep=2",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "actor_rollout_ref.rollout.agent.num_workers=2",
    "envace.data.max_tasks_per_pool=32",
    "data.max_prompt_length=8192",
    "data.max_response_length=2048",
    "actor_rollout_ref.rollout.max_model_len=10240",
    "envace.agent.limits.max_user_turns=3",
    "envace.agent.limits.max_steps_per_turn=4",
    "envace.agent.rehearse_max_tokens=512",
]
PEAK_TOKENS = 24000
#: the smoke run's learning rate: ten times the paper's 1e-6, so that an update moves the policy enough for a
#: rollout that missed it to disagree with the trainer
SMOKE_LR = 1e-5
#: the rollout's and the trainer's token probabilities on the same weights (bf16 vLLM against the FSDP actor): mean
#: absolute difference at most this
PROBS_DIFF_MEAN_MAX = 0.01
#: and their correlation at least this: a rollout on weights that were never synced samples tokens both models give
#: almost no probability, so its difference stays small while the correlation falls to about 0 (-0.01 on CPU)
PROBS_CORR_MIN = 0.9
#: seconds a training launch may take: Ray's start, vLLM's CUDA-graph compilation (minutes on a cold cache) and
#: writing a 1.7B checkpoint with its optimizer state (about 20 GB) come on top of the steps themselves
TRAIN_TIMEOUT_S = 2400
RESUME_TIMEOUT_S = 1800


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


def overrides(model: str, run_dir: Path, steps: int, tp: int = 1) -> list[str]:
    tp_args = [f"trainer.n_gpus_per_node={tp}", f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}"]
    return [f"experiment={RECIPE}", f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={steps}", *SHRINK, f"actor_rollout_ref.actor.optim.lr={SMOKE_LR}",
            *(tp_args if tp > 1 else [])]


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, MODEL's config.json and ``--out`` checked (standard library only: the pre-check)."""
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=checkpoint_arg, help="local Qwen3 checkpoint directory (0.6B-1.7B)")
    parser.add_argument("--out", type=out_arg, default="outputs/gpu_smoke", help="run directory and logs")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--preflight", action="store_true", help=argparse.SUPPRESS)  # only check the arguments
    return parser.parse_args(argv)


def check_checkpoint(report: Report, model: Checkpoint) -> None:
    params = estimate_params(model.config)
    report.add("checkpoint", True, f"{model.config['model_type']}, ~{params / 1e9:.2f}B parameters"
               + ("" if 0.4e9 <= params <= 2.2e9 else " (outside 0.6B-1.7B: timings will differ)"))


def check_recipe(report: Report, model: Path, run_dir: Path) -> bool:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from envace.config import validate_envace_config
    from envace.verl.config import compose

    try:
        cfg = compose(overrides(str(model), run_dir, 2))
        validate_envace_config(cfg)
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    except Exception as exc:  # noqa: BLE001 (composition or validation error: the recipe, not the GPU)
        return report.add("recipe", False, f"{RECIPE} shrunk to 1 GPU does not validate: {exc}")
    a = cfg.actor_rollout_ref
    return report.add("recipe", True, f"{RECIPE} -> {cfg.trainer.nnodes}x{cfg.trainer.n_gpus_per_node} GPU, TP "
                      f"{a.rollout.tensor_model_parallel_size}, batch {cfg.data.train_batch_size}x{a.rollout.n}, "
                      f"lr {a.actor.optim.lr:g}, KL {a.actor.kl_loss_coef:g} {a.actor.kl_loss_type}, attention "
                      f"{a.model.override_config.attn_implementation}")


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
        got = ray.get(ray.remote(num_gpus=1)(_actor_platform).remote(), timeout=180)
        ok &= report.add("verl platform (Ray actor)", got["device"] == "cuda" and got["cuda"], str(got))
    except Exception as exc:  # noqa: BLE001 (any failure is a reported check)
        ok &= report.add("verl platform (Ray actor)", False, str(exc))
    finally:
        ray.shutdown()
    return ok


def run_training(report: Report, name: str, model: Path, run_dir: Path, steps: int, log: Path, timeout: int,
                 tp: int = 1) -> str:
    cmd = [sys.executable, "-m", "envace.train", *overrides(str(model), run_dir, steps, tp)]
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = f"{exc.stdout or ''}{exc.stderr or ''}\n(timed out after {timeout} s)", -1
    log.write_text(out if isinstance(out, str) else out.decode(errors="replace"))
    report.add(name, rc == 0, f"exit {rc} in {time.time() - t0:.0f} s (log {log})")
    return out if isinstance(out, str) else out.decode(errors="replace")


def read_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """{step: metrics} from every metrics/*.jsonl (verl's file logger, one file per launch), raw values."""
    steps: dict[int, dict[str, Any]] = {}
    for path in sorted((run_dir / "metrics").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                steps.setdefault(int(rec["step"]), {}).update(rec.get("data", {}))
    return steps


def sync_problems(m: dict[str, Any]) -> list[str]:
    """Why a step's rollout did not hold the actor's weights (empty: it did), from verl's rollout-vs-trainer
    metrics of that step."""
    diff, corr = m.get("training/rollout_probs_diff_mean"), m.get("training/rollout_actor_probs_pearson_corr")
    problems = []
    if not isinstance(diff, (int, float)) or not math.isfinite(diff) or diff >= PROBS_DIFF_MEAN_MAX:
        problems.append(f"mean probability difference {diff} (< {PROBS_DIFF_MEAN_MAX} needed)")
    if not isinstance(corr, (int, float)) or not math.isfinite(corr) or corr <= PROBS_CORR_MIN:
        problems.append(f"probability correlation {corr} (> {PROBS_CORR_MIN} needed)")
    return problems


def check_run_outputs(report: Report, run_dir: Path, expect_steps: tuple[int, ...] = (1, 2, 3),
                      validate_at: tuple[int, ...] = (2,), gpu_gb: float | None = None) -> None:
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
        report.add(f"step {step} weight sync", not problems, "; ".join(problems) or (
            f"mean diff {m['training/rollout_probs_diff_mean']:.2e}, max {m.get('training/rollout_probs_diff_max')}, "
            f"correlation {m['training/rollout_actor_probs_pearson_corr']:.4f}"))
        grad = m.get("actor/grad_norm")
        report.add(f"step {step} update", isinstance(grad, (int, float)) and math.isfinite(grad) and grad > 0,
                   f"actor/grad_norm {grad} at lr {SMOKE_LR:g}")
        losses = {k: v for k, v in m.items() if k.startswith("actor/") and k.endswith(("pg_loss", "kl_loss",
                                                                                      "grad_norm"))}
        finite = len(losses) >= 3 and all(isinstance(v, (int, float)) and math.isfinite(v) for v in losses.values())
        report.add(f"step {step} loss/KL/grad-norm", finite, ", ".join(f"{k}={v:.4g}" for k, v in losses.items()))
        score = m.get("critic/score/mean")
        calls = m.get("envace/act/calls_per_trajectory")
        report.add(f"step {step} reward, tool calls", score is not None and 0 <= score <= 1 and bool(calls),
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


def child(kind: str, model: str) -> dict[str, Any]:
    """Measurements that need a fresh process (their GPU memory is released when it exits)."""
    import torch

    if kind == "vllm":
        from vllm import LLM, SamplingParams

        total = torch.cuda.mem_get_info()[1]
        free0 = torch.cuda.mem_get_info()[0]
        llm = LLM(model=model, enable_sleep_mode=True, gpu_memory_utilization=0.5, max_model_len=4096,
                  enforce_eager=False)
        params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=1.0)
        prompts = [f"Write a story about tool number {i}." for i in range(64)]
        llm.generate(prompts[:4], params)  # warm-up
        t0 = time.time()
        outs = llm.generate(prompts, params)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        tps = tokens / (time.time() - t0)
        free_awake = torch.cuda.mem_get_info()[0]
        llm.sleep(level=1)
        free_asleep = torch.cuda.mem_get_info()[0]
        llm.wake_up()
        again = llm.generate(prompts[:2], SamplingParams(max_tokens=8))
        return {"total_gb": total / 1e9, "vllm_gb": (free0 - free_awake) / 1e9,
                "freed_gb": (free_asleep - free_awake) / 1e9,
                "decode_tps": tps, "woke": all(len(o.outputs[0].token_ids) > 0 for o in again)}
    if kind == "peak":
        from transformers import AutoModelForCausalLM
        from verl.utils.torch_functional import logprobs_from_logits

        net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa").cuda()
        net.gradient_checkpointing_enable()
        net.config.use_cache = False
        opt = torch.optim.AdamW(net.parameters(), lr=1e-6)
        lens = [PEAK_TOKENS // 3] * 3
        ids = torch.randint(0, net.config.vocab_size, (1, sum(lens)), device="cuda")
        pos = torch.cat([torch.arange(n, device="cuda") for n in lens]).unsqueeze(0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(input_ids=ids, position_ids=pos, use_cache=False).logits[0, :-1]
        logp = logprobs_from_logits(logits.float(), ids[0, 1:])
        (-logp.mean()).backward()
        opt.step()
        torch.cuda.synchronize()
        return {"peak_gb": torch.cuda.max_memory_allocated() / 1e9, "seconds": time.time() - t0,
                "params": sum(p.numel() for p in net.parameters())}
    raise ValueError(kind)


def run_child(kind: str, model: Path, timeout: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "envace.gpu_smoke", f"--child={kind}", str(model)],
                          capture_output=True, text=True, timeout=timeout, check=False)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("GPU_SMOKE_RESULT "):
            return json.loads(line[len("GPU_SMOKE_RESULT "):])
    raise RuntimeError(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.preflight:
        return 0
    if args.child:
        print("GPU_SMOKE_RESULT " + json.dumps(child(args.child, str(args.model.path))), flush=True)
        return 0

    report = Report()
    model, out = args.model.path, args.out
    run_dir = out / "run"
    check_checkpoint(report, args.model)
    if not check_recipe(report, model, run_dir):
        print(report.table())
        return 2
    import torch

    if not torch.cuda.is_available():
        report.add("CUDA", False, f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda})")
        print(report.table())
        print("gpu_smoke: stopped before the GPU checks: this machine has no CUDA GPU. The checkpoint and the "
              "recipe are fine; run it on a GPU node (NVIDIA, requirements/gpu.lock installed by "
              "scripts/bootstrap.sh).", file=sys.stderr)
        return 3
    t_start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    check_imports(report)
    check_platform(report)
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    run_training(report, "train 2 steps, validate and save at 2", model, run_dir, 2, out / "train_1.log",
                 timeout=TRAIN_TIMEOUT_S)
    report.add("checkpoint at step 2", (run_dir / "global_step_2" / "actor").is_dir(), str(run_dir / "global_step_2"))
    log2 = run_training(report, "resume to step 3", model, run_dir, 3, out / "train_2.log", timeout=RESUME_TIMEOUT_S)
    report.add("resumed from step 2", "global_step_2" in log2 and "Resuming" in log2,
               "the second launch loaded global_step_2" if "Resuming" in log2 else "no 'Resuming from' in its log")
    check_run_outputs(report, run_dir, gpu_gb=gpu_gb)
    if torch.cuda.device_count() >= 2:
        tp_dir = out / "run_tp2"
        if tp_dir.exists():
            import shutil

            shutil.rmtree(tp_dir)
        run_training(report, "tensor-parallel 2, one step", model, tp_dir, 1, out / "train_tp2.log",
                     timeout=TRAIN_TIMEOUT_S, tp=2)
        check_run_outputs(report, tp_dir, expect_steps=(1,), validate_at=(), gpu_gb=gpu_gb)
    else:
        report.add("tensor-parallel 2", None, "skipped: one GPU")
    try:
        v = run_child("vllm", model, timeout=240)
        report.add("vLLM sleep frees memory", v["freed_gb"] > 0.8 * v["vllm_gb"] and v["woke"],
                   f"awake {v['vllm_gb']:.1f} GB, sleep freed {v['freed_gb']:.1f} GB, woke up: {v['woke']}")
        report.add("vLLM decode", True, f"{v['decode_tps']:.0f} tokens/s (64 sequences x 256 tokens)")
    except Exception as exc:  # noqa: BLE001 (any failure is a reported check)
        report.add("vLLM sleep / decode", False, str(exc))
    try:
        p = run_child("peak", model, timeout=180)
        report.add(f"peak memory, one {PEAK_TOKENS}-token update", True,
                   f"{p['peak_gb']:.1f} GB in {p['seconds']:.1f} s ({p['params'] / 1e9:.2f}B parameters, fp32 "
                   "weights + AdamW on one GPU, bf16 compute, SDPA, gradient checkpointing)")
    except Exception as exc:  # noqa: BLE001 (any failure is a reported check)
        report.add(f"peak memory, one {PEAK_TOKENS}-token update", False, str(exc))
    report.add("wall time", None, f"{time.time() - t_start:.0f} s")
    print(report.table())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
