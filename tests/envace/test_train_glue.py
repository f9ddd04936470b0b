"""Fast tests of the trainer's glue: ``envace.train.fit_prompts`` (rows whose prompt fits once their own tools
are rendered, with the real Qwen3 tokenizer on real BFCL rows), ``envace.train.build_data`` (the parquet files
of ``envace.data``, cached by recipe; a multi-node run's, with its worldbooks, in its run directory),
``envace.train.worker_paths`` (what every node must see, each path named by what moves it), ``build_folders``
(where the builds will write, checked on every node before they start) and
``envace.launch.wait_nodes`` (a multi-node launch waiting for its
Ray cluster; Ray itself is replaced by a scripted stand-in and the clock by a fake one)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from envace.config import AgentConfig, ConfigError, DataConfig, EnvAceConfig, validate_envace_config
from envace.data.datasets import build_parquet
from envace.train import build_data, fit_prompts, resolve_worldbooks, worker_paths
from envace.verl.config import compose

NO_THINK = {"enable_thinking": False}


# -- fit_prompts ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir() -> str:
    from envace.models import ensure_tiny_model

    return str(ensure_tiny_model())  # the real Qwen3 tokenizer and chat template live there


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory) -> Path:
    """Real BFCL rows (their tools differ per task: the classes each task involves)."""
    out = tmp_path_factory.mktemp("bfcl")
    train, _ = build_parquet(["bfcl_multi_turn"], out, limit_per_pool=10, seed=3)
    return Path(train)


def prompt_lengths(tokenizer, path: Path, with_tools: bool = True) -> dict[str, int]:
    """Tokens of each row's rendered prompt (task id → length), tokenised by the chat template itself."""
    out = {}
    for row in pq.read_table(path).to_pylist():
        tools = json.loads(row["tools"]) if with_tools and row["tools"] else None
        ids = tokenizer.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True, tokenize=True,
                                            return_dict=False, **NO_THINK)
        out[row["extra_info"]["task_id"]] = len(ids)
    return out


def task_ids(path: str | Path) -> list[str]:
    return [r["task_id"] for r in pq.read_table(path, columns=["extra_info"]).column(0).to_pylist()]


def test_fit_prompts_keeps_exactly_the_rows_that_fit_with_their_own_tools(rows_file, model_dir, tokenizer, capsys):
    lengths = prompt_lengths(tokenizer, rows_file)
    bare = prompt_lengths(tokenizer, rows_file, with_tools=False)
    limit = sorted(lengths.values())[len(lengths) // 2]  # the median: some rows fit, some do not
    out = fit_prompts(str(rows_file), model_dir, limit, NO_THINK)
    assert out != str(rows_file) and Path(out).name.startswith(f"{rows_file.stem}.fit-{limit}-")
    kept = task_ids(out)
    assert kept == [t for t in task_ids(rows_file) if lengths[t] <= limit]  # the same order, nothing else
    dropped = set(lengths) - set(kept)
    assert kept and dropped
    # the dropped rows would have fitted without their tools: verl's own filter (global tools) keeps them
    assert all(bare[t] <= limit for t in dropped)
    assert f"{len(kept)}/{len(lengths)} rows of {rows_file.name} fit data.max_prompt_length={limit}" in capsys.readouterr().out
    # kept rows are copied whole; the input is left as it was
    src = {r["extra_info"]["task_id"]: r for r in pq.read_table(rows_file).to_pylist()}
    assert all(src[r["extra_info"]["task_id"]] == r for r in pq.read_table(out).to_pylist())
    assert len(task_ids(rows_file)) == len(lengths)


def test_fit_prompts_limit_is_inclusive(rows_file, model_dir, tokenizer):
    lengths = prompt_lengths(tokenizer, rows_file)
    first, second, third = sorted(lengths, key=lengths.get)[:3]
    assert lengths[first] < lengths[second] < lengths[third]
    at = lengths[second]
    assert set(task_ids(fit_prompts(str(rows_file), model_dir, at, NO_THINK))) == {first, second}
    assert set(task_ids(fit_prompts(str(rows_file), model_dir, at - 1, NO_THINK))) == {first}
    with pytest.raises(ConfigError, match=f"no row of .* fits data.max_prompt_length={lengths[first] - 1}"):
        fit_prompts(str(rows_file), model_dir, lengths[first] - 1, NO_THINK)
    assert not list(rows_file.parent.glob("*.tmp"))  # a refused filter leaves no half-written file
    assert not list(rows_file.parent.glob(f"*.fit-{lengths[first] - 1}-*"))


def test_fit_prompts_reuses_its_file_and_keys_it_by_the_rendering(rows_file, model_dir, tokenizer, monkeypatch):
    lengths = prompt_lengths(tokenizer, rows_file)
    limit = max(lengths.values())
    first = fit_prompts(str(rows_file), model_dir, limit, NO_THINK)
    assert task_ids(first) == task_ids(rows_file)
    thinking = fit_prompts(str(rows_file), model_dir, limit, {"enable_thinking": True})
    assert thinking != first  # another chat-template setting renders other prompts: another file

    import transformers

    def no_tokenizer(*args: Any, **kwargs: Any):
        raise AssertionError("the filtered file exists: nothing is tokenised again")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_tokenizer)
    assert fit_prompts(str(rows_file), model_dir, limit, NO_THINK) == first


