"""Trace2Env: environment worldbooks reconstructed from recorded traces, and a simulator that runs them.

Seed paper: ``../shared/seeds/002_3678f87863e1a507.txt`` ("From Traces to Agentic Worlds"). §3 defines
trace-based environment reconstruction; §4.1 the worldbook (schemas, grounded evidence, induced
abstractions, provenance) and its construction; §4.2 the workspace ``(K_E, ŝ_t, M_t)``; §4.3 the
proposal → validation-gate → commit step. Modules:

* :mod:`trace2env.models` — typed artifacts;  :mod:`trace2env.ingest` — formats, ids, splits, alignment;
* :mod:`trace2env.induce` — deterministic construction stages and the replay review;
* :mod:`trace2env.providers` — the model Protocol and the scripted provider keyed by stage;
* :mod:`trace2env.build` — the pipeline;  :mod:`trace2env.package` — the immutable package on disk;
* :mod:`trace2env.engine` — effects, conditions, templates, rule selection, invariants;
* :mod:`trace2env.runtime` — gate, forkable sessions, ``WorldbookEnv`` (``reset``/``step``);
* :mod:`trace2env.applicability` — the applicability gate;  :mod:`trace2env.agent` — the world-model agent;
* :mod:`trace2env.llm` — the OpenAI-compatible provider (its endpoint config, error taxonomy and repair loop are
  the project's shared LLM core, :mod:`envllm`, which envace and envsched use too);
* :mod:`trace2env.evaluate` — held-out agreement;  :mod:`trace2env.baselines` — the paper's baselines;
  :mod:`trace2env.judge` — the LLM judge;  :mod:`trace2env.consistency` — W2R / CR.

A standalone library: it never imports ``envace`` or ``verl`` (tests/test_dependency_direction.py). Its modules
form layers; a module imports only from lower layers, never a peer of its own layer, and no import cycle exists
(the same test). Lowest first:

1. ``models``, ``cliargs`` (the command-line convention) — import no other module here;
2. ``engine``, ``ingest``, ``providers``, ``llm`` — over the typed artifacts and the LLM core;
3. ``induce``, ``applicability``, ``judge``;
4. ``package``;
5. ``build`` (the construction pipeline), ``runtime`` (the harness);
6. ``agent`` — the world-model agent, a proposer for the runtime;
7. ``baselines`` — the predictors, the agent among them;
8. ``evaluate`` — held-out agreement over the predictors;
9. ``consistency`` — W2R / CR, over the evaluation;
10. ``trace2env`` (this package root: the public API), ``__main__`` (the command line).
"""

from .build import build_worldbook
from .ingest import align, load_traces, make_split_manifest, parse_trace
from .package import (
    Worldbook,
    WorldbookIntegrityError,
    check_worldbook,
    compile_worldbook,
    load_worldbook,
    load_worldbooks,
)
from .providers import Provider, ScriptedProvider
from .runtime import Session, TransitionProposal, WorldbookEnv, validation_gate

__all__ = [
    "Provider",
    "ScriptedProvider",
    "Session",
    "TransitionProposal",
    "Worldbook",
    "WorldbookEnv",
    "WorldbookIntegrityError",
    "align",
    "build_worldbook",
    "check_worldbook",
    "compile_worldbook",
    "load_traces",
    "load_worldbook",
    "load_worldbooks",
    "make_split_manifest",
    "parse_trace",
    "validation_gate",
]
