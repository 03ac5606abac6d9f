"""One node of the federated digits example: its own data, its own allow-list.

    LAMPLOOP_FEDERATED_TOKEN=... python examples/federated_digits/node.py node-1 \
        --port 7611 --allow-list node-1/allow.json

The node connects out to the aggregator at 127.0.0.1:PORT and trains every round of a plan
whose hash is on its allow-list (``lamploop federated approve PLAN.json --allow-list FILE``);
its examples never leave it, only the parameters and aggregate statistics do.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from digits_split import NODE_NAMES, class_counts, node_data

from lamploop.batches import tensor_batches
from lamploop.federated import NodeSettings, run_node


def say(line: str) -> None:
    """Print ``line`` in one write."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=NODE_NAMES)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--allow-list", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-validation", action="store_true", help="skip validation before/after training")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"{args.name} %(name)s: %(message)s")
    x_train, y_train, x_valid, y_valid = node_data(NODE_NAMES.index(args.name), args.seed)
    # One write per line: three nodes share the terminal (or a pipe), lines must not interleave.
    say(f"{args.name}: {len(y_train)} training examples, per class {class_counts(y_train)}")
    summary = anyio.run(
        lambda: run_node(
            name=args.name,
            host="127.0.0.1",
            port=args.port,
            token=os.environ["LAMPLOOP_FEDERATED_TOKEN"],
            allow_list=args.allow_list,
            train_batches=tensor_batches(x_train, y_train, batch_size=args.batch_size, seed=args.seed),
            validation_batches=None
            if args.no_validation
            else tensor_batches(x_valid, y_valid, batch_size=256, shuffle=False),
            settings=NodeSettings(connect_timeout=60.0, retry_interval=0.05),
        )
    )
    say(f"{args.name}: trained rounds {list(summary.trained)}; {summary.finish_reason}")
    os._exit(1 if summary.failed else 0)  # no interpreter teardown: the run is over


if __name__ == "__main__":
    main()
