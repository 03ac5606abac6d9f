"""The ``lamploop`` command.

Subcommands::

    lamploop demo [--out DIR] [--epochs N] [--batch-size N] [--world-size N] [--seed N]
                  [--learning-rate LR] [--hidden-sizes N,N...]
    lamploop demo --resume DIR [--epochs N]      resume with DIR/config.json's settings
    lamploop inspect CKPT                        a checkpoint's state, learning curve and files
    lamploop plot CKPT -o curve.png [--title T]  the learning curve as a PNG (needs matplotlib)
    lamploop lr-find [--min-lr LR] [--max-lr LR] [--num-steps N] [--optimizer adam|sgd]
                     [--batch-size N] [--seed N] [--hidden-sizes N,N...] [-o plot.png]
                                                 the learning-rate range test on the demo's model
    lamploop federated approve PLAN.json --allow-list FILE
                                                 add a training plan's hash to a node's allow-list

``CKPT`` is a checkpoint directory or a run directory (then its latest valid checkpoint).
``demo`` saves its settings in ``DIR/config.json``; run again in the same directory, a
flag that disagrees with them is refused, naming it (``--epochs`` may change).

Exit statuses: 0 done; 1 training failed (one line on stderr says why: a lost rank, a bad
batch, a corrupt checkpoint, a flag that disagrees with the saved configuration...), or
``inspect`` found something wrong (the report on stdout, one line per bad file on stderr),
or ``plot`` could not read the checkpoint or has no matplotlib, or ``lr-find`` has no
suggestion (the loss diverged too soon) or no matplotlib for ``-o``; 2 bad command-line
arguments; 130 stopped by SIGINT (Ctrl-C) and 143 by SIGTERM, after the step in progress
and a checkpoint there (run the same command again to resume at that step; a second
signal stops at once).
A failed distributed run exits with its status at once, also when a collective is stuck
(see :mod:`lamploop.distributed.abandon`).
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from lamploop.errors import ConfigurationError, LamploopError, TrainingInterrupted

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_TERMINATED", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


def _hidden_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        msg = f"expected comma-separated integers like 128,64, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if any(size < 1 for size in sizes):
        msg = f"every hidden size must be >= 1, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return sizes


def _parser() -> argparse.ArgumentParser:
    from lamploop import __version__

    parser = argparse.ArgumentParser(
        prog="lamploop", description="Training loops as plain data and functions."
    )
    parser.add_argument("--version", action="version", version=f"lamploop {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="train an MLP on scikit-learn's digits and leave checkpoints",
        description="Train an MLP on scikit-learn's digits, checkpointing into --out; its settings are "
        "saved there as config.json. Run again in the same directory, it resumes; a flag that "
        "disagrees with the saved settings is refused (--epochs may change).",
    )
    # Flags default to None: a flag left out takes the saved value when resuming.
    demo.add_argument("--epochs", type=int, help="epochs in all (default: 30)")
    where = demo.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, help="checkpoint directory (default: runs/demo)")
    where.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="resume the run in DIR with the settings in DIR/config.json (no other flag needed)",
    )
    demo.add_argument("--batch-size", type=int, help="examples per batch (default: 32)")
    demo.add_argument("--world-size", type=int, help="local ranks, one process each (default: 2)")
    demo.add_argument(
        "--seed", type=int, help="seed of the split, the weights and the shuffling (default: 0)"
    )
    demo.add_argument("--learning-rate", type=float, help="Adam's learning rate (default: 0.001)")
    demo.add_argument(
        "--hidden-sizes",
        type=_hidden_sizes,
        metavar="N,N",
        help="widths of the hidden layers (default: 128,64)",
    )
    _verbose_flag(demo)
    inspect = commands.add_parser(
        "inspect",
        help="show a checkpoint's state, learning curve and files, checking every file",
        description="Check every file of a checkpoint (or of every checkpoint of a run directory) "
        "and print its state, learning curve and files. Exits 1 when anything is wrong.",
    )
    _checkpoint_argument(inspect)
    _verbose_flag(inspect)
    plot = commands.add_parser(
        "plot",
        help="draw a checkpoint's learning curve into a PNG (needs matplotlib)",
        description="Draw the learning curve of a checkpoint into a PNG. "
        'Needs matplotlib: pip install "lamploop[plot]".',
    )
    _checkpoint_argument(plot)
    plot.add_argument("-o", "--output", type=Path, required=True, help="the PNG file to write")
    plot.add_argument("--title", help="the figure's title (default: the checkpoint's path)")
    _verbose_flag(plot)
    _lr_find_parser(commands)
    _federated_parser(commands)
    return parser


def _verbose_flag(command: argparse.ArgumentParser) -> None:
    command.add_argument("-v", "--verbose", action="store_true", help="log lamploop's own messages too")


def _checkpoint_argument(command: argparse.ArgumentParser) -> None:
    command.add_argument("checkpoint", type=Path, metavar="CKPT", help="a checkpoint or run directory")


def _lr_find_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    lr_find = commands.add_parser(
        "lr-find",
        help="the learning-rate range test on the demo's model and data; suggests a learning rate",
        description="Train a copy of the demo's MLP on scikit-learn's digits with a learning rate that grows "
        "exponentially from --min-lr to --max-lr, stopping when the loss diverges, and print the suggested "
        "learning rate (the rate at the lowest smoothed loss / 10). -o draws the losses (needs matplotlib).",
    )
    lr_find.add_argument("--min-lr", type=float, default=1e-7, help="the first step's rate (default: 1e-7)")
    lr_find.add_argument("--max-lr", type=float, default=10.0, help="the last step's rate (default: 10)")
    lr_find.add_argument("--num-steps", type=int, default=100, help="optimizer steps at most (default: 100)")
    lr_find.add_argument(
        "--optimizer",
        choices=["adam", "sgd"],
        default="adam",
        help="Adam, as the demo trains with, or plain SGD (default: adam)",
    )
    lr_find.add_argument("--batch-size", type=int, default=32, help="examples per batch (default: 32)")
    lr_find.add_argument(
        "--seed", type=int, default=0, help="seed of the split, weights and shuffling (default: 0)"
    )
    lr_find.add_argument(
        "--hidden-sizes",
        type=_hidden_sizes,
        default=(128, 64),
        metavar="N,N",
        help="widths of the hidden layers (default: 128,64)",
    )
    lr_find.add_argument(
        "-o", "--output", type=Path, help="also draw the losses into this PNG (needs matplotlib)"
    )
    _verbose_flag(lr_find)


def _federated_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    federated = commands.add_parser(
        "federated", help="federated rounds: approve a training plan on a node (see docs/federated.md)"
    )
    actions = federated.add_subparsers(dest="federated_command", required=True)
    approve = actions.add_parser(
        "approve",
        help="add a training plan's hash to this node's allow-list",
        description="Check a training plan (JSON), print its sha256 and add it to the node's allow-list "
        "(created if missing). A node trains only plans whose hash is on its allow-list.",
    )
    approve.add_argument("plan", type=Path, metavar="PLAN.json", help="the training plan")
    approve.add_argument(
        "--allow-list", type=Path, required=True, metavar="FILE", help="the node's allow-list (JSON)"
    )
    _verbose_flag(approve)


def _federated(args: argparse.Namespace) -> int:
    from lamploop.federated import approve_plan, load_plan

    plan = load_plan(args.plan)
    digest, added = approve_plan(plan, args.allow_list)
    what = "approved" if added else "already approved"
    print(f"{what}: {digest} ({plan.name}) in {args.allow_list}", flush=True)
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from lamploop.checks import check_parents
    from lamploop.demo import demo_config, train_demo

    given = {
        name: value
        for name, value in (
            ("epochs", args.epochs),
            ("batch_size", args.batch_size),
            ("world_size", args.world_size),
            ("seed", args.seed),
            ("learning_rate", args.learning_rate),
            ("hidden_sizes", args.hidden_sizes),
        )
        if value is not None
    }
    directory = args.resume if args.resume is not None else (args.out or Path("runs/demo"))
    flag = "--resume" if args.resume is not None else "--out"
    if directory.exists() and not directory.is_dir():
        msg = f"{flag} {directory}: exists and is not a directory; name a directory for the run"
        raise ConfigurationError(msg)
    check_parents(flag, directory)
    config = demo_config(directory, given, resume=args.resume is not None)
    train_demo(config, directory)
    return EXIT_OK


def _inspect(args: argparse.Namespace) -> int:
    from lamploop.inspection import format_report, inspect_checkpoint

    report = inspect_checkpoint(args.checkpoint)
    print(format_report(report), end="", flush=True)
    if report.ok:
        return EXIT_OK
    for problem in report.problems:
        print(f"lamploop: {problem}", file=sys.stderr, flush=True)
    return EXIT_FAILED


def _lr_find(args: argparse.Namespace) -> int:
    import torch

    from lamploop.batches import tensor_batches
    from lamploop.checks import check_seed
    from lamploop.demo import digits_data, digits_model
    from lamploop.lr_find import lr_find
    from lamploop.model import SupervisedModel

    if args.batch_size < 1:
        msg = f"--batch-size must be >= 1, got {args.batch_size}"
        raise ConfigurationError(msg)
    check_seed("--seed", args.seed)
    if args.output is not None:
        _make_parent(args.output)  # before the range test, not after it
    optimizers = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    make = optimizers[args.optimizer]
    x_train, y_train, _, _ = digits_data(args.seed)
    result = lr_find(
        model=SupervisedModel(digits_model(args.seed, args.hidden_sizes)),
        optimizer_factory=lambda params: make(params, lr=args.min_lr),
        train_batches=tensor_batches(x_train, y_train, batch_size=args.batch_size, seed=args.seed),
        min_lr=args.min_lr,
        max_lr=args.max_lr,
        num_steps=args.num_steps,
    )
    took = f"{len(result.lrs)} steps from {result.lrs[0]:.3g} to {result.lrs[-1]:.3g}"
    how = "stopped there: the loss diverged" if result.diverged else "the whole range"
    print(
        f"learning-rate range test ({args.optimizer}, batch size {args.batch_size}): {took}, {how}",
        flush=True,
    )
    if result.suggestion is not None:
        print(
            f"suggested learning rate: {result.suggestion:.3g} "
            f"(the lowest smoothed loss was at {result.suggestion * 10:.3g}; a tenth of that)",
            flush=True,
        )
        if args.optimizer == "adam":  # the demo's optimizer: its flags for the same model and data
            flags = f"--learning-rate {result.suggestion:.3g}"
            flags += f" --batch-size {args.batch_size}" if args.batch_size != 32 else ""
            flags += f" --seed {args.seed}" if args.seed != 0 else ""
            if tuple(args.hidden_sizes) != (128, 64):
                flags += f" --hidden-sizes {','.join(map(str, args.hidden_sizes))}"
            print(f"try: lamploop demo {flags}", flush=True)
    if args.output is not None:
        print(f"wrote {result.plot(args.output)}", flush=True)
    if result.suggestion is None:
        print(
            "lamploop: no suggestion: too few steps before the loss diverged "
            "(lower --min-lr or raise --num-steps)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_FAILED
    return EXIT_OK


def _make_parent(output: Path) -> None:
    """Create the directory ``-o`` names a file in, as ``demo --out`` creates its run directory."""
    if output.is_dir():
        msg = f"-o {output}: is a directory; name the PNG file to write (e.g. {output / 'plot.png'})"
        raise ConfigurationError(msg)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        msg = f"-o {output}: cannot create its directory: {exc.strerror or exc}"
        raise ConfigurationError(msg) from exc


def _plot(args: argparse.Namespace) -> int:
    from lamploop.plotting import plot_learning_curve

    _make_parent(args.output)
    path = plot_learning_curve(args.checkpoint, args.output, title=args.title)
    print(f"wrote {path}", flush=True)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module doc)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    commands = {
        "demo": _demo,
        "inspect": _inspect,
        "plot": _plot,
        "lr-find": _lr_find,
        "federated": _federated,
    }
    try:
        return commands[args.command](args)
    except TrainingInterrupted as exc:
        print(f"lamploop: {exc}", file=sys.stderr, flush=True)
        return EXIT_TERMINATED if exc.reason == "SIGTERM" else EXIT_INTERRUPTED
    except LamploopError as exc:
        print(f"lamploop: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except OSError as exc:  # a file that cannot be written or read (permissions, a full disk)
        print(f"lamploop: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("lamploop: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        if argv is None:  # the program ends next: spare it the final collection of torch's heap
            gc.freeze()  # (0.8-0.9 s of CPU at exit, seconds at a high load; measured in issue 21)


if __name__ == "__main__":
    sys.exit(main())
