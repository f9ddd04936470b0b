"""Registration of envace's pieces with verl's registries (called by the verl plugin)."""

from __future__ import annotations


def register_extensions() -> None:
    """Register everything envace plugs into verl. Idempotent."""
    from envace.platform import register_cpu_platform

    register_cpu_platform()
