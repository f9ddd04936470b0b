"""The Trace2Env simulator as the observation source of the ONE turn engine, on a worldbook built from gold
replays of the synthetic pool; config plumbing for ``observation_source=simulator envace.agent.worldbook=PATH``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from envace.agents.engine import LoopLimits, Observation, ObservationKind, Reply, StopReason, TurnEngine
from envace.agents.sources import RealSource
from envace.agents.worldbook import WorldbookLibrary, WorldbookSource
from envace.config import AgentConfig, ConfigError, validate_envace_config
from envace.data.__main__ import main as data_main
from envace.envs.gold_trace import initial_state_id, record_gold_trace
from envace.envs.synthetic import SyntheticPool
from envace.toolcall import parse_tool_calls, render_tool_call
from trace2env import build_worldbook, load_traces

REPO = Path(__file__).resolve().parents[3]
KW = {"n_envs": 2, "tasks_per_env": 40, "seed": 3}


class GoldPolicy:
    """Acts the task's gold calls (one per message) and gold replies, whatever the observations say."""

    def __init__(self, pool: SyntheticPool, task_id: str) -> None:
        self.script: list[str] = []
        for turn, reply in zip(pool.gold_actions(task_id), pool.gold_replies(task_id), strict=True):
            self.script += [render_tool_call(c.to_dict()) for c in turn] + [reply]

    async def respond(self, messages, tools, role):
        text = self.script.pop(0) if self.script else "Done."
        p = parse_tool_calls(text)
        return Reply(text=text, content=p.content, calls=p.calls, errors=p.errors)


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    pool = SyntheticPool(**KW)
    env_id = pool.environments()[0]
    train = [t for t in pool.task_ids("train") if pool.task(t).env_id == env_id]
    test = [t for t in pool.task_ids("test") if pool.task(t).env_id == env_id]
    d = tmp_path_factory.mktemp("t2e")
    traces_file = d / "train.jsonl"
    assert data_main(["--pool-kwargs", json.dumps({"synthetic": KW}), "record-traces", "--pool", "synthetic",
                      "--split", "train", "--env-id", env_id, "--out", str(traces_file), "--by-env",
                      str(d / "by_env")]) == 0
    assert len(traces_file.read_text().splitlines()) == len(train)
    assert (d / "by_env" / f"{env_id}.jsonl").read_text() == traces_file.read_text()
    wb_root = d / "books"
    build_worldbook(load_traces([traces_file]), wb_root / "env0", environment_id=env_id)
    return pool, env_id, train, test, wb_root


def _run(pool, task_id, path):
    episode = pool.start(task_id)
    source = WorldbookSource.for_episode(path, episode, shadow=RealSource())
    t = asyncio.run(TurnEngine(LoopLimits()).run(episode, GoldPolicy(pool, task_id), source))
    obs = [o for s in t.steps for o in s.observations]
    return t, obs, source, episode


def test_recorded_trace_recorder_keeps_observations_verbatim(book):
    pool, env_id, train, _, _ = book
    tr = record_gold_trace(pool, train[0])
    tool_msgs = [m["content"] for m in tr["messages"] if m["role"] == "tool"]
    assert tool_msgs == [o for turn in pool.gold_observations(train[0]) for o in turn]
    assert tr["metadata"]["initial_state_id"] == initial_state_id(pool.task(train[0]))
    assert tr["metadata"]["env_id"] == env_id


