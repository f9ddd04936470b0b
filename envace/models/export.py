"""``python -m envace.models export CHECKPOINT_DIR OUT``: a Hugging Face checkpoint (safetensors weights, config,
generation config, tokenizer with its chat template) from verl's sharded FSDP checkpoint, for ``vllm serve``,
``transformers serve`` and the evaluation scripts (``scripts/eval_*.sh --checkpoint OUT``).

CHECKPOINT_DIR is a run directory (``trainer.default_local_dir``: its latest checkpoint, the step named in
``latest_checkpointed_iteration.txt``), one ``global_step_N`` directory, or that step's ``actor`` directory.

The merge is verl 0.9.1's own model merger (``verl.model_merger``, FSDP backend) with its loading replaced. verl
reads every rank's shard file ``model_world_size_W_rank_R.pt`` into memory at once (all the fp32 weights, and rank
0's shard twice: 46 GiB for an 8B model saved by two ranks) before it joins the DTensor shards by their placements
in bf16; :func:`_mapped_merger_class` memory-maps the shard files instead (``torch.load(mmap=True)``: file pages the
kernel reads on demand and may drop again, no process memory) and merges one parameter at a time with verl's own
placement merge, so the process holds the merged weights plus one parameter's pieces: the export needs
:class:`MemoryNeed` (17 GiB for Qwen3-8B: 15.3 GiB of weights, 1.2 GiB for its embedding's pieces, 0.5 GiB for the
tokenizer), and the files verl then saves (the weights, and the config and tokenizer it saved beside the shards in
``actor/huggingface``) are the same bytes as its own merge writes.

The weights are written in the dtype of the model the run started from (``--dtype auto``: the ``dtype`` of
``actor/huggingface/config.json``, bf16 for Qwen3), or in the one ``--dtype`` names. verl's merger writes bf16 whatever
the model was trained in: a policy trained in fp32 (the CPU recipes) lost that precision in its export, rounding errors
of about a tenth of the default run's change to each weight matrix, up to a third of it for the norms' weights
(docs/results/tts_rehearsal.md). ``--dtype bfloat16`` is
verl's merge byte for byte; another dtype differs from it only in the tensors' dtype and the config's ``dtype``.

Everything is checked before any weight is read, cheapest first, so that a mistake on an 8B checkpoint costs
seconds, not the minutes of a merge: the shards are all there, ``huggingface/config.json`` is a model config
transformers reads, OUT can be created (not an existing non-empty directory, not under a regular file, in a
writable directory), every shard's zip directory and record headers are intact (a truncated copy), and this host
has the memory the merge needs (counted from the shards' tensor shapes, compared with what the kernel and the
process's memory cgroup still allow: :func:`available_memory`). A user mistake or a host too small raises
:class:`ExportError` (exit 2); a shard that cannot be read raises :class:`DamagedCheckpointError` naming it (exit 3:
damaged stored data, docs/cli.md). OUT is built in a temporary sibling directory renamed into place: an interrupted
export leaves no partial checkpoint at OUT.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace2env.cliargs import InfrastructureFailure, one_line, read_text

__all__ = ["DamagedCheckpointError", "ExportError", "MemoryNeed", "available_memory", "export", "find_actor_dir"]

#: What the export allocates besides the weights once the shards are open: the tokenizer and processor verl loads
#: to save them beside the weights (about 350 MiB for Qwen3's 151,669-token vocabulary), and the allocator's slack
OVERHEAD_BYTES = 512 << 20
#: the dtypes an export may write (``--dtype``); ``auto``: the run's model config's, bf16 where it names none of these
DTYPES = ("bfloat16", "float16", "float32")


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


def _check_hf_config(actor: Path) -> dict[str, Any]:
    """``actor/huggingface/config.json`` is a JSON object (the merger's transformers config reads it); returns it."""
    path = actor / "huggingface" / "config.json"
    if not path.is_file():
        raise ExportError(f"{actor}: no huggingface/config.json (verl saves the model config and tokenizer there)")
    try:
        config = json.loads(read_text(path, ExportError))
    except json.JSONDecodeError as exc:
        raise ExportError(f"{path}: line {exc.lineno} column {exc.colno}: not JSON ({exc.msg})") from None
    if not isinstance(config, dict):
        raise ExportError(f"{path}: expected a JSON object (a model config), got {type(config).__name__}")
    return config


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
    record's local header must read (:mod:`zipfile`; a few bytes per record, no tensor data), and ``data.pkl``, which
    the export unpickles before the memory check (names, shapes and placements: kilobytes), must match its CRC-32
    (torch does not check it, and a corrupt pickle fails in any of a dozen ways)."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                with archive.open(info) as record:
                    if info.filename.endswith("/data.pkl"):
                        while record.read(1 << 20):  # zipfile checks the CRC-32 at the end
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


@dataclass(frozen=True)
class MemoryNeed:
    """The memory an export allocates, counted from the shards' tensor shapes before any weight is read: the merged
    state dict in the export's dtype, one parameter's pieces in that dtype besides it while that parameter is merged
    (the largest one's at the peak), and :data:`OVERHEAD_BYTES`."""

    weights: int
    largest: int
    overhead: int = OVERHEAD_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.largest + self.overhead

    @classmethod
    def of(cls, state_dict: dict[str, Any], itemsize: int = 2) -> MemoryNeed:
        """The need of merging the checkpoint whose rank-0 shard is ``state_dict``: every entry (a DTensor's global
        shape, a plain tensor as it is) becomes one tensor of ``itemsize``-byte elements (2: bf16, verl's merge)."""
        sizes = [itemsize * value.numel() for value in state_dict.values()]
        return cls(weights=sum(sizes), largest=max(sizes, default=0))


def _size(n: int) -> str:
    """``n`` bytes in GiB, or in MiB below one GiB, to one decimal."""
    return f"{n / 2**30:.1f} GiB" if n >= 1 << 30 else f"{n / 2**20:.1f} MiB"


def _cgroup_headroom(cgroup_file: Path = Path("/proc/self/cgroup"), mount: Path = Path("/sys/fs/cgroup")) -> int | None:
    """How much more memory this process's memory cgroup (a container's or a batch job's limit, which the kernel's
    MemAvailable does not see) lets it use: ``limit - (usage - inactive file pages)``, the smallest over its cgroup
    and those above it; None without a memory limit. cgroup v2 (``memory.max``, ``memory.current``) and v1
    (``memory.stat``'s ``hierarchical_memory_limit``, ``memory.usage_in_bytes``) are read; a cgroup directory that
    is not visible (a container sees its own cgroup at the mount's root) is read at the root."""

    def number(path: Path) -> int | None:
        try:
            text = path.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() and int(text) < 1 << 62 else None  # "max" and v1's 2**63 - 4096: none

    def stat(path: Path) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}
        except (OSError, ValueError):
            return {}

    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return None
    headroom: list[int] = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: mounted at the mount itself (unified), or at unified/ (hybrid: no memory here)
            root = mount
            group = root / path.lstrip("/") if (root / path.lstrip("/")).is_dir() else root
            while True:
                limit, current = number(group / "memory.max"), number(group / "memory.current")
                if limit is not None and current is not None:
                    headroom.append(limit - current + stat(group / "memory.stat").get("inactive_file", 0))
                if group == root:
                    break
                group = group.parent
        elif "memory" in controllers.split(","):
            root = mount / "memory"
            group = root / path.lstrip("/") if (root / path.lstrip("/")).is_dir() else root
            values = stat(group / "memory.stat")
            limit = values.get("hierarchical_memory_limit")
            current = number(group / "memory.usage_in_bytes")
            if limit is not None and limit < 1 << 62 and current is not None:
                headroom.append(limit - current + values.get("total_inactive_file", 0))
    return max(0, min(headroom)) if headroom else None


