"""``build_parquet``'s ``categories``: both files hold only tasks of those categories (all of them, before the cap),
explicit ``train_task_ids`` stay as given; the CPU default trains and validates on ``act`` tasks."""

from __future__ import annotations

import pyarrow.parquet as pq

from envace.data.datasets import build_parquet
from envace.envs.base import get_pool

KW = {"synthetic": {"shapes": ["act", "query"], "renamings": False, "n_envs": 4}}


def _ids(path) -> list[str]:
    return [r["task_id"] for r in pq.read_table(path).column("extra_info").to_pylist()]


def test_categories_keep_only_those_tasks_in_both_files(tmp_path):
    pool = get_pool("synthetic", **KW["synthetic"])
    train, val = build_parquet(["synthetic"], tmp_path / "a", pool_kwargs=KW, categories=["act"])
    for path, split in ((train, "train"), (val, "test")):
        want = [t for t in pool.task_ids(split) if pool.task(t).category == "act"]
        assert sorted(_ids(path)) == sorted(want) and want
        assert len(want) < len(pool.task_ids(split))  # query tasks were there to drop
    # the cap counts the kept tasks only
    train, val = build_parquet(["synthetic"], tmp_path / "b", pool_kwargs=KW, categories=["query"], limit_per_pool=3)
    assert len(_ids(train)) == len(_ids(val)) == 3
    assert {pool.task(t).category for t in _ids(train) + _ids(val)} == {"query"}


def test_explicit_train_task_ids_are_kept_as_given(tmp_path):
    pool = get_pool("synthetic", **KW["synthetic"])
    query = [t for t in pool.task_ids("train") if pool.task(t).category == "query"][:2]
    train, val = build_parquet(["synthetic"], tmp_path / "a", pool_kwargs=KW, categories=["act"],
                               train_task_ids=query)
    assert _ids(train) == query
    assert {pool.task(t).category for t in _ids(val)} == {"act"}


def test_the_cpu_default_runs_act_tasks():
    from envace.verl.config import compose

    cfg = compose(["experiment=cpu_default"])
    assert list(cfg.envace.data.categories) == ["act"]
    assert list(cfg.envace.agent.pool_kwargs.synthetic.shapes) == ["act", "query", "lookup_act", "lookup_query"]
