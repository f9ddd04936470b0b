"""Dataset builders (verl parquet read back by verl's own RLHFDataset)."""

from __future__ import annotations

import json
import os
from typing import Any

import pyarrow.parquet as pq
import pytest

from envace.data.datasets import ROW_SCHEMA, DatasetBuildError, build_parquet
from envace.envs.base import EnvironmentPool, TaskSpec, ToolCall, get_pool, register_pool

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _tokenizer():
    try:
        from envace.models.tokenizer import build_qwen3_tokenizer
    except ImportError:  # pragma: no cover - envace.models not present
        return None
    return build_qwen3_tokenizer()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("bfcl_data")
    train, val = build_parquet(["bfcl_multi_turn"], out, "envace_agent", limit_per_pool=6)
    return out, train, val


def test_parquet_layout_and_no_overlap(built):
    out, train, val = built
    tables = {p.name: pq.read_table(p) for p in (train, val)}
    for table in tables.values():
        assert table.schema.equals(ROW_SCHEMA)
        assert table.num_rows == 6
    rows = {name: t.to_pylist() for name, t in tables.items()}
    ids = {name: {r["extra_info"]["task_id"] for r in rs} for name, rs in rows.items()}
    assert not ids["train.parquet"] & ids["val.parquet"]
    assert {r["extra_info"]["split"] for r in rows["train.parquet"]} == {"train"}
    assert {r["extra_info"]["split"] for r in rows["val.parquet"]} == {"test"}
    # No scenario leaks either (the BFCL split is per scenario).
    scen = {n: {json.loads(r["extra_info"]["metadata"])["scenario"] for r in rs} for n, rs in rows.items()}
    assert not scen["train.parquet"] & scen["val.parquet"]
    assert [r["extra_info"]["index"] for r in rows["train.parquet"]] == list(range(6))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == {"train": 6, "test": 6}

    pool = get_pool("bfcl_multi_turn")
    for r in rows["train.parquet"]:
        tid = r["extra_info"]["task_id"]
        spec = pool.task(tid)
        assert r["prompt"] == spec.initial_messages()
        assert json.loads(r["tools"]) == spec.tools
        assert r["reward_model"]["style"] == "rule"
        gold = [[ToolCall.from_dict(c) for c in turn] for turn in json.loads(r["reward_model"]["ground_truth"])]
        assert gold == pool.gold_actions(tid)
        assert r["data_source"] == f"bfcl_multi_turn/{spec.category}"
        assert r["extra_info"]["tools_kwargs"] == {
            "envace": {"create_kwargs": {"pool": "bfcl_multi_turn", "task_id": tid}}
        }
        assert r["extra_info"]["env_id"] == spec.env_id and r["agent_name"] == "envace_agent"


def test_read_back_with_verls_rlhf_dataset(built, tmp_path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    _, train, val = built
    tokenizer = _tokenizer()
    config = OmegaConf.create(
        {
            "prompt_key": "prompt",
            "max_prompt_length": 8192,
            "filter_overlong_prompts": tokenizer is not None,
            "filter_overlong_prompts_workers": 1,
            "cache_dir": str(tmp_path / "verl_cache"),
        }
    )
    seen: dict[str, set[str]] = {}
    for name, path in (("train", train), ("val", val)):
        ds = RLHFDataset(str(path), tokenizer, config)
        assert len(ds) == 6  # nothing filtered or lost
        seen[name] = set()
        for i in range(len(ds)):
            row = ds[i]
            assert row["raw_prompt"][0]["role"] == "user" and row["raw_prompt"][-1]["content"]
            assert row["agent_name"] == "envace_agent"
            assert row["index"] == i
            assert row["tools_kwargs"]["envace"]["create_kwargs"]["task_id"] == row["extra_info"]["task_id"]
            assert json.loads(row["tools"])[0]["type"] == "function"
            seen[name].add(row["extra_info"]["task_id"])
            if tokenizer is not None and i == 0:
                text = tokenizer.apply_chat_template(
                    row["raw_prompt"], tools=json.loads(row["tools"]), add_generation_prompt=True, tokenize=False
                )
                assert "<tools>" in text and row["raw_prompt"][0]["content"] in text
    assert not seen["train"] & seen["val"]


# -- a fake pool to exercise the builder's guards ---------------------------------------------------------


class _FakePool(EnvironmentPool):
    name = "test_envs_datasets_fake"

    def __init__(self, overlap: bool = False, empty_test: bool = False) -> None:
        self.overlap, self.empty_test = overlap, empty_test

    def task_ids(self, split: str | None = None) -> list[str]:
        if split == "train":
            return ["a", "b"]
        if split == "test":
            return [] if self.empty_test else (["b", "c"] if self.overlap else ["c"])
        return ["a", "b", "c"]

    def task(self, task_id: str) -> TaskSpec:
        return TaskSpec(
            pool=self.name,
            task_id=task_id,
            env_id="fake",
            category="cat",
            split="train" if task_id != "c" else "test",
            system_prompt="sys",
            first_user_message=f"do {task_id}",
            tools=[],
        )

    def start(self, task_id: str, **kwargs: Any):  # pragma: no cover - not used
        raise NotImplementedError

    def gold_actions(self, task_id: str) -> list[list[ToolCall]]:
        raise NotImplementedError


register_pool(_FakePool.name)(_FakePool)


def test_builder_refuses_overlap_and_empty_split(tmp_path):
    with pytest.raises(DatasetBuildError, match="in both 'train' and 'test'"):
        build_parquet([_FakePool.name], tmp_path, "a", pool_kwargs={_FakePool.name: {"overlap": True}})
    with pytest.raises(DatasetBuildError, match="split 'test' has no tasks"):
        build_parquet([_FakePool.name], tmp_path, "a", pool_kwargs={_FakePool.name: {"empty_test": True}})
    assert not (tmp_path / "train.parquet").exists()
    train, _ = build_parquet([_FakePool.name], tmp_path, "a")
    rows = pq.read_table(train).to_pylist()
    assert rows[0]["prompt"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "do a"}]
    assert rows[0]["reward_model"]["ground_truth"] == "null"  # pool without gold actions
