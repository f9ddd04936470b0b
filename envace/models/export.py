"""``python -m envace.models export CHECKPOINT_DIR OUT``: a Hugging Face checkpoint (safetensors weights, config,
generation config, tokenizer with its chat template) from verl's sharded FSDP checkpoint, for ``vllm serve``,
``transformers serve`` and the evaluation scripts (``scripts/eval_*.sh --checkpoint OUT``).

CHECKPOINT_DIR is a run directory (``trainer.default_local_dir``: its latest checkpoint, the step named in
``latest_checkpointed_iteration.txt``), one ``global_step_N`` directory, or that step's ``actor`` directory.

The merge is verl 0.9.1's own model merger (``verl.model_merger``, FSDP backend): it reads every rank's shard file
``model_world_size_W_rank_R.pt``, joins the DTensor shards by their placements and writes the weights in bf16 with
the config and tokenizer verl saved beside the shards (``actor/huggingface``).

Everything is checked before any shard is loaded, cheapest first, so that a mistake on an 8B checkpoint costs
seconds, not the minutes of a merge: the shards are all there, ``huggingface/config.json`` is a model config
transformers reads, OUT can be created (not an existing non-empty directory, not under a regular file, in a
writable directory), and every shard's zip directory and record headers are intact (a truncated copy). A user
mistake raises :class:`ExportError` (exit 2); a shard that cannot be read raises :class:`DamagedCheckpointError`
naming it (exit 3: damaged stored data, docs/cli.md). OUT is built in a temporary sibling directory renamed into
place: an interrupted export leaves no partial checkpoint at OUT.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

from trace2env.cliargs import InfrastructureFailure, one_line, read_text

__all__ = ["DamagedCheckpointError", "ExportError", "export", "find_actor_dir"]


class ExportError(ValueError):
    """A checkpoint directory or an output path that cannot be exported (a user mistake: one line, exit 2)."""


class DamagedCheckpointError(InfrastructureFailure):
    """A shard file whose bytes cannot be read as a torch checkpoint, truncated or corrupt (damaged stored data:
    one line naming the file, exit 3)."""


def find_actor_dir(checkpoint: str | os.PathLike[str]) -> Path:
    """The ``actor`` directory of verl's FSDP checkpoint that ``checkpoint`` names (see the module docstring)."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise ExportError(f"{path}: no such checkpoint directory")
    for cand in (path, path / "actor"):
        if (cand / "fsdp_config.json").is_file():
            return cand
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        step = tracker.read_text().strip()
        actor = path / f"global_step_{step}" / "actor"
        if not (actor / "fsdp_config.json").is_file():
            raise ExportError(f"{tracker} names step {step}, but {actor}/fsdp_config.json does not exist")
        return actor
    steps = sorted(p.name for p in path.glob("global_step_*") if (p / "actor" / "fsdp_config.json").is_file())
    hint = f"; name one of its checkpoints: {', '.join(steps)}" if steps else ""
    raise ExportError(f"{path} is not a verl FSDP checkpoint (no fsdp_config.json in it, in actor/, or in the step "
                      f"its latest_checkpointed_iteration.txt names){hint}")


def _shard_paths(actor: Path) -> list[Path]:
    """Every rank's model shard of the checkpoint in ``actor``, after checking that they are all there."""
    try:
        world_size = int(json.loads((actor / "fsdp_config.json").read_text())["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{actor / 'fsdp_config.json'}: no world_size ({exc})") from None
    shards = [actor / f"model_world_size_{world_size}_rank_{r}.pt" for r in range(world_size)]
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise ExportError(f"{actor}: missing model shard(s) {', '.join(missing)} of a {world_size}-rank checkpoint "
                          "(was it saved without 'model' in checkpoint.save_contents, or copied partially?)")
    return shards


def _check_hf_config(actor: Path) -> None:
    """``actor/huggingface/config.json`` is a JSON object (the merger's transformers config reads it)."""
    path = actor / "huggingface" / "config.json"
    if not path.is_file():
        raise ExportError(f"{actor}: no huggingface/config.json (verl saves the model config and tokenizer there)")
    try:
        config = json.loads(read_text(path, ExportError))
    except json.JSONDecodeError as exc:
        raise ExportError(f"{path}: line {exc.lineno} column {exc.colno}: not JSON ({exc.msg})") from None
    if not isinstance(config, dict):
        raise ExportError(f"{path}: expected a JSON object (a model config), got {type(config).__name__}")


def _check_out(target: Path) -> None:
    """OUT can be created: it is not an existing non-empty directory or a file, and the nearest directory above it
    that exists is one this process may create entries in (not a file, not read-only)."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"{target} already exists and is not an empty directory: choose a new OUT")
    base = next(p for p in target.absolute().parents if p.exists())
    if not base.is_dir():
        raise ExportError(f"OUT {target}: {base} is a file, not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ExportError(f"OUT {target}: {base} is not writable (read-only or permission denied)")


def _check_shard(path: Path) -> None:
    """``path`` is a whole torch checkpoint: ``torch.save`` writes a zip archive holding ``ARCHIVE/data.pkl`` and
    one record per storage, so its zip directory (at the end: the first thing a truncated copy loses) and every
    record's local header must read (:mod:`zipfile`; a few bytes per record, no tensor data)."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                with archive.open(info):
                    pass
            names = archive.namelist()
    except PermissionError as exc:
        raise ExportError(f"{path}: cannot read: {exc.strerror}") from None
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise DamagedCheckpointError(f"{path}: a damaged model shard ({path.stat().st_size} bytes; a truncated or "
                                     f"corrupt copy?): {exc}; copy it again from the run, then rerun") from None
    if not any(n.endswith("/data.pkl") for n in names):
        raise DamagedCheckpointError(f"{path}: a zip archive without data.pkl, not a torch checkpoint; copy it "
                                     "again from the run, then rerun")


def _merger(actor: Path, target_dir: Path) -> Any:
    """verl's FSDP model merger over ``actor``; it reads the model config (transformers' ``AutoConfig``) when
    built, so a config transformers refuses is reported here, before any shard is loaded."""
    from huggingface_hub.errors import StrictDataclassError
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    config = ModelMergerConfig(operation="merge", backend="fsdp", local_dir=str(actor), target_dir=str(target_dir),
                               hf_model_config_path=str(actor / "huggingface"))
    try:
        return FSDPModelMerger(config)
    except (OSError, ValueError, TypeError, StrictDataclassError) as exc:
        raise ExportError(f"{actor / 'huggingface' / 'config.json'}: not a model config transformers can load: "
                          f"{one_line(exc)}") from None


def export(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the Hugging Face checkpoint of ``checkpoint`` to ``out`` (see the module docstring); returns ``out``."""
    actor = find_actor_dir(checkpoint)
    shards = _shard_paths(actor)
    _check_hf_config(actor)
    target = Path(out)
    _check_out(target)
    tmp = target.parent / f".{target.name}.export-{os.getpid()}"
    merger = _merger(actor, tmp)
    for shard in shards:
        _check_shard(shard)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        merger.merge_and_save()
        merger.cleanup()
        if target.exists():
            target.rmdir()  # empty (checked above)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
