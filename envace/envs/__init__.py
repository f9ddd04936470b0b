"""Environment pools (BFCL multi-turn, τ²-bench, ...) behind one protocol.

The protocol lives in :mod:`envace.envs.base`; pools register by name and load lazily through
:func:`get_pool` (``"bfcl_multi_turn"``: :mod:`envace.envs.bfcl`, ``"tau2"``: :mod:`envace.envs.tau2`).
Beside the pools: the action-sequence format pools replay (:mod:`envace.envs.actions`), a task's gold replay as a
trace (:mod:`envace.envs.gold_trace`), the episodes of converted CM2 rows (:mod:`envace.envs.checklist_dialogue`)
and serving a pool to other frameworks (:mod:`envace.envs.serve`). ``python -m envace.envs`` is the command line
(one module per command group in :mod:`envace.envs.cli`). Building training data from pools is the layer above,
:mod:`envace.data`.
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
