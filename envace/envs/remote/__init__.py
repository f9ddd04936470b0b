"""Environments that live in another process: MCP tool servers (the ``mcp`` pool) and OpenEnv servers (the
``openenv`` pool), consumed through the ecosystem's own clients (``mcp``, ``openenv``) on one background I/O loop
per process (:mod:`envace.envs.remote.runtime`). Importing this package registers the pools; the client libraries
are imported only when a pool is built."""

from envace.envs.remote import mcp_pool, openenv_pool  # noqa: F401  (register the `mcp` and `openenv` pools)
