"""Append-only, crash-safe result files of one evaluation run.

``OUT/results.jsonl``: one :class:`~envace.eval.runner.TaskRecord` per finished task, appended and
fsync'ed the moment the task finishes. A rerun reads it and skips those task ids, so an interrupted
run loses nothing and, once complete, yields the same table as an uninterrupted one. A torn last
line (the process died mid-write) is ignored and the task simply runs again.

``OUT/errors.jsonl``: infrastructure failures (endpoint down, crashes in environment code). These
tasks are *not* considered finished; the next run retries them.

``OUT/run.json``: the settings that determine results. Resuming into a directory written with
different settings is refused (mixing them would make the table meaningless). A run's pre-flight checks
with ``record=False`` (nothing written) and records only once the run can start, so a refused command
never blocks the corrected one; ``ResultStore(out, create=False)`` leaves a missing directory missing until then.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envace.envs.base import scrub_surrogates
from envace.eval.runner import TaskRecord
from trace2env.cliargs import strict_json

__all__ = ["ResultStore", "RunConfigMismatch"]


class RunConfigMismatch(RuntimeError):
    """``OUT/run.json`` records settings different from the current run's."""


class ResultStore:
    RESULTS = "results.jsonl"
    ERRORS = "errors.jsonl"
    RUN = "run.json"

    def __init__(self, out_dir: str | os.PathLike[str], *, create: bool = True) -> None:
        self.dir = Path(out_dir)
        if create:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.results_path = self.dir / self.RESULTS
        self.errors_path = self.dir / self.ERRORS
        self._lock = threading.Lock()

    # -- run identity ----------------------------------------------------------------------

    def check_run_config(self, identity: dict[str, Any], *, force: bool = False, record: bool = True,
                         legacy: Mapping[str, Any] | None = None) -> None:
        """Record ``identity`` on the first run; on later runs require it to match. ``record=False``: only
        check (raises on a mismatch, writes nothing). ``legacy``: what a key the recorded ``run.json`` lacks counts
        as (the value every run had before the key was recorded), so runs recorded before it resume."""
        path = self.dir / self.RUN
        if path.exists():
            previous = {**(legacy or {}), **json.loads(path.read_text())}
            diff = {k: (previous.get(k), v) for k, v in identity.items() if previous.get(k) != v}
            if diff and not force:
                lines = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(diff.items()))
                raise RunConfigMismatch(
                    f"{self.dir} holds results of a run with different settings ({lines}). "
                    "Use another --out directory, or --force-resume to mix them deliberately."
                )
            if not diff:
                return
        if not record:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(strict_json(identity, indent=2, sort_keys=True))
        tmp.replace(path)

    # -- records ---------------------------------------------------------------------------

    def _read(self) -> tuple[dict[str, TaskRecord], list[tuple[int, str, str]]]:
        records: dict[str, TaskRecord] = {}
        bad: list[tuple[int, str, str]] = []
        if not self.results_path.exists():
            return records, bad
        with self.results_path.open("r", encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = TaskRecord.from_json(json.loads(line))
                except (json.JSONDecodeError, TypeError) as exc:
                    bad.append((lineno, line, str(exc)))
                    continue
                records[rec.task_id] = rec
        return records, bad

    def completed(self) -> dict[str, TaskRecord]:
        """Finished tasks by id (the last record wins if a task appears twice). Unreadable lines
        are skipped here; :meth:`repair` removes them."""
        return self._read()[0]

    def repair(self) -> int:
        """Move unreadable lines (a record torn by a killed run) from ``results.jsonl`` to
        ``results.jsonl.corrupt``, warn, and return how many there were. Their tasks run again."""
        with self._lock:
            _, bad = self._read()
            if not bad:
                return 0
            for lineno, _line, err in bad:
                warnings.warn(
                    f"{self.results_path}:{lineno}: unreadable record set aside ({err}); that task will run again",
                    stacklevel=2,
                )
            bad_numbers = {lineno for lineno, _, _ in bad}
            # the line numbers of _read (file iteration: "\n" ends a line); str.splitlines() would also split
            # records at U+2028, U+0085 ... (JSON leaves them unescaped) and drop the wrong lines
            lines = self.results_path.read_text(encoding="utf-8", errors="replace").split("\n")
            keep = [ln for i, ln in enumerate(lines, 1) if i not in bad_numbers and ln.strip()]
            with (self.dir / (self.RESULTS + ".corrupt")).open("a", encoding="utf-8") as fh:
                fh.writelines(line + "\n" for _, line, _ in bad)
            tmp = self.results_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
            tmp.replace(self.results_path)
            return len(bad)

    def append(self, record: TaskRecord) -> None:
        self._append_line(self.results_path, record.to_json())

    def append_error(self, task_id: str, error: str) -> None:
        self._append_line(self.errors_path, {"task_id": task_id, "error": error, "time": time.time()})

    def _append_line(self, path: Path, obj: dict[str, Any]) -> None:
        # lone surrogates (never valid UTF-8) would make the encode below raise and lose the record
        line = strict_json(scrub_surrogates(obj), ensure_ascii=False, default=str) + "\n"
        with self._lock, path.open("a+b") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() > 0:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":  # torn line from a killed run: start a fresh line
                    fh.write(b"\n")
            fh.write(line.encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())

    def write_json(self, name: str, obj: Any) -> Path:
        path = self.dir / name
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(strict_json(obj, indent=2, ensure_ascii=False, default=str))
        tmp.replace(path)
        return path

    def write_text(self, name: str, text: str) -> Path:
        path = self.dir / name
        path.write_text(text, encoding="utf-8")
        return path
