"""The ``lamploop`` command.

Exit statuses: 0 done; 1 training failed (one line on stderr says why: a lost rank, a bad
batch, a corrupt checkpoint...); 2 bad command-line arguments; 130 stopped by SIGINT
(Ctrl-C) and 143 by SIGTERM, after the step in progress and a checkpoint there (run the
same command again to resume at that step; a second signal stops at once).
A failed distributed run exits with its status at once, also when a collective is stuck
(see :mod:`lamploop.distributed.abandon`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from lamploop.errors import LamploopError, TrainingInterrupted

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_TERMINATED", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


def _parser() -> argparse.ArgumentParser:
    from lamploop import __version__

    parser = argparse.ArgumentParser(
        prog="lamploop", description="Training loops as plain data and functions."
    )
    parser.add_argument("--version", action="version", version=f"lamploop {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train an MLP on scikit-learn's digits and leave checkpoints")
    demo.add_argument("--epochs", type=int, default=30, help="epochs in all (default: 30)")
    demo.add_argument(
        "--out", type=Path, default=Path("runs/demo"), help="checkpoint directory (default: runs/demo)"
    )
    demo.add_argument("--batch-size", type=int, default=32, help="examples per batch (default: 32)")
    demo.add_argument("--world-size", type=int, default=2, help="local ranks, one process each (default: 2)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the split, the weights and the shuffling")
    demo.add_argument("-v", "--verbose", action="store_true", help="log lamploop's own messages too")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module doc)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    try:
        if args.command == "demo":
            from lamploop.demo import run_demo

            run_demo(
                epochs=args.epochs,
                out=args.out,
                batch_size=args.batch_size,
                seed=args.seed,
                world_size=args.world_size,
            )
    except TrainingInterrupted as exc:
        print(f"lamploop: {exc}", file=sys.stderr, flush=True)
        return EXIT_TERMINATED if exc.reason == "SIGTERM" else EXIT_INTERRUPTED
    except LamploopError as exc:
        print(f"lamploop: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("lamploop: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
