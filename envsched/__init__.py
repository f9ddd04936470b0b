"""EnvSched: environment-aware scheduling of environment–task pairs for agentic RL.

Standalone library (numpy / scipy / scikit-learn / pydantic / openai); it never imports envace or verl.

Public API::

    from envsched import EnvScheduler, EnvSchedConfig, TaskPool
    pool = TaskPool.from_jsonl("pool.jsonl")          # or TaskPool.from_records([...])
    sched = EnvScheduler(pool, EnvSchedConfig(batch_size=64))
    ids = sched.select(step)                           # list of task ids
    metrics = sched.observe(step, {tid: [r1, ..., rK]})
    pred = sched.predict()                             # .v .m .d .q per task
    state = sched.state_dict(); sched.load_state_dict(state)

See envsched/README.md and the JSONL format in ``envsched.pool``.
"""

from .config import ConfigError, EnvSchedConfig, LLMExtractorConfig
from .estimate import EVIDENCE_TYPES, Prediction, evidence_types, prediction_diagnostics
from .graph import StaticGraph, build_static_graph
from .graph_cache import load_or_build_graph
from .operations import (
    DeterministicExtractor,
    Extraction,
    LLMExtractor,
    OperationDescription,
    OperationExtractionError,
    abstract_text,
)
from .pool import Action, Environment, PoolFormatError, Task, TaskPool, Tool, write_pool_jsonl
from .scheduler import EnvScheduler, ObservationError, UnknownTaskError

__all__ = [
    "EVIDENCE_TYPES", "Action", "ConfigError", "DeterministicExtractor", "EnvSchedConfig", "EnvScheduler", "Environment",
    "Extraction", "LLMExtractor", "LLMExtractorConfig", "ObservationError", "OperationDescription",
    "OperationExtractionError", "PoolFormatError", "Prediction", "StaticGraph", "Task", "TaskPool", "Tool",
    "UnknownTaskError", "abstract_text", "build_static_graph", "evidence_types", "load_or_build_graph",
    "prediction_diagnostics", "write_pool_jsonl",
]
