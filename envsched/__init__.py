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

The modules form layers; a module imports only from lower layers, never a peer of its own layer, and no import
cycle exists (``tests/test_dependency_direction.py``). Lowest first:

1. ``config`` (the typed config), ``pool`` (the task pool and its JSONL format), ``tfidf`` (row-chunked TF-IDF
   and CSR matrices on disk), ``synthetic`` (simulated pools and learners) — import no other envsched module;
2. ``estimate`` (the estimation equations over arrays, Eq. 2-4 and 6-13), ``operations`` (App. E operation
   descriptions and their extractors);
3. ``relations`` (Eq. 3' weights measured on the estimates' predictions), ``predictor`` (the learned predictor,
   beyond the paper), ``filters`` (App. C eligibility filters), ``graph`` (the static dual-relation graph, Eq. 1);
4. ``graph_cache`` (the graph on disk), ``neighbors`` (the observed-neighbour sets), ``select`` (batch
   construction, Eq. 5) — over the graph;
5. ``scheduler`` — rollout -> update -> propagation -> selection, driving all of the above;
6. ``envsched`` (this package root) — the public API it re-exports.
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
