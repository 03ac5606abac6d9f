"""Processes for tests/test_acceptance_hostile_r6.py.

    python tests/workers/hostile_r6_worker.py node CONFIG_JSON
    python tests/workers/hostile_r6_worker.py stage CONFIG_JSON

``node``: a federated node (token in LAMPLOOP_FEDERATED_TOKEN) on rows [start, stop) of
:func:`data`, spinning ``spin_s`` CPU seconds per training batch after touching ``marker``, so
that the test can SIGKILL it inside local training.  ``stage``: one pipeline rank; the config
says the rank, the port, the model (``layers``: ``["linear", in, out]`` or ``["relu"]``), the
spec and the epochs.  It prints one JSON line: ``{"ok": ...}`` or the error's class names and
message, and exits 0 or 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import torch

from lamploop.batches import Batch, BatchContext, BatchStream, BatchStreamFactory, tensor_batches

FEATURES, CLASSES = 4, 3


def data(rows: int = 60, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (rows,), generator=generator)
    return x, y


def _spinning(factory: BatchStreamFactory, spin_s: float, marker: Path) -> BatchStreamFactory:
    def make(context: BatchContext) -> BatchStream:
        async def stream() -> AsyncIterator[Batch]:
            async for batch in factory(context):
                marker.write_bytes(b"")  # noqa: ASYNC240 -- the test's signal
                end = time.process_time() + spin_s
                while time.process_time() < end:
                    pass
                yield batch

        return stream()

    return make


def _node(config: dict[str, Any]) -> dict[str, Any]:
    from lamploop.federated import NodeSettings, run_node

    x, y = data()
    start, stop = config["rows"]
    train = tensor_batches(x[start:stop], y[start:stop], batch_size=config["batch_size"], shuffle=False)
    train = _spinning(train, float(config["spin_s"]), Path(config["marker"]))
    summary = anyio.run(
        lambda: run_node(
            name=config["name"],
            host="127.0.0.1",
            port=config["port"],
            token=os.environ["LAMPLOOP_FEDERATED_TOKEN"],
            allow_list=config["allow_list"],
            train_batches=train,
            settings=NodeSettings(connect_timeout=20.0, retry_interval=0.05),
        )
    )
    return {"ok": True, "trained": list(summary.trained)}


def build(layers: list[list[Any]]) -> torch.nn.Sequential:
    torch.manual_seed(0)
    made: list[torch.nn.Module] = []
    for layer in layers:
        if layer[0] == "linear":
            made.append(torch.nn.Linear(layer[1], layer[2], dtype=torch.float64))
        else:
            made.append(torch.nn.ReLU())
    return torch.nn.Sequential(*made)


def _stage(config: dict[str, Any]) -> dict[str, Any]:
    from lamploop.pipeline import PipelineSpec, open_pipeline_group, train_pipeline

    x, y = data(rows=32)
    x = x[:, : config.get("features", FEATURES)]
    spec = PipelineSpec(boundaries=tuple(config["boundaries"]), n_microbatches=config["n_microbatches"])
    with open_pipeline_group(
        rank=config["rank"],
        world_size=2,
        host="127.0.0.1",
        port=config["port"],
        timeout=10.0,
        join_timeout=30.0,
    ):
        state = anyio.run(
            partial(
                train_pipeline,
                model=build(config["layers"]),
                spec=spec,
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                train_batches=tensor_batches(x, y, batch_size=8, shuffle=False),
                max_epochs=config.get("epochs", 1),
            )
        )
    return {"ok": True, "epoch": state.epoch, "losses": [e.training_loss for e in state.learning_curve]}


def main() -> None:
    kind, config = sys.argv[1], json.loads(sys.argv[2])
    try:
        result = _node(config) if kind == "node" else _stage(config)
    except BaseException as error:
        names = [cls.__name__ for cls in type(error).__mro__]
        print(json.dumps({"ok": False, "classes": names, "message": str(error)}), flush=True)
        sys.exit(1)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