def test_fit_prompts_passes_files_without_per_row_tools_through(tmp_path, model_dir):
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "hi"}]], "data_source": ["x"]}), path)
    assert fit_prompts(str(path), model_dir, 8, NO_THINK) == str(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.parquet"]


# -- build_data ----------------------------------------------------------------------------------------------


def ecfg(**changes: Any) -> EnvAceConfig:
    data = {"pools": ["bfcl_multi_turn"], "max_tasks_per_pool": 3, "seed": 0, "out_dir": None}
    agent = {"observation_source": "rehearse", "val_observation_source": "real", "pool_kwargs": {}}
    for key, value in changes.items():
        (agent if key in agent else data)[key] = value
    return EnvAceConfig(data=DataConfig(**data), agent=AgentConfig(**agent))


#: a one-node config: its generated data goes to the cache
CFG = OmegaConf.create({"trainer": {"nnodes": 1, "default_local_dir": "/nonexistent/run"}})


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_build_data_writes_train_and_validation_rows_of_the_recipe(cache):
    train, val = build_data(CFG, ecfg())
    assert Path(train).parent == Path(val).parent and Path(train).parent.parent == cache / "data"
    t, v = pq.read_table(train).to_pylist(), pq.read_table(val).to_pylist()
    assert len(t) == len(v) == 3
    assert {r["agent_name"] for r in t} == {"envace_act_rehearse"} and {r["agent_name"] for r in v} == {"envace_env"}
    assert {r["extra_info"]["split"] for r in t} == {"train"} and {r["extra_info"]["split"] for r in v} == {"test"}
    assert not {r["extra_info"]["task_id"] for r in t} & {r["extra_info"]["task_id"] for r in v}
    assert (Path(train).parent / "manifest.json").is_file()


def test_build_data_reuses_a_complete_build_of_the_same_recipe(cache, monkeypatch):
    first = build_data(CFG, ecfg())
    from envace.data import datasets

    def no_build(*args: Any, **kwargs: Any):
        raise AssertionError("built again")

    monkeypatch.setattr(datasets, "build_parquet", no_build)
    assert build_data(CFG, ecfg()) == first
    (Path(first[0]).parent / "manifest.json").unlink()  # an interrupted build: never reused
    with pytest.raises(AssertionError, match="built again"):
        build_data(CFG, ecfg())


@pytest.mark.parametrize("change", [
    {"seed": 1},
    {"max_tasks_per_pool": 4},
    {"pools": ["bfcl_multi_turn", "tau2"]},
    {"train_split": "test", "val_split": "train"},
    {"observation_source": "real"},
    {"val_observation_source": "rehearse"},
    {"pool_kwargs": {"bfcl_multi_turn": {"test_fraction": 0.3}}},
])
def test_every_recipe_field_keys_the_cache(cache, change):
    base = build_data(CFG, ecfg())
    other = build_data(CFG, ecfg(**change))
    assert Path(other[0]).parent != Path(base[0]).parent
    assert build_data(CFG, ecfg()) == base  # the first build is still there, untouched


def test_build_data_honours_out_dir(tmp_path, cache):
    train, val = build_data(CFG, ecfg(out_dir=str(tmp_path / "mine")))
    assert (Path(train), Path(val)) == (tmp_path / "mine" / "train.parquet", tmp_path / "mine" / "val.parquet")
    assert not (cache / "data").exists()


def test_an_out_dir_is_reused_only_for_its_own_recipe(tmp_path, cache, monkeypatch):
    mine = str(tmp_path / "mine")
    first = build_data(CFG, ecfg(out_dir=mine))
    rows = pq.read_table(first[0]).num_rows
    from envace.data import datasets

    def no_build(*args: Any, **kwargs: Any):
        raise AssertionError("built again")

    monkeypatch.setattr(datasets, "build_parquet", no_build)
    assert build_data(CFG, ecfg(out_dir=mine)) == first  # same recipe: reused
    # another recipe in the same folder: a clear error naming what differs, the old build left as it was
    with pytest.raises(ConfigError, match=r"another recipe \(differs in max, seed\)"):
        build_data(CFG, ecfg(out_dir=mine, max_tasks_per_pool=4, seed=1))
    assert pq.read_table(first[0]).num_rows == rows
    (tmp_path / "mine" / "recipe.json").unlink()  # a build whose recipe is unknown is not trusted either
    with pytest.raises(ConfigError, match="no recipe.json"):
        build_data(CFG, ecfg(out_dir=mine))


@pytest.mark.parametrize("nnodes", [1, 2])
def test_a_multinode_run_generates_its_data_and_worldbooks_in_its_run_directory(tmp_path, cache, nnodes):
    """Workers on every node read the generated parquet and books: with several nodes they go under the run
    directory, which a multi-node run keeps on shared storage anyway; one node keeps the reusable cache."""
    run = tmp_path / "run"
    cfg = compose(["experiment=cpu_all", "+envace.agent.pool_kwargs.synthetic.n_envs=4", "envace.preflight=false",
                   "envace.agent.simulated_envs=[syn-bank-00]", f"trainer.nnodes={nnodes}",
                   f"trainer.default_local_dir={run}"])
    ecfg = validate_envace_config(cfg)
    train, val = build_data(cfg, ecfg, resolve_worldbooks(cfg, ecfg))
    root, other = (run, cache) if nnodes > 1 else (cache, run)
    books = Path(cfg.envace.agent.worldbook)
    assert books.name == "books" and books.parent.parent == root / "worldbooks"
    assert Path(train).parent.parent == root / "data" and Path(val).parent == Path(train).parent
    assert not (other / "data").exists() and not (other / "worldbooks").exists()


def test_every_path_a_worker_reads_is_named_by_what_moves_it(tmp_path, monkeypatch):
    """The shared-storage check's error names, for each path a node cannot see, its key and the folder it lies
    under: the generated data under the run directory or envace.data.out_dir, a builtin model under ENVACE_CACHE
    (set, or unset: the home directory's)."""
    run, mine = tmp_path / "run", tmp_path / "mine"
    cfg = compose([f"trainer.default_local_dir={run}", f"envace.data.out_dir={mine}",
                   f"envace.agent.worldbook={tmp_path / 'books'}"])
    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    cfg.actor_rollout_ref.model.path = str(tmp_path / "cache" / "models" / "tiny-qwen3")
    cfg.data.train_files = [str(run / "data" / "d1" / "train.parquet"), "/data/extra.parquet"]
    cfg.data.val_files = str(mine / "val.parquet")
    assert worker_paths(cfg) == {
        "actor_rollout_ref.model.path (under ENVACE_CACHE)": cfg.actor_rollout_ref.model.path,
        "data.train_files[0] (under trainer.default_local_dir)": cfg.data.train_files[0],
        "data.train_files[1]": "/data/extra.parquet",
        "data.val_files[0] (under envace.data.out_dir)": cfg.data.val_files,
        "envace.agent.worldbook": str(tmp_path / "books"),
    }
    monkeypatch.delenv("ENVACE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg.actor_rollout_ref.model.path = str(tmp_path / "home" / ".cache" / "envace" / "models" / "tiny-qwen3-warm")
    assert "actor_rollout_ref.model.path (under ENVACE_CACHE, unset: ~/.cache/envace)" in worker_paths(cfg)


def test_before_the_builds_the_check_covers_the_paths_given_and_the_folders_the_builds_write_into(tmp_path,
                                                                                                   monkeypatch):
    """On a config not yet built, ``worker_paths`` leaves out what the builds make (``auto``, ``builtin:``) and
    ``build_folders`` names the folders they will write into besides the run directory: ``$ENVACE_CACHE/models`` for a
    ``builtin:`` model, ``envace.data.out_dir``, and the cache itself for the generated files of a one-node config."""
    from envace.train import build_folders

    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    run, model, out = tmp_path / "run", tmp_path / "model", tmp_path / "out"
    cfg = compose([f"trainer.default_local_dir={run}", "trainer.nnodes=2",
                   "actor_rollout_ref.model.path=builtin:tiny-qwen3"])
    assert worker_paths(cfg) == {}
    models = str(tmp_path / "cache" / "models")
    assert build_folders(cfg) == {"actor_rollout_ref.model.path (under ENVACE_CACHE)": models}
    cfg = compose([f"trainer.default_local_dir={run}", "trainer.nnodes=1", f"actor_rollout_ref.model.path={model}",
                   "envace.agent.worldbook=auto"])
    assert worker_paths(cfg) == {"actor_rollout_ref.model.path": str(model)}
    assert build_folders(cfg) == {
        "data.*_files: auto and envace.agent.worldbook: auto (under ENVACE_CACHE)": str(tmp_path / "cache")}
    cfg = compose([f"trainer.default_local_dir={run}", "trainer.nnodes=2", f"actor_rollout_ref.model.path={model}",
                   f"envace.data.out_dir={out}", f"data.val_files={tmp_path / 'val.parquet'}"])
    assert worker_paths(cfg) == {"actor_rollout_ref.model.path": str(model),
                                 "data.val_files[0]": str(tmp_path / "val.parquet")}
    assert build_folders(cfg) == {"envace.data.out_dir": str(out)}


# -- launch.wait_nodes ---------------------------------------------------------------------------------------


class FakeClock:
    """``time.monotonic`` / ``time.sleep`` of envace.launch: sleeping advances the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class FakeRay:
    """What wait_nodes uses of Ray: ``init`` refused until ``up_at``; ``nodes()`` lists ``alive(now)`` alive nodes
    and one dead one."""

    def __init__(self, clock: FakeClock, up_at: float, alive) -> None:
        self.clock, self.up_at, self.alive = clock, up_at, alive
        self.inits: list[tuple[float, str]] = []
        self.node_queries: list[float] = []
        self.connected = False
        self.shutdowns = 0

    def init(self, address: str, log_to_driver: bool = True) -> None:
        self.inits.append((self.clock.now, address))
        if self.clock.now < self.up_at:
            raise ConnectionError(f"could not connect to {address}")
        self.connected = True

    def nodes(self) -> list[dict[str, Any]]:
        assert self.connected
        self.node_queries.append(self.clock.now)
        return [{"Alive": True}] * self.alive(self.clock.now) + [{"Alive": False}]

    def shutdown(self) -> None:
        self.connected = False
        self.shutdowns += 1


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    import envace.launch

    c = FakeClock()
    monkeypatch.setattr(envace.launch, "time", c)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return c


def install(monkeypatch, ray: FakeRay) -> FakeRay:
    monkeypatch.setitem(sys.modules, "ray", ray)
    return ray


def test_wait_nodes_retries_the_head_then_waits_for_every_node(clock, monkeypatch, capsys):
    from envace.launch import wait_nodes

    ray = install(monkeypatch, FakeRay(clock, up_at=4.0, alive=lambda t: 1 + int(t - 4) // 2))
    assert wait_nodes(3, timeout=60, poll=2.0, address="head:6379") == 0
    assert [t for t, _ in ray.inits] == [0.0, 2.0, 4.0] and {a for _, a in ray.inits} == {"head:6379"}
    assert ray.node_queries == [4.0, 6.0, 8.0]  # 1, 2, 3 alive (the dead node never counts)
    assert ray.shutdowns == 1 and not ray.connected
    assert "Ray cluster has 3/3 nodes" in capsys.readouterr().out


def test_wait_nodes_gives_up_on_a_head_that_never_answers(clock, monkeypatch, capsys):
    from envace.launch import wait_nodes

    ray = install(monkeypatch, FakeRay(clock, up_at=float("inf"), alive=lambda t: 9))
    assert wait_nodes(2, timeout=10, poll=2.0, address="head:6379") == 1
    assert [t for t, _ in ray.inits] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0]  # at most one poll past the deadline
    assert "cannot connect to the Ray cluster at head:6379" in capsys.readouterr().err


def test_wait_nodes_times_out_with_too_few_nodes_and_disconnects(clock, monkeypatch, capsys):
    from envace.launch import wait_nodes

    ray = install(monkeypatch, FakeRay(clock, up_at=2.0, alive=lambda t: 2))  # the deadline covers both phases
    assert wait_nodes(3, timeout=9, poll=2.0, address="head:6379") == 1
    assert ray.node_queries == [2.0, 4.0, 6.0, 8.0, 10.0] and ray.shutdowns == 1 and not ray.connected
    assert "only 2/3 Ray nodes joined within 9s" in capsys.readouterr().err


def test_wait_nodes_address_comes_from_ray_address_or_is_required(clock, monkeypatch, capsys):
    from envace.launch import main, wait_nodes

    ray = install(monkeypatch, FakeRay(clock, up_at=0.0, alive=lambda t: 2))
    assert wait_nodes(2, timeout=5) == 2 and ray.inits == []
    assert "needs --address or RAY_ADDRESS" in capsys.readouterr().err
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert main(["wait-nodes", "--nodes", "2", "--timeout", "5"]) == 0
    assert ray.inits == [(0.0, "10.0.0.1:6379")]
    assert main(["wait-nodes", "--nodes", "2", "--address", "10.0.0.2:6379"]) == 0  # the flag wins
    assert ray.inits[-1] == (0.0, "10.0.0.2:6379")
