"""A federated node on a deterministic shard, for tests/test_federated*.py.

    python tests/workers/federated_node.py CONFIG_JSON

CONFIG_JSON (a JSON object): name, port, allow_list, rows ([start, stop] of :func:`dataset`),
batch_size, and optionally spin_s (CPU-busy seconds per training batch, after touching
``marker``: a node slow enough to be killed inside local training) and connect_timeout.
The token is LAMPLOOP_FEDERATED_TOKEN.  Prints the node's summary as JSON at the end.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import torch

from lamploop.batches import Batch, BatchContext, BatchStream, BatchStreamFactory, tensor_batches
from lamploop.federated import NodeSettings, run_node

FEATURES = 5
CLASSES = 3


def dataset(rows: int = 120, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (float64) and class labels every test process derives alike."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (rows,), generator=generator)
    return x, y


def _busy(factory: BatchStreamFactory, spin_s: float, marker: Path | None) -> BatchStreamFactory:
    def make(context: BatchContext) -> BatchStream:
        async def stream() -> AsyncIterator[Batch]:
            async for batch in factory(context):
                if marker is not None:
                    marker.write_bytes(b"")  # noqa: ASYNC240 -- a test's signal, microseconds
                end = time.process_time() + spin_s
                while time.process_time() < end:  # CPU-bound, as real local training is
                    pass
                yield batch

        return stream()

    return make


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config: dict[str, Any] = json.loads(sys.argv[1])
    x, y = dataset()
    start, stop = config["rows"]
    train = tensor_batches(x[start:stop], y[start:stop], batch_size=config["batch_size"], shuffle=False)
    if config.get("spin_s"):
        marker = Path(config["marker"]) if config.get("marker") else None
        train = _busy(train, float(config["spin_s"]), marker)
    validation = tensor_batches(x[start:stop], y[start:stop], batch_size=64, shuffle=False)
    summary = anyio.run(
        lambda: run_node(
            name=config["name"],
            host="127.0.0.1",
            port=config["port"],
            token=os.environ["LAMPLOOP_FEDERATED_TOKEN"],
            allow_list=config["allow_list"],
            train_batches=train,
            validation_batches=validation,
            settings=NodeSettings(
                connect_timeout=float(config.get("connect_timeout", 30.0)), retry_interval=0.05
            ),
        )
    )
    logging.getLogger("lamploop.federated").info("node %s done", config["name"])
    print(json.dumps({"trained": summary.trained, "refused": summary.refused, "failed": summary.failed}))
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown (seconds on a loaded machine): the test waits for it


if __name__ == "__main__":
    main()
