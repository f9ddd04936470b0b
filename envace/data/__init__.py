"""Training data built from the environment pools, or converted into their row layout.

The layer above :mod:`envace.envs`: it reads pools through their protocol and writes what training consumes, and no
environment imports it back.

- :mod:`envace.data.datasets` — verl parquet rows from pools (one fixed Arrow schema, ``manifest.json``);
- :mod:`envace.data.cm2` — CM2 checklist JSONL, schema-validated, into the same rows (its episodes, built from a
  row at rollout time, are :mod:`envace.envs.checklist_dialogue`);
- :mod:`envace.data.records` — tasks as EnvSched pool records, and their JSONL export;
- :mod:`envace.data.traces` — gold replays recorded as Trace2Env traces (one replay:
  :mod:`envace.envs.gold_trace`);
- :mod:`envace.data.worldbooks` — the books ``envace.agent.worldbook: auto`` builds from those traces for the
  simulated environments.

``python -m envace.data`` is the command line (``build``, ``convert-cm2``, ``record-traces``).
"""
