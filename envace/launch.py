"""Launch helpers used by ``scripts/train.sh`` (``python -m envace.launch wait-nodes ...``)."""

from __future__ import annotations

import argparse
import sys
import time


def wait_nodes(n: int, timeout: float, poll: float = 2.0) -> int:
    """Block until the Ray cluster at RAY_ADDRESS has ``n`` alive nodes; returns 0, or 1 on timeout."""
    import ray

    ray.init(address="auto", log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout
        while True:
            alive = sum(1 for node in ray.nodes() if node.get("Alive"))
            if alive >= n:
                print(f"envace: Ray cluster has {alive}/{n} nodes", flush=True)
                return 0
            if time.monotonic() > deadline:
                print(f"envace: only {alive}/{n} Ray nodes joined within {timeout:g}s", file=sys.stderr)
                return 1
            time.sleep(poll)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envace.launch")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait-nodes", help="wait until the Ray cluster has N alive nodes")
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.cmd == "wait-nodes":
        return wait_nodes(args.nodes, args.timeout)
    return 2


if __name__ == "__main__":
    sys.exit(main())
