"""Where every training prompt verl dispatched went: trained, dropped, or still in flight (the prompt ledger).

In verl's async trainers a prompt group dispatched at one step is trained at a later one, or evicted unobserved (a
group past ``trainer.v1.sampler.max_off_policy_threshold`` under ``drop``, a failed group), and a checkpoint holds the
groups in flight (TransferQueue's state: finished groups restored as they were, pending ones re-issued with their
uid). The ledger follows each prompt uid through that:

* :meth:`PromptLedger.dispatched`: the uids ``_next_train_batch`` hands verl (warm-up, each step, refills);
* :meth:`PromptLedger.settle`, once a step has trained: a uid whose rollouts were trained is *trained*; one no longer
  registered in TransferQueue (``tq.kv_list`` prompt keys, verl's public API) and not trained was *dropped*; the rest
  stay *open*. The trainer thread is the only one that dispatches or evicts, so the two views agree at that point.
* its state is saved with each checkpoint, so a resumed run knows which of the uids verl restores were open.

Each settled step appends one line to ``<trainer.default_local_dir>/prompts.jsonl``
(``{"step", "dispatched": {uid: dispatch step}, "trained", "dropped", "open"}``): with it, a run's every dispatched
prompt is accounted for, and a trained uid seen twice (a resume that replays a group) is visible. A payload per uid
(EnvSched's selection and task) travels with it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LEDGER_FILE = "prompts.jsonl"
STATE_FILE = "prompt_ledger.json"


@dataclass(frozen=True)
class Settled:
    """One step's outcome: the uids trained and dropped (each with its payload), in dispatch order."""

    trained: dict[str, Any]
    dropped: dict[str, Any]
    unknown: tuple[str, ...]  # trained uids the ledger never saw dispatched (rows of a run without a ledger)


@dataclass
class PromptLedger:
    """The open prompt uids, each with its dispatch step and payload (see the module docstring)."""

    open: dict[str, tuple[int, Any]] = field(default_factory=dict)
    _since: dict[str, int] = field(default_factory=dict)  # dispatched since the last settle, for the log line

    def dispatched(self, step: int, uids: Iterable[str], payloads: Iterable[Any] | None = None) -> None:
        uids = [str(u) for u in uids]
        payloads = list(payloads) if payloads is not None else [None] * len(uids)
        for uid, payload in zip(uids, payloads, strict=True):
            if uid in self.open:
                raise ValueError(f"prompt uid {uid} dispatched twice (at steps {self.open[uid][0]} and {step})")
            self.open[uid] = (int(step), payload)
            self._since[uid] = int(step)

    def settle(self, trained: Iterable[str], registered: Iterable[str]) -> Settled:
        """Close the uids trained this step, and drop the open ones no longer ``registered`` in TransferQueue."""
        trained = list(dict.fromkeys(str(u) for u in trained))
        registered = {str(u) for u in registered}
        done = {u: self.open.pop(u)[1] for u in trained if u in self.open}
        unknown = tuple(u for u in trained if u not in done)
        dropped = {u: self.open.pop(u)[1] for u in [u for u in self.open if u not in registered]}
        return Settled(trained=done, dropped=dropped, unknown=unknown)

    def log(self, run_dir: Path, step: int, settled: Settled) -> None:
        """Append ``step``'s line to ``run_dir/prompts.jsonl``."""
        record = {"step": int(step), "dispatched": self._since, "trained": [*settled.trained, *settled.unknown],
                  "dropped": list(settled.dropped), "open": list(self.open)}
        run_dir.mkdir(parents=True, exist_ok=True)
        with (run_dir / LEDGER_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._since = {}

    def save(self, folder: Path) -> None:
        """Write the open uids into a checkpoint folder (atomically; JSON, so payloads must be JSON values)."""
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps({"open": [[u, s, p] for u, (s, p) in self.open.items()]}))
        os.replace(tmp, folder / STATE_FILE)

    @classmethod
    def load(cls, folder: Path) -> PromptLedger:
        """The ledger saved in ``folder``; an empty one when the checkpoint has none (written without a ledger)."""
        path = folder / STATE_FILE
        if not path.is_file():
            return cls()
        state = json.loads(path.read_text())
        return cls(open={str(u): (int(s), p) for u, s, p in state["open"]})
