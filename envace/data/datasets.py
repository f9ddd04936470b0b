"""verl-ready parquet datasets built from environment pools.

Row layout (one row per task; the same for every pool and for the CM2 converter)
------------------------------------------------------------------------------------
==================  ===========================================================================
column              content
==================  ===========================================================================
``prompt``          list of ``{"role", "content"}`` chat messages the agent starts from
                    (``TaskSpec.initial_messages()``); verl's ``data.prompt_key`` (default
                    ``prompt``) reads it into ``raw_prompt``.
``data_source``     ``"<pool>/<category>"``: verl groups validation metrics by it, which gives
                    the per-category columns of the benchmark tables.
``agent_name``      the verl agent loop that runs the row (verl reads this column per sample).
``tools``           JSON string: the OpenAI function schemas visible at the start. verl's
                    ``RLHFDataset`` only knows *global* tools (``tool_config_path``), so per-task
                    tools travel in this column for the agent loop to pass to the chat template.
``reward_model``    ``{"style": "rule" | "checklist", "ground_truth": <JSON string>}``; for
                    pools, the gold actions (list of turns of ``{"name", "arguments"}``), or
                    ``null`` when the pool has none; for CM2, the checklist.
``extra_info``      ``{index, task_id, env_id, pool, category, split, tools_kwargs, metadata}``.
                    ``index`` is the row number (verl copies it to ``index``); ``tools_kwargs``
                    is ``{"envace": {"create_kwargs": {"pool", "task_id"}}}`` (verl copies it to
                    ``tools_kwargs``), which is all an agent loop needs to ``get_pool(pool)
                    .start(task_id)``; ``metadata`` is a JSON string of pool-specific extras.
==================  ===========================================================================

Every column has one fixed Arrow type (:data:`ROW_SCHEMA`), so parquet files from different pools
concatenate (``datasets.concatenate_datasets``) without struct unification surprises.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from envace.envs.base import EnvironmentPool, TaskSpec, get_pool

__all__ = [
    "DEFAULT_AGENT_NAME",
    "ROW_SCHEMA",
    "DatasetBuildError",
    "build_parquet",
    "stable_order",
    "task_row",
    "write_rows",
]

DEFAULT_AGENT_NAME = "envace_env"  # the real-environment loop (envace/agents/agent_loops.yaml)

_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
ROW_SCHEMA = pa.schema(
    [
        ("prompt", pa.list_(_MESSAGE)),
        ("data_source", pa.string()),
        ("agent_name", pa.string()),
        ("tools", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("index", pa.int64()),
                    ("task_id", pa.string()),
                    ("env_id", pa.string()),
                    ("pool", pa.string()),
                    ("category", pa.string()),
                    ("split", pa.string()),
                    (
                        "tools_kwargs",
                        pa.struct(
                            [
                                (
                                    "envace",
                                    pa.struct(
                                        [
                                            (
                                                "create_kwargs",
                                                pa.struct([("pool", pa.string()), ("task_id", pa.string())]),
                                            )
                                        ]
                                    ),
                                )
                            ]
                        ),
                    ),
                    ("metadata", pa.string()),
                ]
            ),
        ),
    ]
)


class DatasetBuildError(RuntimeError):
    """The dataset cannot be built as asked (overlapping splits, empty split, bad messages...)."""


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------


def _messages(messages: Sequence[Mapping[str, Any]], where: str) -> list[dict[str, str]]:
    out = []
    for i, msg in enumerate(messages):
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise DatasetBuildError(f"{where}: prompt message {i} needs string 'role' and 'content', got {msg!r:.200}")
        out.append({"role": role, "content": content})
    if not out:
        raise DatasetBuildError(f"{where}: empty prompt")
    return out


def task_row(
    *,
    pool: str,
    task_id: str,
    env_id: str,
    category: str,
    split: str,
    prompt: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    agent_name: str,
    ground_truth: Any,
    reward_style: str = "rule",
    metadata: Mapping[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One dataset row in the layout of :data:`ROW_SCHEMA` (see the module docstring)."""
    where = f"{pool}:{task_id}"
    return {
        "prompt": _messages(prompt, where),
        "data_source": f"{pool}/{category}",
        "agent_name": agent_name,
        "tools": json.dumps(list(tools), ensure_ascii=False),
        "reward_model": {"style": reward_style, "ground_truth": json.dumps(ground_truth, ensure_ascii=False)},
        "extra_info": {
            "index": int(index),
            "task_id": task_id,
            "env_id": env_id,
            "pool": pool,
            "category": category,
            "split": split,
            "tools_kwargs": {"envace": {"create_kwargs": {"pool": pool, "task_id": task_id}}},
            "metadata": json.dumps(dict(metadata or {}), ensure_ascii=False, default=repr),
        },
    }


def row_from_spec(pool: EnvironmentPool, spec: TaskSpec, agent_name: str, index: int = 0) -> dict[str, Any]:
    """A dataset row for a pool task; ``ground_truth`` is the gold actions (``null`` if the pool has none)."""
    try:
        gold: Any = [[c.to_dict() for c in turn] for turn in pool.gold_actions(spec.task_id)]
    except NotImplementedError:
        gold = None
    return task_row(
        pool=spec.pool,
        task_id=spec.task_id,
        env_id=spec.env_id,
        category=spec.category,
        split=spec.split,
        prompt=spec.initial_messages(),
        tools=spec.tools,
        agent_name=agent_name,
        ground_truth=gold,
        metadata=spec.metadata,
        index=index,
    )


