"""``python -m envace.models export CHECKPOINT_DIR OUT``: a Hugging Face checkpoint (safetensors weights, config,
generation config, tokenizer with its chat template) from verl's sharded FSDP checkpoint, for ``vllm serve``,
``transformers serve`` and the evaluation scripts (``scripts/eval_*.sh --checkpoint OUT``).

CHECKPOINT_DIR is a run directory (``trainer.default_local_dir``: its latest checkpoint, the step named in
``latest_checkpointed_iteration.txt``), one ``global_step_N`` directory, or that step's ``actor`` directory.

The merge is verl 0.9.1's own model merger (``verl.model_merger``, FSDP backend): it reads every rank's shard file
``model_world_size_W_rank_R.pt``, joins the DTensor shards by their placements and writes the weights in bf16 with
the config and tokenizer verl saved beside the shards (``actor/huggingface``). Everything is checked before anything
is written (a missing shard names the file), and OUT is built in a temporary sibling directory renamed into place:
an interrupted export leaves no partial checkpoint at OUT. An OUT that exists and is not empty is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = ["ExportError", "export", "find_actor_dir"]


class ExportError(ValueError):
    """A checkpoint directory or an output path that cannot be exported (a user mistake: one line, exit 2)."""


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


def _check_shards(actor: Path) -> int:
    """The world size of the checkpoint in ``actor``, after checking that every rank's model shard and the
    Hugging Face config are there."""
    try:
        world_size = int(json.loads((actor / "fsdp_config.json").read_text())["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{actor / 'fsdp_config.json'}: no world_size ({exc})") from None
    missing = [f"model_world_size_{world_size}_rank_{r}.pt" for r in range(world_size)
               if not (actor / f"model_world_size_{world_size}_rank_{r}.pt").is_file()]
    if missing:
        raise ExportError(f"{actor}: missing model shard(s) {', '.join(missing)} of a {world_size}-rank checkpoint "
                          "(was it saved without 'model' in checkpoint.save_contents, or copied partially?)")
    if not (actor / "huggingface" / "config.json").is_file():
        raise ExportError(f"{actor}: no huggingface/config.json (verl saves the model config and tokenizer there)")
    return world_size


def export(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the Hugging Face checkpoint of ``checkpoint`` to ``out`` (see the module docstring); returns ``out``."""
    actor = find_actor_dir(checkpoint)
    _check_shards(actor)
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"{target} already exists and is not an empty directory: choose a new OUT")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)

    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    config = ModelMergerConfig(operation="merge", backend="fsdp", local_dir=str(actor), target_dir=str(tmp),
                               hf_model_config_path=str(actor / "huggingface"))
    try:
        merger = FSDPModelMerger(config)
        merger.merge_and_save()
        merger.cleanup()
        if target.exists():
            target.rmdir()  # empty (checked above)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
