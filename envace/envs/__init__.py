"""Environment pools (BFCL multi-turn, τ²-bench, ...) behind one protocol, plus dataset builders.

The protocol lives in :mod:`envace.envs.base`; pools register by name and load lazily through
:func:`get_pool` (``"bfcl_multi_turn"``: :mod:`envace.envs.bfcl`, ``"tau2"``: :mod:`envace.envs.tau2`).
:mod:`envace.envs.datasets` writes verl parquet from pools, :mod:`envace.envs.cm2` converts CM2 checklist
data to the same layout, and ``python -m envace.envs`` is the command line.
"""

from envace.envs.base import (
    EnvironmentPool,
    Episode,
    TaskSpec,
    ToolCall,
    ToolCallError,
    Verdict,
    available_pools,
    get_pool,
    register_pool,
)

__all__ = [
    "EnvironmentPool",
    "Episode",
    "TaskSpec",
    "ToolCall",
    "ToolCallError",
    "Verdict",
    "available_pools",
    "get_pool",
    "register_pool",
]
