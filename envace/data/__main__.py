"""``python -m envace.data``: build training data from environment pools, convert CM2 data, record traces.

Commands::

    build --pools P [P ...] --out DIR [--agent-name A] [--limit-per-pool N] [--train-split S] [--val-split S]
          [--seed SEED]                   verl parquet (train.parquet / val.parquet / manifest.json)
    convert-cm2 IN.jsonl OUT_DIR [--skip-invalid] [--val-fraction F] [--agent-name A] [--seed SEED]
                                          CM2 checklist data -> the same parquet layout
    record-traces --pool P --out FILE.jsonl [--split train|test|all] [--max-tasks N] [--env-id E ...]
          [--by-env DIR]                  gold replays as Trace2Env traces (the input of python -m trace2env build)

``--pool-kwargs '{"tau2": {"domains": ["airline"]}}'`` (before the command) passes constructor options to pools, as
in ``python -m envace.envs``. Exit codes: 0 success, 1 nothing recorded, 2 bad usage or input (one line naming the
flag, file or line: :mod:`trace2env.cliargs`; never a traceback).

Each group of commands is one module of :mod:`envace.data.cli` (``parquet``: build, convert-cm2; ``traces``:
record-traces); this module only dispatches.
"""

from __future__ import annotations

import sys

from envace.data.cli import parquet, traces
from envace.envs.cli.common import verb_cli

PROG = "python -m envace.data"
main = verb_cli(PROG, "Training data: parquet from pools, CM2 conversion, traces.", (parquet, traces))

if __name__ == "__main__":
    sys.exit(main())
