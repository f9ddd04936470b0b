"""Per-environment simulation (``envace.agent.simulated_envs``, the ``cpu_all`` recipe): the config checks, the
pre-flight that resolves the entries against the training data and builds or checks the worldbooks, the data
build that routes the simulated environments' training rows to the simulator's loop, and the loop's count of
simulated calls. The end-to-end run of ``cpu_all`` is ``tests/envace/test_async_e2e.py`` (on verl's async trainer).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from envace.agents import LOOP_NAMES
from envace.config import ConfigError, validate_envace_config
from envace.data.traces import record_pool
from envace.envs.synthetic import SyntheticPool
from envace.train import build_data, prepare, resolve_worldbooks
from envace.verl.config import compose
from trace2env import load_worldbooks, parse_trace
from trace2env.build import build_worldbook

REPO = Path(__file__).resolve().parents[2]
#: four environments (bank, shop, calendar, files) of the warm start's task shapes: a pool built in a second
SMALL = ["+envace.agent.pool_kwargs.synthetic.n_envs=4"]


@functools.cache
def pool_kwargs() -> dict:
    """The pool those overrides give: cpu_all's own pool kwargs, from its config (so the expected counts follow
    them), with 4 environments. Composed on first use, not at import (a compose takes seconds)."""
    return {**OmegaConf.to_container(compose(["experiment=cpu_all"]).envace.agent.pool_kwargs.synthetic), "n_envs": 4}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def cfg_of(tmp_path, *overrides):
    return compose(["experiment=cpu_all", *SMALL, f"envace.data.out_dir={tmp_path / 'data'}",
                    f"trainer.default_local_dir={tmp_path / 'run'}", "envace.preflight=false", *overrides])


def test_cpu_all_is_envace_on_envsched_batches_with_some_environments_simulated():
    cfg = compose(["experiment=cpu_all"])
    assert cfg.trainer.v1.trainer_mode == "envsched_sync" and cfg.algorithm.adv_estimator == "grpo_rolewise"
    agent = validate_envace_config(cfg).agent
    assert (agent.observation_source, agent.val_observation_source) == ("rehearse", "real")
    assert agent.worldbook == "auto" and agent.simulated_envs == ["syn-bank-*", "syn-files-*", "syn-library-*"]
    assert cfg.trainer.experiment_name == "cpu_all"


@pytest.mark.parametrize("overrides, message", [
    (["envace.agent.simulated_envs=[]"], "simulated_envs is empty"),
    (["envace.agent.simulated_envs=[syn-bank-00,syn-bank-00]"], "lists syn-bank-00 twice"),
    (["envace.agent.worldbook=null"], "simulated_envs needs envace.agent.worldbook"),
    (["envace.agent.observation_source=simulator"], "observation_source=simulator already serves every"),
    (["envace.agent.simulated_envs=null"], "worldbook=auto builds books for simulated environments"),
    (["envace.agent.worldbook=/nonexistent/books"], "'/nonexistent/books' does not exist"),
])
def test_bad_simulated_envs_settings_are_one_line_config_errors(overrides, message):
    cfg = compose(["experiment=cpu_all", *overrides])
    with pytest.raises(ConfigError, match=message) as err:
        validate_envace_config(cfg)
    assert "\n" not in str(err.value)


def test_auto_builds_one_book_per_simulated_environment_once(tmp_path, cache):
    cfg = cfg_of(tmp_path, "envace.agent.simulated_envs=[syn-bank-*,syn-files-03]")
    chosen = resolve_worldbooks(cfg, validate_envace_config(cfg))
    assert chosen == ["syn-bank-00", "syn-files-03"]
    books = Path(cfg.envace.agent.worldbook)
    assert books.parent.parent == cache / "worldbooks" and books.name == "books"
    single, by_env = load_worldbooks(books)
    assert not single and sorted(by_env) == chosen
    pool = SyntheticPool(**pool_kwargs())
    for env, wb in by_env.items():
        # built from the recorded traces of that environment's train split, of this pool, without a model
        n_train = sum(pool.task(t).env_id == env for t in pool.task_ids("train"))
        assert wb.manifest.source_count == n_train and wb.manifest.source_pool == "synthetic"
        assert wb.manifest.source_environments == (env,) and wb.manifest.metadata["deterministic"] is True
    # the same traces and code: the cached books, not a rebuild
    stamp = {p: p.stat().st_mtime_ns for p in books.rglob("manifest.json")}
    again = cfg_of(tmp_path, "envace.agent.simulated_envs=[syn-bank-*,syn-files-03]")
    assert resolve_worldbooks(again, validate_envace_config(again)) == chosen
    assert again.envace.agent.worldbook == str(books)
    assert {p: p.stat().st_mtime_ns for p in books.rglob("manifest.json")} == stamp
    assert [p.name for p in books.parent.iterdir() if p.name.startswith(".")] == []


def test_the_simulated_environments_training_rows_run_the_simulator_loop(tmp_path, cache):
    cfg = cfg_of(tmp_path, "envace.agent.simulated_envs=[syn-bank-00,syn-files-03]")
    ecfg = validate_envace_config(cfg)
    train, val = build_data(cfg, ecfg, resolve_worldbooks(cfg, ecfg))
    rows = pq.read_table(train, columns=["agent_name", "extra_info"]).to_pylist()
    by_env = {(r["extra_info"]["env_id"], r["agent_name"]) for r in rows}
    assert by_env == {("syn-bank-00", LOOP_NAMES["simulator"]), ("syn-files-03", LOOP_NAMES["simulator"]),
                      ("syn-shop-01", LOOP_NAMES["rehearse"]), ("syn-calendar-02", LOOP_NAMES["rehearse"])}
    # validation stays in the real environment
    assert set(pq.read_table(val, columns=["agent_name"]).column("agent_name").to_pylist()) == {LOOP_NAMES["real"]}
    # another choice of environments is another data build, never the cached one
    other = cfg_of(tmp_path, "envace.agent.simulated_envs=[syn-bank-00]",
                   f"envace.data.out_dir={tmp_path / 'data2'}")
    oecfg = validate_envace_config(other)
    t2, _ = build_data(other, oecfg, resolve_worldbooks(other, oecfg))
    names = Counter(pq.read_table(t2, columns=["agent_name"]).column("agent_name").to_pylist())
    assert names[LOOP_NAMES["simulator"]] < sum(r["agent_name"] == LOOP_NAMES["simulator"] for r in rows)


def test_an_entry_matching_no_environment_is_refused(tmp_path, cache):
    cfg = cfg_of(tmp_path, "envace.agent.simulated_envs=[syn-bank-00,syn-nope-*]")
    with pytest.raises(ConfigError, match=r"'syn-nope-\*' matches no training environment .*syn-bank-00") as err:
        resolve_worldbooks(cfg, validate_envace_config(cfg))
    assert "\n" not in str(err.value) and not (cache / "worldbooks").exists()
    # explicit training tasks: a pattern still must match an environment of the train split (typos), but only the
    # matched environments with training rows are simulated (and get a book)
    pool = SyntheticPool(**pool_kwargs())
    tasks = [t for env in ("syn-bank-00", "syn-shop-01")
             for t in [t for t in pool.task_ids("train") if pool.task(t).env_id == env][:2]]
    cfg = cfg_of(tmp_path, "envace.agent.simulated_envs=[syn-bank-*,syn-files-*]",
                 f"envace.data.train_task_ids=[{','.join(tasks)}]")
    assert resolve_worldbooks(cfg, validate_envace_config(cfg)) == ["syn-bank-00"]
    assert sorted(load_worldbooks(cfg.envace.agent.worldbook)[1]) == ["syn-bank-00"]
    cfg = cfg_of(tmp_path, "envace.agent.simulated_envs=[syn-files-*]", f"envace.data.train_task_ids=[{','.join(tasks)}]")
    assert resolve_worldbooks(cfg, validate_envace_config(cfg)) == []  # nothing to simulate among these rows


def _book(root: Path, pool_name: str, env: str, traces_pool=None) -> None:
    pool = SyntheticPool(**pool_kwargs())
    traces = record_pool(pool, [t for t in pool.task_ids("train") if pool.task(t).env_id == env][:5])
    for t in traces:
        t["metadata"]["pool"] = traces_pool or pool_name
    build_worldbook([parse_trace(t) for t in traces], root / env, environment_id=env)


def test_a_given_folder_must_hold_a_book_of_the_right_pool_for_every_simulated_environment(tmp_path, cache):
    books = tmp_path / "books"
    _book(books, "synthetic", "syn-bank-00")
    cfg = cfg_of(tmp_path, f"envace.agent.worldbook={books}", "envace.agent.simulated_envs=[syn-bank-00]")
    assert resolve_worldbooks(cfg, validate_envace_config(cfg)) == ["syn-bank-00"]
    assert cfg.envace.agent.worldbook == str(books)
    cfg = cfg_of(tmp_path, f"envace.agent.worldbook={books}", "envace.agent.simulated_envs=[syn-bank-00,syn-shop-01]")
    with pytest.raises(ConfigError, match=r"no book for simulated environment\(s\) syn-shop-01 \(it has 1: "
                                          r"syn-bank-00\)") as err:
        resolve_worldbooks(cfg, validate_envace_config(cfg))
    assert "\n" not in str(err.value)
    other = tmp_path / "other"
    _book(other, "synthetic", "syn-shop-01", traces_pool="bfcl_multi_turn")
    cfg = cfg_of(tmp_path, f"envace.agent.worldbook={other}", "envace.agent.simulated_envs=[syn-shop-01]")
    with pytest.raises(ConfigError, match="built from traces of pool 'bfcl_multi_turn', not of 'synthetic'"):
        resolve_worldbooks(cfg, validate_envace_config(cfg))


def test_a_bad_entry_exits_2_with_one_line_before_anything_is_written(tmp_path):
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-m", "envace.train", "experiment=cpu_all", *SMALL,
                           "envace.agent.simulated_envs=[syn-bnak-*]", f"envace.data.out_dir={tmp_path / 'data'}",
                           f"trainer.default_local_dir={tmp_path / 'run'}"], capture_output=True, text=True,
                          env=dict(os.environ, ENVACE_CACHE=str(cache)), timeout=300, check=False, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = [ln for ln in proc.stderr.splitlines() if "config error" in ln]
    assert line == [("envace: config error: envace.agent.simulated_envs: 'syn-bnak-*' matches no training "
                     "environment (they are 4: syn-bank-00, syn-calendar-02, syn-files-03, syn-shop-01)")]
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists() and not cache.exists()


def test_prepare_hands_the_built_books_to_the_agent_loops(tmp_path, cache, monkeypatch):
    """What the agent loops read (the composed config) names the books pre-flight built, not ``auto``; the
    training rows name both loops. (The model and verl's own checks of it are stubbed: this checks envace's
    pre-flight steps, which run before them.)"""
    from envace import train

    monkeypatch.setattr(train, "resolve_model_path", lambda path, build=True: str(tmp_path / "model"))
    monkeypatch.setattr(train, "validate_verl_config", lambda cfg, model=True: None)
    cfg = cfg_of(tmp_path, "envace.agent.simulated_envs=[syn-files-03]", "data.filter_overlong_prompts=false")
    cfg, ecfg = prepare(cfg)
    books = Path(str(cfg.envace.agent.worldbook))
    assert books.is_dir() and sorted(load_worldbooks(books)[1]) == ["syn-files-03"]
    assert validate_envace_config(cfg).agent.worldbook == ecfg.agent.worldbook == str(books)
    loops = Counter(pq.read_table(str(cfg.data.train_files), columns=["agent_name"]).column("agent_name").to_pylist())
    assert set(loops) == {LOOP_NAMES["simulator"], LOOP_NAMES["rehearse"]}


def test_the_loop_counts_the_calls_the_simulator_answered(tmp_path, cache):
    """A row of a simulated environment in the ``envace_simulator`` loop: every call is answered by the worldbook
    (``simulated_calls``), executed unseen in the real environment and scored there; the rehearse loop's are 0."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.replica import TokenOutput

    from envace.agents.verl_loop import EnvaceAgentLoop
    from envace.models import load_tokenizer
    from envace.toolcall import render_tool_call

    tok = load_tokenizer()
    pool = SyntheticPool(**pool_kwargs())
    books = tmp_path / "books"
    _book(books, "synthetic", "syn-bank-00")
    task = next(t for t in pool.task_ids("train") if pool.task(t).env_id == "syn-bank-00")
    script = [render_tool_call(c.to_dict()) for c in pool.gold_actions(task)[0]] + [pool.gold_replies(task)[0]]

    class Server:
        async def generate(self, request_id, *, prompt_ids, sampling_params, **_):
            text = script.pop(0) if script else "Done."
            ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
            return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed", extra_fields={})

    cfg = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"response_length": 2048, "prompt_length": 4096, "multi_turn": {},
                                          "agent": {}}},
        "envace": {"agent": {"observation_source": "rehearse", "worldbook": str(books),
                             "simulated_envs": ["syn-bank-00"], "pool_kwargs": {"synthetic": pool_kwargs()},
                             "limits": {"max_user_turns": 1}}},
    })
    loop = EnvaceAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=Server(), tokenizer=tok,
                           processor=None, dataset_cls=RLHFDataset,
                           data_config=DictConfigWrap(OmegaConf.create({"apply_chat_template_kwargs": {}})),
                           hf_model_type="qwen3", observation_source="simulator")
    n_calls = len(pool.gold_actions(task)[0])
    outs = loop.loop.run_until_complete(
        loop.run({"temperature": 1.0}, extra_info={"pool": "synthetic", "task_id": task}, uid="u"))
    info = outs[-1].extra_fields["reward_extra_info"]
    assert outs[-1].extra_fields["observation_source"] == "simulator" and outs[-1].extra_fields["env_id"] == "syn-bank-00"
    assert info["simulated_calls"] == info["tool_calls"] == n_calls >= 1
    assert outs[-1].reward_score == 1.0  # the gold calls, replayed in the real environment (the shadow), pass
    assert len(json.loads(outs[-1].extra_fields["fidelity"])) == n_calls