def available_memory() -> tuple[int, str]:
    """The bytes this process may still allocate and where that figure comes from: the kernel's estimate
    (``psutil.virtual_memory().available``: free memory plus the page cache it can drop), or the memory cgroup's
    headroom where that is smaller (:func:`_cgroup_headroom`)."""
    import psutil

    host = int(psutil.virtual_memory().available)
    cgroup = _cgroup_headroom()
    if cgroup is not None and cgroup < host:
        return cgroup, "under this process's cgroup memory limit"
    return host, "on this host"


def _check_memory(actor: Path, need: MemoryNeed) -> None:
    """Refuse, in one line, an export whose :class:`MemoryNeed` is more than :func:`available_memory` (the kernel
    would kill the merge part way, minutes in, with no message)."""
    have, where = available_memory()
    if need.total > have:
        raise ExportError(
            f"exporting {actor} needs about {_size(need.total)} of memory ({_size(need.weights)} of weights, "
            f"{_size(need.largest)} for the largest parameter's pieces while it is merged, {_size(need.overhead)} for "
            f"the tokenizer verl saves) and {_size(have)} is available {where}: free memory, or export on a larger host")


@functools.cache
def _mapped_merger_class() -> type:
    """verl's ``FSDPModelMerger`` with its two loading steps replaced (verl 0.9.1's ``merge_and_save`` calls both;
    tests/envace/models/test_export.py pins the lines): the shards come memory-mapped from ``open_shards``, and the
    merge pops one parameter's pieces from every rank, converts and joins them as verl's
    ``_load_and_merge_state_dicts`` does (``.bfloat16()`` per piece, here ``.to(self.dtype)``, bf16 unless the
    export sets another; ``_merge_by_placement`` for a DTensor,
    ``merge_non_dtensor_shards`` for a plain tensor), and drops them before the next. The merged dict follows the
    checkpoint's key order (verl's follows a set's); the safetensors files sort their tensors either way. Built on
    first use: importing torch and verl takes seconds that ``python -m envace.models --help`` should not."""
    import torch
    from torch.distributed.tensor import DTensor
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger, merge_non_dtensor_shards

    class MappedFSDPMerger(FSDPModelMerger):
        state_dicts: list[dict[str, Any]]
        dtype: torch.dtype = torch.bfloat16  # the merged weights' (verl's merge: bf16)

        def open_shards(self, shards: list[Path]) -> None:
            """Every rank's shard, memory-mapped: ``torch.load`` reads only each file's pickle (names, shapes,
            placements), and a tensor's bytes are paged in from the file when it is first read. torch warns, once
            per shard, that the DTensors' device mesh has no process groups here: they were the trainer's, and the
            merge reads only the mesh's shape, so the warning is held back (it would precede a refusal's one line)."""
            mesh_log = logging.getLogger("torch.distributed.device_mesh")
            level = mesh_log.level
            mesh_log.setLevel(logging.ERROR)
            try:
                self.state_dicts = [torch.load(path, map_location="cpu", weights_only=False, mmap=True)
                                    for path in shards]
            finally:
                mesh_log.setLevel(level)

        def _load_rank_zero_state_dict(self, world_size: int) -> dict:
            """Rank 0's mapped shard (verl reads the file a second time, for its device mesh)."""
            return self.state_dicts[0]

        def _load_and_merge_state_dicts(self, world_size: int, total_shards: int, mesh_shape: tuple[int, ...],
                                        mesh_dim_names: tuple[str, ...]) -> dict[str, torch.Tensor]:
            """The merged state dict in ``self.dtype``, one parameter at a time (see :func:`_mapped_merger_class`);
            the pieces of a parameter are released when the next one's list replaces them."""
            ranks = self.state_dicts[:total_shards]
            merged: dict[str, torch.Tensor] = {}
            for key in list(ranks[0]):
                pieces: list[torch.Tensor] = []
                placements = None
                for state_dict in ranks:
                    tensor = state_dict.pop(key)
                    if isinstance(tensor, DTensor):
                        pieces.append(tensor._local_tensor.to(self.dtype))
                        placed = tuple(tensor.placements)
                        if mesh_dim_names[0] in ("dp", "ddp"):  # replicated over the data-parallel dimension
                            placed = placed[1:]
                        if placements is not None and placed != placements:
                            raise ValueError(f"{key}: rank placements differ ({placements} and {placed})")
                        placements = placed
                    else:
                        pieces.append(tensor.to(self.dtype))
                if placements is None:
                    merged[key] = merge_non_dtensor_shards(key, pieces)
                elif len(mesh_shape) == 1 and len(placements) == 1:
                    merged[key] = self._merge_by_placement(pieces, placements[0])
                else:
                    raise NotImplementedError(f"{key}: placements {placements} on a device mesh of shape "
                                              f"{mesh_shape}; verl's merger joins one placement on a 1-D mesh")
            self.state_dicts = []  # the maps are released with the last references to their tensors
            return merged

    return MappedFSDPMerger


