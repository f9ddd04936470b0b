"""envace's multi-turn loops: one turn engine (:mod:`envace.agents.engine`), observation sources
(:mod:`envace.agents.sources`) and the verl adapter (:mod:`envace.agents.verl_loop`).

verl's AgentLoopWorker reads the file named by ``actor_rollout_ref.rollout.agent.agent_loop_config_path``
(:func:`agent_loop_config_path` returns this package's copy) and instantiates loops by name.
"""

from pathlib import Path

import yaml

#: observation source (``envace.agent.observation_source``) → the agent loop registered for it
LOOP_NAMES = {"real": "envace_env", "rehearse": "envace_act_rehearse", "simulator": "envace_simulator"}


def agent_loop_config_path() -> str:
    return str(Path(__file__).with_name("agent_loops.yaml"))


def registered_loop_names(path: str | None = None) -> list[str]:
    """Names of the agent loops in ``path`` (default: envace's ``agent_loops.yaml``)."""
    with open(path or agent_loop_config_path()) as f:
        return [str(entry["name"]) for entry in (yaml.safe_load(f) or [])]
