"""Start-up safety for ``trainer.logger``: a tracker that cannot start falls back to the console.

verl starts its trackers inside the TaskRunner Ray actor, after the cluster is up and the model is loaded;
there ``wandb.init`` without credentials cannot prompt (no terminal) and kills the run. Before verl starts,
:func:`degrade_trackers` drops every tracker whose package is missing or whose credentials are missing,
adds ``console`` when nothing else prints metrics, and warns naming what was dropped and how to fix it.

Credentials, per verl's ``verl.utils.tracking.Tracking``:

* ``wandb``: ``WANDB_API_KEY``, or an entry for the W&B host (``WANDB_BASE_URL``, default api.wandb.ai) in
  the netrc file (``NETRC`` or ``~/.netrc``, where ``wandb login`` writes it), or a ``WANDB_MODE`` that
  needs none (offline, disabled, dryrun). With none of these but a terminal, ``wandb.login()`` asks for
  the key here, in the driver, and stores it where the Ray actors read it.
* ``swanlab``: ``SWANLAB_API_KEY``, a stored login (``~/.swanlab/.netrc``) or ``SWANLAB_MODE`` other than cloud.
* ``vemlp_wandb``: ``VOLC_ACCESS_KEY_ID``, ``VOLC_SECRET_ACCESS_KEY`` and ``MLP_TRACKING_REGION``.
* ``clearml``: ``CLEARML_API_ACCESS_KEY`` + ``CLEARML_API_SECRET_KEY``, or a ``clearml.conf``.
* ``mlflow``, ``trackio``: none (local stores by default); only the package is checked.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlparse

__all__ = ["TrackerWarning", "degrade_trackers", "missing_credentials"]

#: the Python package each tracker imports (verl.utils.tracking)
PACKAGES = {
    "wandb": "wandb",
    "swanlab": "swanlab",
    "mlflow": "mlflow",
    "vemlp_wandb": "volcengine_ml_platform",
    "clearml": "clearml",
    "trackio": "trackio",
}
#: trackers that print or write metrics somewhere without any account
LOCAL = ("console", "file", "tensorboard")


class TrackerWarning(UserWarning):
    """A tracker in trainer.logger was replaced by the console."""


def _netrc_has(host: str, env: Mapping[str, str]) -> bool:
    path = Path(env.get("NETRC") or Path.home() / ".netrc").expanduser()
    if not path.is_file():
        return False
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (netrc.NetrcParseError, OSError):
        return False
    return bool(entry and entry[2])


def _wandb(env: Mapping[str, str]) -> str | None:
    if env.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return None
    if env.get("WANDB_API_KEY"):
        return None
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    if _netrc_has(host, env):
        return None
    return f"no WANDB_API_KEY and no {host} entry in {env.get('NETRC') or '~/.netrc'} (`wandb login` writes one)"


def _swanlab(env: Mapping[str, str]) -> str | None:
    if env.get("SWANLAB_API_KEY") or env.get("SWANLAB_MODE", "cloud").lower() != "cloud":
        return None
    if (Path.home() / ".swanlab" / ".netrc").is_file():
        return None
    return "no SWANLAB_API_KEY, no stored `swanlab login` and SWANLAB_MODE is cloud"


def _vemlp(env: Mapping[str, str]) -> str | None:
    missing = [k for k in ("VOLC_ACCESS_KEY_ID", "VOLC_SECRET_ACCESS_KEY", "MLP_TRACKING_REGION") if not env.get(k)]
    return f"{', '.join(missing)} not set" if missing else None


def _clearml(env: Mapping[str, str]) -> str | None:
    if env.get("CLEARML_API_ACCESS_KEY") and env.get("CLEARML_API_SECRET_KEY"):
        return None
    conf = Path(env.get("CLEARML_CONFIG_FILE") or Path.home() / "clearml.conf").expanduser()
    return None if conf.is_file() else f"no CLEARML_API_ACCESS_KEY/CLEARML_API_SECRET_KEY and no {conf}"


CREDENTIALS: dict[str, Callable[[Mapping[str, str]], str | None]] = {
    "wandb": _wandb,
    "swanlab": _swanlab,
    "vemlp_wandb": _vemlp,
    "clearml": _clearml,
}


def missing_credentials(tracker: str, env: Mapping[str, str] | None = None) -> str | None:
    """Why ``tracker`` cannot start here (its package or credentials are missing), or None."""
    env = os.environ if env is None else env
    package = PACKAGES.get(tracker)
    if package and importlib.util.find_spec(package) is None:
        return f"its package `{package}` is not installed"
    check = CREDENTIALS.get(tracker)
    return check(env) if check else None


def _interactive() -> bool:
    return sys.stdin is not None and sys.stdin.isatty() and sys.stderr.isatty()


def _wandb_login() -> bool:
    """Ask for the W&B key on this terminal; the key lands in the netrc file the Ray actors read."""
    try:
        import wandb

        return bool(wandb.login())
    except Exception as exc:  # noqa: BLE001 (a refused or aborted login: fall back like a missing key)
        print(f"envace: wandb login failed: {exc}", file=sys.stderr)
        return False


def degrade_trackers(
    loggers: list[str],
    env: Mapping[str, str] | None = None,
    interactive: bool | None = None,
    login: Callable[[], bool] = _wandb_login,
) -> list[str]:
    """``loggers`` without the trackers that cannot start, plus ``console`` when one was dropped.

    ``interactive`` (default: stdin and stderr are terminals) lets a missing W&B key be typed in via
    ``login`` instead. Warns (:class:`TrackerWarning`) once per dropped tracker.
    """
    env = os.environ if env is None else env
    interactive = _interactive() if interactive is None else interactive
    kept: list[str] = []
    dropped = False
    for name in loggers:
        reason = None if name in LOCAL else missing_credentials(name, env)
        if reason and name == "wandb" and interactive and "package" not in reason and login():
            reason = None
        if reason is None:
            kept.append(name)
            continue
        dropped = True
        warnings.warn(
            f"trainer.logger: `{name}` dropped ({reason}); metrics go to the console and the other "
            f"trackers. Fix that, or remove `{name}` from trainer.logger to silence this.",
            TrackerWarning,
            stacklevel=2,
        )
    if dropped and "console" not in kept:
        kept.append("console")
    return kept