def write_rows(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write rows as parquet with :data:`ROW_SCHEMA`, renumbering ``extra_info.index`` 0..n-1."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    numbered = []
    for i, row in enumerate(rows):
        row = dict(row)
        row["extra_info"] = {**row["extra_info"], "index": i}
        numbered.append(row)
    table = pa.Table.from_pylist(numbered, schema=ROW_SCHEMA)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)  # atomic: a crashed build never leaves a half-written file under the final name
    return path


def stable_order(task_ids: Iterable[str], seed: int | str = 0) -> list[str]:
    """Task ids in a seed-determined pseudo-random order (sha256), identical on every machine."""
    import hashlib

    return sorted(task_ids, key=lambda t: hashlib.sha256(f"{seed}:{t}".encode()).hexdigest())


def build_parquet(
    pool_names: Sequence[str],
    out_dir: str | Path,
    agent_name: str = DEFAULT_AGENT_NAME,
    *,
    splits: tuple[str, str] = ("train", "test"),
    limit_per_pool: int | None = None,
    pool_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    seed: int | str = 0,
    val_agent_name: str | None = None,
    train_task_ids: Sequence[str] | None = None,
    train_agent_by_env: Mapping[str, str] | None = None,
    categories: Sequence[str] | None = None,
) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` (+ ``manifest.json``) for ``pool_names`` into ``out_dir``.

    Training rows run ``agent_name``'s loop, validation rows ``val_agent_name``'s (default: the same); a training
    row whose environment is a key of ``train_agent_by_env`` runs that loop instead (the environments Trace2Env's
    simulator serves, :mod:`envace.data.worldbooks`).

    The train file holds each pool's ``splits[0]`` tasks and the validation file its ``splits[1]`` tasks
    (pools define their own deterministic splits; BFCL's is a scenario-level hash, τ²'s the official
    one). ``limit_per_pool`` keeps, per pool and split, the first N tasks of :func:`stable_order` (a
    spread over categories, not the first N ids). ``train_task_ids`` keeps, instead, exactly those training
    tasks, in that order (each must be in some pool's ``splits[0]``). ``categories`` keeps only the tasks whose
    ``TaskSpec.category`` is one of them, in both files, before ``limit_per_pool`` (explicit ``train_task_ids`` are
    kept as given). Raises :class:`DatasetBuildError` if a pool refuses its ``pool_kwargs``, a task would appear in
    both files, a file would be empty or a ``train_task_ids`` entry is in no pool's train split.
    """
    if not pool_names:
        raise DatasetBuildError("no pools given")
    if limit_per_pool is not None and limit_per_pool <= 0:
        raise DatasetBuildError(f"limit_per_pool must be positive, got {limit_per_pool}")
    train_split, val_split = splits
    out = Path(out_dir)
    rows: dict[str, list[dict[str, Any]]] = {train_split: [], val_split: []}
    agents = {train_split: agent_name, val_split: val_agent_name or agent_name}
    by_env = dict(train_agent_by_env or {})
    manifest: dict[str, Any] = {"agent_name": agent_name, "val_agent_name": agents[val_split],
                                "splits": list(splits), "pools": {},
                                **({"train_agent_by_env": dict(sorted(by_env.items()))} if by_env else {})}
    unplaced = set(train_task_ids or ())
    for name in dict.fromkeys(pool_names):
        kwargs = dict((pool_kwargs or {}).get(name, {}))
        try:
            pool = get_pool(name, **kwargs)
        except (TypeError, ValueError) as exc:  # an option the pool does not take, or a value it refuses
            raise DatasetBuildError(f"pool {name!r} with options {kwargs}: {exc}") from None
        ids_by_split = {}
        for split in splits:
            ids = pool.task_ids(split)
            if categories is not None and not (split == train_split and train_task_ids is not None):
                keep = set(categories)
                ids = [t for t in ids if pool.task(t).category in keep]
            if split == train_split and train_task_ids is not None:
                known = set(ids)
                ids = [t for t in train_task_ids if t in known]
                unplaced.difference_update(ids)
            elif limit_per_pool is not None:
                ids = stable_order(ids, seed)[:limit_per_pool]
            ids_by_split[split] = ids
        overlap = set(ids_by_split[train_split]) & set(ids_by_split[val_split])
        if overlap:
            raise DatasetBuildError(
                f"pool {name!r}: {len(overlap)} task(s) are in both {train_split!r} and {val_split!r}, "
                f"e.g. {sorted(overlap)[:5]}"
            )
        counts: dict[str, dict[str, int]] = {}
        for split, ids in ids_by_split.items():
            per_cat: Counter[str] = Counter()
            for tid in ids:
                spec = pool.task(tid)
                agent = by_env.get(spec.env_id, agents[split]) if split == train_split else agents[split]
                rows[split].append(row_from_spec(pool, spec, agent))
                per_cat[spec.category] += 1
            counts[split] = dict(sorted(per_cat.items()))
        manifest["pools"][name] = counts
    if unplaced:
        raise DatasetBuildError(f"train_task_ids: {len(unplaced)} id(s) in no {train_split!r} split of pools "
                                f"{list(pool_names)}, e.g. {sorted(unplaced)[:3]}")
    for split in splits:
        if not rows[split]:
            raise DatasetBuildError(f"split {split!r} has no tasks in pools {list(pool_names)}")
    keys = {s: {(r["extra_info"]["pool"], r["extra_info"]["task_id"]) for r in rows[s]} for s in splits}
    if keys[train_split] & keys[val_split]:  # defensive: also catches duplicates across pools' namespaces
        raise DatasetBuildError("train and validation share tasks")
    train_path = write_rows(rows[train_split], out / "train.parquet")
    val_path = write_rows(rows[val_split], out / "val.parquet")
    manifest["rows"] = {train_split: len(rows[train_split]), val_split: len(rows[val_split])}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return train_path, val_path
