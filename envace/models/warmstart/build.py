"""The cached build: random init (the tiny recipe), phase 1 on copy drills, phase 2 on task data, the held-out
evaluation, and an atomic install with the manifest (recipe hash) written last."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from envace.models import tiny as _tiny
from envace.models import tokenizer as _tok
from envace.models.warmstart.config import (
    DEFAULT_CONFIG,
    WARM_NAME,
    WARM_RECIPE_VERSION,
    WarmStartConfig,
    learning_pool,
)
from envace.models.warmstart.examples import build_examples, copy_drill_examples
from envace.models.warmstart.rollout import heldout_success, load_model
from envace.models.warmstart.sft import train_sft, window_mean

_PHASE1_DRILLS = 30_000


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
                             anneal_steps=cfg.drill_anneal_steps,
                             batch_tokens=cfg.drill_batch_tokens, **common) if drills else []
    drill_final = window_mean(drill_losses, cfg.drill_window) if drill_losses else None
    drill_formed = drill_final <= cfg.drill_target_loss if drill_final is not None else None
    passes = _phase2(model, examples, cfg, common)
    losses = [loss for p in passes for loss in p]
    t_train = time.time() - t0 - t_data
    with _tiny._no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
    head = passes[0][: max(1, len(passes[0]) // 10)]  # the first pass's first tenth
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
        "cpu": cpu_kernels(),
        "train": {
            "examples": len(examples),
            "act_examples": sum(e.kind == "act" for e in examples),
            "rehearse_examples": sum(e.kind == "rehearse" for e in examples),
            "drill_examples": sum(e.kind == "drill" for e in examples),
            "drill_steps": len(drill_losses),
            "drill_final_loss": round(drill_final, 4) if drill_final is not None else None,
            "drill_formed": drill_formed,
            "steps": len(losses),
            "phase2_passes": [round(_tail_mean(p), 4) for p in passes if p],
            "first_loss": round(sum(head) / len(head), 4) if losses else None,
            "final_loss": round(_tail_mean(passes[-1]), 4) if losses else None,  # the last pass's last tenth
            "data_seconds": round(t_data, 1),
            "train_seconds": round(t_train, 1),
        },
        "build_seconds": round(time.time() - t0, 2),
        "files": files,
    }
    return manifest


def _tail_mean(losses: list[float]) -> float:
    """A phase-2 pass's final loss: the mean of its last tenth of steps."""
    return window_mean(losses, max(1, len(losses) // 10))


def _phase2(model: Any, examples: list[Any], cfg: WarmStartConfig, common: dict[str, Any]) -> list[list[float]]:
    """Phase 2 (task data): one pass of ``cfg.max_steps``, repeated with a fresh schedule (seed + 7·k for the k-th
    repeat) while the pass's final loss is above ``cfg.phase2_target_loss``, at most ``cfg.phase2_repeats`` times.
    The per-step losses of each pass."""
    passes: list[list[float]] = []
    for k in range(1 + cfg.phase2_repeats):
        if passes and (not passes[-1] or _tail_mean(passes[-1]) <= cfg.phase2_target_loss):
            break
        if passes:
            print(f"warm start: phase 2 ended at loss {_tail_mean(passes[-1]):.4f} (target "
                  f"{cfg.phase2_target_loss}): running it again ({k} of {cfg.phase2_repeats})", flush=True)
        passes.append(train_sft(model, examples, epochs=cfg.epochs, max_steps=cfg.max_steps, lr=cfg.lr,
                                seed=cfg.seed + 7 * k, batch_tokens=cfg.batch_tokens, **common))
    return passes


#: the environment variables that choose the CPU kernels a build's arithmetic runs on (torch's ATen, oneDNN, MKL)
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


def cpu_kernels() -> dict[str, Any]:
    """The CPU kernel path this process computes on: torch's capability (``default``, ``AVX2``, ``AVX512``...), the
    processor and the kernel-choosing variables that are set. A build is deterministic on one path, and its drill
    steps and success differ between paths (docs/results/cpu_default.md), so the manifest records it."""
    import platform

    import torch

    model = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    return {"capability": torch.backends.cpu.get_cpu_capability(), "processor": model,
            "variables": {k: os.environ[k] for k in KERNEL_VARIABLES if k in os.environ}}


def kernel_path_notice() -> str | None:
    """What the user should know before the warm start builds on this CPU's kernel path (one line), or None.

    On x86-64 without AVX2 (torch's ``DEFAULT`` capability: CPUs before 2013, and virtual machines that hide the
    host's AVX2) the build reaches the other paths' held-out success only after a second phase-2 pass, and its scalar
    kernels are several times slower than AVX2's or AVX-512's (docs/results/cpu_default.md, "CPU kernel paths"; the
    notice quotes its build times). Other architectures are not judged (no measurement)."""
    import platform

    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() not in ("x86_64", "amd64") or capability != "DEFAULT":
        return None
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    how = f"ATEN_CPU_CAPABILITY={forced} forces" if forced else "this CPU has no AVX2, so torch uses"
    return (f"{how} its scalar kernels: the warm start takes about 25 minutes to build on 2 cores, against 6 to 9 "
            "with AVX2 (docs/results/cpu_default.md); a warm start built on another machine can be copied to "
            f"{default_warm_dir()} instead")


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def unformed_warning(path: str | os.PathLike[str]) -> str | None:
    """The warning for a warm start whose copy drill did not reach its target (None when it did, or when ``path``
    has no warm-start manifest): such a model guesses argument values, and the README's held-out figures do not hold
    for it. ``python -m envace.models build --warm-start`` prints it as its last line (exit 1), and ``envace.train``
    before training and again as its last line."""
    try:
        manifest = json.loads((Path(path) / _tiny.MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    train = manifest.get("train") or {}
    if train.get("drill_formed") is not False:
        return None
    cpu = (manifest.get("cpu") or {}).get("capability", "an unrecorded")
    target = (manifest.get("recipe") or {}).get("train", {}).get("drill_target_loss")
    return (f"WARNING: the warm start at {path} did not form its copying circuit (drill loss "
            f"{train.get('drill_final_loss')} after {train.get('drill_steps')} steps, target {target}, on the "
            f"{cpu} CPU kernel path): it guesses argument values, and the held-out figures in the README and "
            "docs/results/cpu_default.md will not hold for it. Please report it with its envace_manifest.json.")


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
    return ensure_warm(out_dir, force=force, cfg=cfg, evaluate=evaluate)[0]


def ensure_warm(out_dir: str | os.PathLike[str] | None, *, force: bool = False, cfg: WarmStartConfig = DEFAULT_CONFIG,
                 evaluate: bool = True) -> tuple[Path, bool]:
    _tok._offline_env()
    final = (Path(out_dir).expanduser() if out_dir is not None else default_warm_dir()).absolute()
    if not force and is_warm_complete(final, cfg):
        return final, False
    notice = kernel_path_notice()
    if notice:
        print(f"warm start: {notice}", file=sys.stderr, flush=True)
    with _tiny._build_lock(final):
        if not force and is_warm_complete(final, cfg):
            return final, False
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.build-", dir=final.parent))
        try:
            manifest = _build_into(tmp, cfg)
            if evaluate and cfg.eval_tasks:
                t0 = time.time()
                model, tok = load_model(tmp)
                ev = heldout_success(model, tok, learning_pool(cfg), n_tasks=cfg.eval_tasks, temperature=1.0,
                                     seed=cfg.seed, threads=cfg.threads, per_category=True)
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