def _merger(actor: Path, target_dir: Path) -> Any:
    """verl's FSDP model merger over ``actor``, loading memory-mapped shards (:func:`_mapped_merger_class`); it
    reads the model config (transformers' ``AutoConfig``) when built, so a config transformers refuses is reported
    here, before any shard is loaded."""
    from huggingface_hub.errors import StrictDataclassError
    from verl.model_merger.base_model_merger import ModelMergerConfig

    config = ModelMergerConfig(operation="merge", backend="fsdp", local_dir=str(actor), target_dir=str(target_dir),
                               hf_model_config_path=str(actor / "huggingface"))
    try:
        return _mapped_merger_class()(config)
    except (OSError, ValueError, TypeError, StrictDataclassError) as exc:
        raise ExportError(f"{actor / 'huggingface' / 'config.json'}: not a model config transformers can load: "
                          f"{one_line(exc)}") from None


def run_dtype(config: dict[str, Any]) -> str:
    """The dtype of the model the run started from, from its ``huggingface/config.json`` (``config``): ``dtype``
    (``torch_dtype`` before transformers 5), bf16 (verl's) where it names none of :data:`DTYPES`."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "")
    return name if name in DTYPES else "bfloat16"


def _set_config_dtype(target: Path, dtype: str) -> None:
    """Name ``dtype`` in the written config (verl builds the model it saves in bf16, so its config says bf16)."""
    path = target / "config.json"
    config = json.loads(path.read_text())
    config["dtype"] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], dtype: str = "auto") -> Path:
    """Write the Hugging Face checkpoint of ``checkpoint`` to ``out`` in ``dtype`` (``auto``: :func:`run_dtype`; see
    the module docstring); returns ``out``."""
    import torch

    if dtype != "auto" and dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: choose auto or one of {', '.join(DTYPES)}")
    actor = find_actor_dir(checkpoint)
    shards = _shard_paths(actor)
    config = _check_hf_config(actor)
    dtype = run_dtype(config) if dtype == "auto" else dtype
    target = Path(out)
    _check_out(target)
    tmp = target.parent / f".{target.name}.export-{os.getpid()}"
    merger = _merger(actor, tmp)
    merger.dtype = getattr(torch, dtype)
    for shard in shards:
        _check_shard(shard)
    merger.open_shards(shards)
    _check_memory(actor, MemoryNeed.of(merger.state_dicts[0], merger.dtype.itemsize))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        merger.merge_and_save()
        merger.cleanup()
        if dtype != "bfloat16":
            _set_config_dtype(tmp, dtype)
        if target.exists():
            target.rmdir()  # empty (checked above)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
