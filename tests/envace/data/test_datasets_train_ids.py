"""``build_parquet``'s ``train_task_ids``: exactly the named training tasks, validation untouched, and an id no
pool's train split holds refused with the id named (not silently dropped)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from envace.data.datasets import DatasetBuildError, build_parquet
from envace.envs.base import get_pool

KW = {"synthetic": {"shapes": ["act", "query"], "renamings": False}}


def _ids(path) -> list[str]:
    return [r["task_id"] for r in pq.read_table(path).column("extra_info").to_pylist()]


def test_train_task_ids_keep_exactly_those_tasks(tmp_path):
    pool = get_pool("synthetic", **KW["synthetic"])
    chosen = pool.task_ids("train")[5:8][::-1]
    train, val = build_parquet(["synthetic"], tmp_path / "a", pool_kwargs=KW, train_task_ids=chosen,
                               limit_per_pool=2)
    assert _ids(train) == chosen  # the order given, the cap not applied to them
    assert len(_ids(val)) == 2  # validation still follows the cap


def test_unknown_or_held_out_ids_are_refused(tmp_path):
    pool = get_pool("synthetic", **KW["synthetic"])
    test_id = pool.task_ids("test")[0]
    for bad in ("no-such-task", test_id):
        with pytest.raises(DatasetBuildError, match="train_task_ids") as err:
            build_parquet(["synthetic"], tmp_path / bad, pool_kwargs=KW,
                          train_task_ids=[pool.task_ids("train")[0], bad])
        assert bad in str(err.value)
    assert not (tmp_path / "no-such-task").exists()  # nothing written before the check
