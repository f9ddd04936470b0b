"""Which checkpoint a resumed run loads: verified before anything starts, with a fallback.

verl resumes (``trainer.resume_mode=auto``) from the step named in ``latest_checkpointed_iteration.txt``
and loads it without checking it; a checkpoint that a crash, a full disk or a cleanup left incomplete
fails deep inside the workers, or loads partly. :func:`select_resume_checkpoint` runs in
:func:`envace.train.prepare`: it verifies the checkpoint verl would load and, when it is incomplete,
points verl at the newest complete one (``resume_mode=resume_path``, verl's own key) with a warning.
An explicitly requested ``resume_from_path`` that is incomplete is an error, and so is a tracker whose
checkpoint and all older ones are incomplete.

A checkpoint ``global_step_N/`` is complete when:

* every sharded file verl's FSDP checkpoint manager writes (``{model,optim,extra_state}_world_size_W_rank_R.pt``
  in ``actor/`` and, when present, ``critic/``) exists for every rank ``0..W-1`` and is an intact
  ``torch.save`` archive (its zip directory reads back; a truncated file does not);
* ``data.pt`` (the dataloader state) is an intact archive;
* with an EnvSched trainer, ``envsched.pt`` loads with ``torch.load(weights_only=True)``;
* with an async trainer, ``transfer_queue/`` (the prompts and trajectories in flight, which verl restores or
  re-issues) holds TransferQueue's ``metadata.json`` and ``controller_state.pkl``, and the metadata reads as JSON.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path
from typing import Any

__all__ = ["checkpoint_problems", "select_resume_checkpoint"]

TRACKER = "latest_checkpointed_iteration.txt"
_SHARD = re.compile(r"^(?P<kind>[a-z_]+)_world_size_(?P<world>\d+)_rank_(?P<rank>\d+)\.pt$")


def _archive_problem(path: Path) -> str | None:
    if not path.is_file():
        return f"{path.name} is missing"
    if path.stat().st_size == 0:
        return f"{path.name} is empty"
    try:
        with zipfile.ZipFile(path) as zf:
            zf.infolist()
    except (zipfile.BadZipFile, OSError) as exc:
        return f"{path.name} is not an intact torch archive ({exc})"
    return None


def _component_problems(folder: Path) -> list[str]:
    """Problems of one worker group's folder (``actor/``, ``critic/``)."""
    if not folder.is_dir():
        return [f"{folder.name}/ is missing"]
    shards: dict[str, dict[int, set[int]]] = {}
    for f in folder.iterdir():
        m = _SHARD.match(f.name)
        if m:
            shards.setdefault(m["kind"], {}).setdefault(int(m["world"]), set()).add(int(m["rank"]))
    if not shards:
        return [] if any(folder.iterdir()) else [f"{folder.name}/ is empty"]
    problems = []
    if "model" not in shards:
        problems.append(f"{folder.name}/ has no model shards")
    for kind, worlds in sorted(shards.items()):
        for world, ranks in sorted(worlds.items()):
            missing = sorted(set(range(world)) - ranks)
            if missing:
                problems.append(f"{folder.name}/{kind}: ranks {missing} of world size {world} are missing")
            for rank in sorted(ranks):
                problem = _archive_problem(folder / f"{kind}_world_size_{world}_rank_{rank}.pt")
                if problem:
                    problems.append(f"{folder.name}/{problem}")
    return problems


#: what TransferQueue's ``save_checkpoint`` writes into ``global_step_N/transfer_queue/`` (verl's async trainers)
TQ_FILES = ("metadata.json", "controller_state.pkl")


def _tq_problems(folder: Path) -> list[str]:
    if not folder.is_dir():
        return ["transfer_queue/ is missing (an async trainer saves the prompts in flight there)"]
    problems = [f"transfer_queue/{name} is missing" for name in TQ_FILES if not (folder / name).is_file()]
    if not problems:
        import json

        try:
            json.loads((folder / TQ_FILES[0]).read_text())
        except (OSError, ValueError) as exc:
            problems.append(f"transfer_queue/{TQ_FILES[0]} does not read as JSON ({exc})")
    return problems


