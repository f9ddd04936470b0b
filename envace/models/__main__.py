"""``python -m envace.models build [--out DIR] [--force] [--verify] [--warm-start]``: build the tiny Qwen3 (or its
SFT warm start) once; print its path. ``python -m envace.models export CHECKPOINT_DIR OUT [--dtype auto]``: a Hugging
Face checkpoint from verl's FSDP checkpoint, in the dtype the run's model had (:mod:`envace.models.export`). A usage
mistake (an ``--out`` that is a file or cannot be written, a checkpoint or OUT that cannot be exported, an export
this host lacks the memory for) exits 2 with one line (:mod:`trace2env.cliargs`); a damaged checkpoint shard exits 3
with one line naming it (damaged stored data, docs/cli.md). A warm start whose copy drill did not reach its target is
installed, and the build exits 1 with the warning as its last line."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from envace.models.export import DTYPES, ExportError, export
from trace2env.cliargs import ArgumentParser, UsageError, run_cli

PROG = "python -m envace.models"


def _main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or reuse) the tiny Qwen3 checkpoint and print its directory")
    b.add_argument("--out", default=None, help="target directory (default $ENVACE_CACHE/models/tiny-qwen3)")
    b.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    b.add_argument("--verify", action="store_true", help="afterwards check every file's sha256 against the manifest")
    b.add_argument(
        "--warm-start",
        action="store_true",
        help="build (or reuse) the SFT warm-started tiny Qwen3 ($ENVACE_CACHE/models/tiny-qwen3-warm) instead",
    )
    sub.add_parser("path", help="print the default directory (builds nothing)")
    e = sub.add_parser("export", help="write a Hugging Face checkpoint from verl's sharded FSDP checkpoint "
                       "(envace.models.export)")
    e.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a run directory, a global_step_N or its actor/")
    e.add_argument("out_dir", metavar="OUT", help="the new Hugging Face checkpoint directory")
    e.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="the weights' dtype (auto: the dtype of the model the run started from, its "
                   "huggingface/config.json's; bfloat16 is verl's own merge)")
    args = parser.parse_args(argv)
    if getattr(args, "out", None) and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out}: a file, expected a directory")

    if args.cmd == "export":
        print(export(args.checkpoint, args.out_dir, args.dtype))
        return 0

    from envace.models import tiny

    if args.cmd == "path":
        print(tiny.default_model_dir())
        return 0
    t0 = time.time()
    if args.warm_start:
        from envace.models.warmstart.build import ensure_warm, is_warm_complete, unformed_warning

        path, built = ensure_warm(args.out, force=args.force)
        complete = not args.verify or is_warm_complete(path, verify=True)
        warning = unformed_warning(path)
    else:
        path, built = tiny._ensure(args.out, force=args.force)
        complete = not args.verify or tiny.is_complete(path, verify=True)
        warning = None
    if not complete:
        print(f"verification failed: {path}", file=sys.stderr)
        return 1
    print(f"{'built' if built else 'reused'} in {time.time() - t0:.1f}s", file=sys.stderr)
    print(path)
    if warning:  # the build ran, and its verdict is negative (docs/cli.md: exit 1)
        print(f"{PROG}: {warning}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; a usage mistake exits 2 with one line, a damaged checkpoint shard 3 (``cliargs.run_cli``)."""
    return run_cli(PROG, _main, argv, user_errors=(PermissionError, NotADirectoryError, ExportError))


if __name__ == "__main__":
    sys.exit(main())
