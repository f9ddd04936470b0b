"""``python -m envace.envs``: inspect environment pools, check gold replays, verify actions, serve a pool.

Commands::

    list [POOL ...]                       pools and their task counts per category and split
    tasks POOL [--split S] [--category C ...] [--json]
    gold POOL [--category C ...] [--split S] [--limit N] [--workers N]
                                          replay every task's gold actions through the pool's official
                                          verifier; exit 1 if any task fails
    verify POOL TASK_ID ACTIONS.json      verify an action sequence; prints the verdict as JSON; exit 1 if it
                                          does not pass. Formats, detected: envace's (a JSON list of turns,
                                          each a list of {"name", "arguments"}; a flat list of calls is one
                                          turn), BFCL's native one (per turn a list of call strings such as
                                          "sort('final_report.pdf')", or per turn a list of steps of them;
                                          positional arguments mapped through the schema) and tau2's (its
                                          actions: {"name", "arguments", "requestor", ...})
    verify POOL --batch FILE              verify many tasks in one process: JSONL of {"task_id", "actions"}
                                          (or BFCL's result / possible-answer files: {"id", "result" |
                                          "ground_truth"}); every line is checked before any is verified; one
                                          JSON line per task, then {"summary": ...}; exit 1 if any fails
    serve --pool POOL --protocol openenv|mcp [--host H] [--port P] [--token-file F] [--max-sessions N]
          [--session-timeout S]           serve a pool to other frameworks: one session = one episode
                                          (:mod:`envace.envs.serve`); loopback by default, a bearer token from
                                          --token-file or ENVACE_SERVE_TOKEN; prints one line with the URL when
                                          ready and runs until interrupted

``--pool-kwargs '{"bfcl_multi_turn": {"test_fraction": 0.3}}'`` (before the command) passes constructor
options to pools. Exit codes: 0 success, 1 failed tasks / verdict, 2 bad usage or input (one line naming the
flag, file or line: :mod:`trace2env.cliargs`; never a traceback).

Each group of commands is one module of :mod:`envace.envs.cli` (``listing``: list, tasks; ``gold``; ``verify``;
``serve``), with what they share in :mod:`envace.envs.cli.common`; this module only dispatches. Building and
converting training data is ``python -m envace.data``.
"""

from __future__ import annotations

import sys

from envace.envs.cli import gold, listing, serve, verify
from envace.envs.cli.common import verb_cli

PROG = "python -m envace.envs"
main = verb_cli(PROG, "Environment pools: inspect, check gold replays, verify, serve.", (listing, gold, verify, serve))

if __name__ == "__main__":
    sys.exit(main())
