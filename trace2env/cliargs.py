"""The command-line convention every entry point of the project follows (trace2env's and envace's alike).

A user mistake (bad flag, bad value, missing or malformed input) exits 2 with ONE line on stderr,
``PROG: error: MESSAGE``, naming the flag, file or line and what is wrong; never a Python traceback
(``ENVACE_DEBUG=1`` re-raises, to see one). Exit 1 stays the "ran, and the verdict is negative" code. Exit 3 is
infrastructure, in the same one-line form: an outage (an endpoint answering 5xx or not at all, a lost node) or
damaged stored data; not the user's command, so a retry wrapper may rerun it, and the rerun resumes.

* :class:`ArgumentParser`: argparse whose usage errors are that one line (no usage block);
* :func:`number`: the one range-checked numeric flag type (NaN and infinities refused everywhere);
* :func:`json_object`: a flag holding a JSON object;
* :class:`UsageError` and :func:`run_cli`: raise the former anywhere below ``main``; the latter prints it
  (and the error types a command lists as user errors) as the one line and returns 2;
* :class:`InfrastructureFailure`: the same for an outage or damaged data, exit 3;
* :func:`strict_json`: JSON text as the CLIs write it (never ``NaN``: non-finite numbers become ``null``).

It lives in trace2env because both libraries may import trace2env and trace2env may import neither
(tests/test_dependency_direction.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

__all__ = ["EXIT_INFRA", "EXIT_USAGE", "ArgumentParser", "InfrastructureFailure", "UsageError", "json_object",
           "number", "one_line", "read_text", "run_cli", "strict_json"]

EXIT_USAGE = 2
EXIT_INFRA = 3


class UsageError(Exception):
    """A mistake of the user's (exit 2, one line)."""


class InfrastructureFailure(Exception):
    """An outage or damaged stored data, not the user's command (exit 3, one line); the message says what failed
    and that rerunning the same command, once it is fixed, resumes."""


def read_text(path: str | os.PathLike[str], error: type[Exception] = UsageError, what: str = "file") -> str:
    """A UTF-8 text file's content, or ``error`` with one line naming the path and why it cannot be read (a
    directory, missing or unreadable, not UTF-8)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except IsADirectoryError:
        raise error(f"{path}: a directory, not a {what}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start})") from None


def one_line(text: object) -> str:
    """``text`` on one line (pydantic and JSON errors span several)."""
    return " ".join(str(text).split())


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``PROG: error: MESSAGE (see --help)``, exit 2 (subparsers too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see --help)\n")


def number(kind: type = int, *, min: float | None = None, max: float | None = None,
           min_open: bool = False, max_open: bool = False) -> Callable[[str], Any]:
    """An argparse ``type=``: ``kind`` (int or float) within [min, max] (an open end with ``*_open``)."""
    lo = "" if min is None else f"{'>' if min_open else '>='} {min:g}"
    hi = "" if max is None else f"{'<' if max_open else '<='} {max:g}"
    want = " ".join(["an integer" if kind is int else "a number", " and ".join(b for b in (lo, hi) if b)]).strip()

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        if min is not None and (value < min or (min_open and value == min)):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        if max is not None and (value > max or (max_open and value == max)):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def json_object(text: str) -> dict[str, Any]:
    """An argparse ``type=``: a JSON object."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg} at column {exc.colno}): {text!r}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(obj).__name__}: {text!r}")
    return obj


def strict_json(obj: Any, **kwargs: Any) -> str:
    """``json.dumps(obj, **kwargs)`` with every NaN or infinity written as ``null``: strict JSON, which
    ``json.dumps`` alone is not (it writes ``NaN``, which no other JSON parser reads)."""
    return json.dumps(_finite(obj), allow_nan=False, **kwargs)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def run_cli(prog: str, main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None, *,
            user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """``main(argv)``, with :class:`UsageError` and ``user_errors`` printed as one line and exit 2,
    :class:`InfrastructureFailure` as one line and exit 3."""
    try:
        return main(argv)
    except BrokenPipeError:  # `... | head`: the reader left; not an error of ours
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - so the interpreter's final flush stays quiet
        return 0
    except (UsageError, InfrastructureFailure, *user_errors) as exc:
        if os.environ.get("ENVACE_DEBUG"):
            raise
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"{prog}: error: {one_line(text)}", file=sys.stderr)
        return EXIT_INFRA if isinstance(exc, InfrastructureFailure) else EXIT_USAGE
