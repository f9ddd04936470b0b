"""``serve``: a pool served to other frameworks over OpenEnv or MCP (:mod:`envace.envs.serve`), one session = one
episode; loopback by default, a bearer token from ``--token-file`` or ``$ENVACE_SERVE_TOKEN``."""

from __future__ import annotations

import argparse
import os

from envace.envs.cli.common import EXIT_OK, CLIError, load_pool, positive_int, read_file
from envace.envs.serve import (
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_TIMEOUT_S,
    PROTOCOLS,
    bind_socket,
    is_loopback,
    serve,
    warn,
)
from trace2env.cliargs import number

TOKEN_ENV = "ENVACE_SERVE_TOKEN"


def _serve_token(args: argparse.Namespace) -> str | None:
    """The bearer token: --token-file's content (stripped), else $ENVACE_SERVE_TOKEN, else None (no auth)."""
    if args.token_file is None:
        return os.environ.get(TOKEN_ENV) or None
    token = read_file(args.token_file).strip()
    if not token or len(token.split()) != 1:
        raise CLIError(f"--token-file {args.token_file}: expected one token on one line")
    return token


def cmd_serve(args: argparse.Namespace) -> int:
    token = _serve_token(args)
    try:  # bound before the pool loads: a port in use is a one-line mistake, not a failed server start
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        raise CLIError(f"--port {args.port}: cannot listen on {args.host}:{args.port}: "
                       f"{exc.strerror or exc}") from None
    try:
        pool = load_pool(args.pool, args.pool_kwargs)
    except BaseException:
        sock.close()
        raise
    if token is None and not is_loopback(args.host):
        warn(f"serving {args.pool} on {args.host} without a token: anyone who reaches the port can run episodes "
             f"(give --token-file or {TOKEN_ENV})")
    serve(pool, args.protocol, sock, token=token, max_sessions=args.max_sessions,
          session_timeout_s=args.session_timeout)
    return EXIT_OK


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a pool over OpenEnv or MCP (one session = one episode)")
    p.add_argument("--pool", required=True, help="pool name (or NAME:ARG, e.g. worldbook:DIR)")
    p.add_argument("--protocol", required=True, choices=PROTOCOLS)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=number(int, min=0, max=65535), default=8000, help="default 8000; 0: a free one")
    p.add_argument("--token-file", default=None, metavar="F",
                   help=f"require 'Authorization: Bearer <token>' with the token in F (default: ${TOKEN_ENV})")
    p.add_argument("--max-sessions", type=positive_int, default=DEFAULT_MAX_SESSIONS,
                   help=f"concurrent sessions (episodes) at most (default {DEFAULT_MAX_SESSIONS})")
    p.add_argument("--session-timeout", type=number(float, min=0, min_open=True), default=DEFAULT_SESSION_TIMEOUT_S,
                   metavar="S", help=f"end a session idle for S seconds (default {DEFAULT_SESSION_TIMEOUT_S:g})")
    p.set_defaults(func=cmd_serve)
