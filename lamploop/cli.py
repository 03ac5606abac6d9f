"""The ``lamploop`` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lamploop", description="Training loops as plain data and functions."
    )
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
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    if args.command == "demo":
        from lamploop.demo import run_demo

        run_demo(
            epochs=args.epochs,
            out=args.out,
            batch_size=args.batch_size,
            seed=args.seed,
            world_size=args.world_size,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