def test_simulator_replaces_the_environment_in_the_turn_engine(book):
    pool, _, train, test, wb_root = book
    routes: dict[str, int] = {}
    simulated = exact = 0
    for task_id in train[:10] + test:
        t, obs, _, episode = _run(pool, task_id, wb_root)
        assert t.stop_reason == "completed"
        for o in obs:
            routes[o.meta["route"]] = routes.get(o.meta["route"], 0) + 1
            assert o.real_text is not None and "fidelity" in o.meta  # the shadow ran every call
            if o.meta["route"] in ("rule", "evidence"):
                simulated += 1
                exact += o.meta["fidelity"]["exact"] == 1.0
                assert o.text == o.real_text, (task_id, o.meta, o.text, o.real_text)  # deterministic paths are exact
            else:
                assert o.kind == "simulator_gap" and json.loads(o.text)["error"]
        # the reward comes from the shadow (real) environment's official verifier, not from the simulator
        assert episode.verify().reward == 1.0
        assert [a["output"] for a in t.actions if a["name"] != "__end_turn__"] == \
            [x for turn in pool.gold_observations(task_id) for x in turn]
    # replayed training tasks are fully covered; held-out tasks partly (rules + supporting evidence)
    assert simulated == exact and simulated >= 10 and routes.get("evidence", 0) >= 5, routes


class LostShadow(RealSource):
    """A shadow whose environment server is gone: every call comes back masked, as RealSource reports an outage."""

    async def execute(self, call, ctx):
        return Observation(text="Error: the environment is unavailable.", kind=ObservationKind.ENV_UNAVAILABLE,
                           terminate=True, masked=True, meta={"reason": f"environment unavailable on {call.name}"})


def test_a_simulated_rollout_whose_shadow_is_lost_is_masked_and_named_by_the_shadow(book):
    """The reward comes from the shadow: when it cannot run a call, the rollout cannot be scored. It ends masked,
    its stop reason and counter name the outage (not the simulator's answer), as with the rehearsal source."""
    pool, _, train, _, wb_root = book
    episode = pool.start(train[0])
    source = WorldbookSource.for_episode(wb_root, episode, shadow=LostShadow())
    t = asyncio.run(TurnEngine(LoopLimits()).run(episode, GoldPolicy(pool, train[0]), source))
    assert t.masked and t.stop_reason is StopReason.ENV_UNAVAILABLE and "unavailable" in t.mask_reason
    assert t.counters()["env_unavailable"] == 1 and t.tool_calls == 1
    assert [o.kind for s in t.steps for o in s.observations] == [ObservationKind.ENV_UNAVAILABLE]


def test_training_replay_is_fully_simulated(book):
    pool, _, train, _, wb_root = book
    for task_id in train[:5]:
        _, obs, _, _ = _run(pool, task_id, wb_root)
        assert all(o.meta["route"] in ("rule", "evidence") and o.text == o.real_text for o in obs)


def test_library_and_config(book, tmp_path):
    pool, env_id, train, _, wb_root = book
    lib = WorldbookLibrary(wb_root)
    assert lib.for_env(env_id).manifest.environment_id == env_id
    with pytest.raises(KeyError, match="no worldbook for environment"):
        lib.for_env("syn-nowhere-99")
    assert WorldbookLibrary(wb_root / "env0").for_env("anything") is not None  # one package serves every task
    with pytest.raises(FileNotFoundError):
        WorldbookLibrary(tmp_path / "missing")

    cfg = OmegaConf.load(REPO / "configs" / "envace" / "default.yaml")
    root = OmegaConf.create({"envace": cfg})
    root.merge_with_dotlist(["envace.agent.observation_source=simulator", f"envace.agent.worldbook={wb_root}"])
    typed = validate_envace_config(root)
    assert typed.agent.worldbook == str(wb_root) and typed.agent.observation_source == "simulator"
    bad = OmegaConf.create({"envace": cfg})
    bad.merge_with_dotlist(["envace.agent.observation_source=simulator", f"envace.agent.worldbook={tmp_path}/nope"])
    with pytest.raises(ConfigError, match="does not exist"):
        validate_envace_config(bad)
    with pytest.raises(ValueError, match="no observation source is 'simulator'"):
        AgentConfig(worldbook=str(wb_root))

    # the verl loop picks the worldbook source for observation_source=simulator
    from envace.agents.verl_loop import EnvaceAgentLoop

    loop = SimpleNamespace(agent_cfg=typed.agent, observation_source="simulator")
    src = EnvaceAgentLoop._source(loop, None, pool.start(train[0]))
    assert isinstance(src, WorldbookSource) and src.shadow is not None and src.session.proposer is None
