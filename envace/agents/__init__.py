"""envace's agent loops, registered with verl through ``agent_loops.yaml``.

verl's AgentLoopWorker reads the file named by ``actor_rollout_ref.rollout.agent.agent_loop_config_path``
(:func:`agent_loop_config_path` returns this package's copy) and instantiates loops by name.
"""

from pathlib import Path


def agent_loop_config_path() -> str:
    return str(Path(__file__).with_name("agent_loops.yaml"))
