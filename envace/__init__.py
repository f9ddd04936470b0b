"""envace: multi-turn tool-use RL on verl.

The sub-packages and top-level modules form layers; a module imports only from lower layers (or its own unit),
checked by ``tests/test_dependency_direction.py``. Lowest first:

1. ``roles`` — the one ``Role`` enum (act, rehearse) every layer shares;
2. ``envace`` (this package root), ``cache``, ``loop_config``, ``metrics``, ``trackers``, ``advantage`` (role-wise
   GRPO, pure math), ``platform`` (verl's CPU device backend);
3. ``envs`` — the environment protocol, the pools and their verifiers;
4. ``data`` — training data built from the pools: verl parquet, CM2 conversion, EnvSched records, traces,
   worldbooks;
5. ``toolcall``, ``rewards``;
6. ``config`` — the typed ``envace:`` config schema;
7. ``agents`` — the turn engine, observation sources, verl's agent loop;
8. ``models`` — tiny models and the warm start;
9. ``eval`` — benchmark evaluation;
10. ``verl`` — everything plugged into verl's trainer (:mod:`envace.verl`);
11. ``launch`` — ``scripts/train.sh``'s cluster helpers;
12. ``train`` — pre-flight, then verl's trainer;
13. ``gpu_smoke``, ``cli`` — the commands that drive the ones above.

``envsched`` and ``trace2env`` never import envace; each has its own layer order, in its ``__init__.py``. The turn
engine (:mod:`envace.agents.engine`) imports neither verl nor an HTTP client, through anything it imports (checked
by the same test).
"""

__version__ = "0.1.0"
