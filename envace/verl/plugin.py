"""envace's ``verl.plugins`` entry point: verl imports this module on ``import verl``.

It registers, through verl's own registries:

* on machines without CUDA, the ``cpu`` platform and ``hfcpu`` rollout (:mod:`envace.platform`);
* everywhere, envace's extensions (agent loops, advantage estimators, trainer) as they exist.

verl swallows exceptions raised by plugins (logging them at DEBUG), so failures here are logged
at WARNING level before being re-raised, to keep them visible.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("envace")


def _load() -> None:
    # The platform module imports only verl.plugin.platform (already loaded when verl imports
    # plugins), so this is safe while verl/__init__ is still executing.
    from envace.platform.cpu import PlatformCPU  # noqa: F401  (registers the "cpu" platform)
    from envace.verl.extensions import register_extensions

    register_extensions()


try:
    _load()
except Exception:  # pragma: no cover - surfaced to the user, then re-raised
    logger.warning("envace verl plugin failed to load", exc_info=True)
    raise