def checkpoint_problems(step_dir: str | Path, *, envsched: bool = False, asynchronous: bool = False) -> list[str]:
    """Why ``step_dir`` is not a complete checkpoint (empty list: complete)."""
    step = Path(step_dir)
    if not step.is_dir():
        return [f"{step} does not exist"]
    problems = _component_problems(step / "actor")
    if (step / "critic").exists():
        problems += _component_problems(step / "critic")
    if problem := _archive_problem(step / "data.pt"):
        problems.append(problem)
    if envsched:
        path = step / "envsched.pt"
        if not path.is_file():
            problems.append("envsched.pt is missing")
        else:
            import torch

            try:
                torch.load(path, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any failure means it cannot be restored safely
                problems.append(f"envsched.pt does not load with weights_only=True ({type(exc).__name__})")
    if asynchronous:
        problems += _tq_problems(step / "transfer_queue")
    return problems


def _step_of(path: Path) -> int | None:
    m = re.fullmatch(r"global_step_(\d+)", path.name)
    return int(m.group(1)) if m else None


def select_resume_checkpoint(cfg: Any) -> str | None:
    """Verify the checkpoint verl will resume from; fall back to the newest complete one.

    Mutates ``cfg.trainer.resume_mode`` / ``resume_from_path`` (open for writing) when falling back.
    Returns the checkpoint directory that will be loaded, or None (training from scratch).
    Raises :class:`~envace.config.ConfigError` when no complete checkpoint can be loaded.
    """
    from envace.config import ConfigError
    from envace.verl.config import trainer_kind

    trainer = cfg.trainer
    mode = str(trainer.get("resume_mode", "auto"))
    envsched, kind = trainer_kind(str(trainer.get("v1", {}).get("trainer_mode", "")))
    asynchronous = kind != "sync"
    if mode == "disable":
        return None
    if mode == "resume_path":
        path = Path(str(trainer.resume_from_path)).expanduser()
        problems = checkpoint_problems(path, envsched=envsched, asynchronous=asynchronous)
        if problems:
            raise ConfigError(f"trainer.resume_from_path={path} is not a complete checkpoint: {'; '.join(problems)}")
        return str(path)
    run_dir = Path(str(trainer.default_local_dir)).expanduser()
    tracker = run_dir / TRACKER
    if not tracker.is_file():
        return None  # verl trains from scratch
    try:
        latest = int(tracker.read_text().strip())
    except ValueError:
        latest = None
    candidates = sorted(
        (s, p) for p in run_dir.glob("global_step_*") if (s := _step_of(p)) is not None and p.is_dir()
    )
    target = run_dir / f"global_step_{latest}" if latest is not None else None
    problems = checkpoint_problems(target, envsched=envsched, asynchronous=asynchronous) if target is not None else [f"{tracker} is unreadable"]
    if not problems:
        return str(target)
    newest_ok = None
    for step, path in reversed(candidates):
        if latest is not None and step >= latest:
            continue
        if not checkpoint_problems(path, envsched=envsched, asynchronous=asynchronous):
            newest_ok = path
            break
    if newest_ok is None:
        raise ConfigError(
            f"cannot resume from {run_dir}: {target if target is not None else tracker} is incomplete "
            f"({'; '.join(problems)}) and no older complete checkpoint exists. Repair or remove it, or start "
            "anew with trainer.resume_mode=disable / another trainer.default_local_dir"
        )
    print(
        f"envace: WARNING: checkpoint {target} is incomplete ({'; '.join(problems)}); resuming from the newest "
        f"complete one, {newest_ok}",
        file=sys.stderr,
        flush=True,
    )
    trainer.resume_mode = "resume_path"
    trainer.resume_from_path = str(newest_ok)
    return str(newest_ok)
