"""A small ``fit`` run whose root writes every event it hears to a JSONL file.

``python tests/workers/events_fit.py OUT_DIR [--world-size N] [--epochs E] [--batch-sleep S]
[--prometheus-port P] [--tensorboard DIR] [--metrics-file PATH]``: rank 0 starts the other
ranks by running this command again (lamploop's own launcher); it writes
``OUT_DIR/events.jsonl`` (one line per event: its type and fields) and checkpoints in
``OUT_DIR/checkpoints``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

import lamploop
from lamploop.reporting.events import Event

N_TRAIN, N_VALID, BATCH = 384, 128, 16


def _plain(value: Any) -> Any:
    """JSON for what json does not know: attrs values (RunStarted's model summary) and mappings."""
    return attrs.asdict(value) if attrs.has(type(value)) else dict(value)


class EventFile:
    """Writes each event as one JSON line (LoopState values as their epoch)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.heard = False  # a follower runs the same script: its reporters hear nothing

    def report(self, event: Event) -> None:
        self.heard = True
        fields: dict[str, Any] = {}
        for name, value in attrs.asdict(event, recurse=False).items():
            fields[name] = value.epoch if isinstance(value, lamploop.LoopState) else value
        if isinstance(event, (lamploop.reporting.EpochFinished, lamploop.reporting.RunFinished)):
            entry = event.state.learning_curve[-1]
            fields["epoch"] = entry.epoch
            fields["training_loss"] = entry.training_loss
            fields["learning_rate_factor"] = entry.learning_rate_factor
        with self.path.open("a") as f:
            f.write(json.dumps({"type": type(event).__name__, **fields}, default=_plain) + "\n")

    def close(self) -> None:
        if not self.heard:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"type": "closed"}) + "\n")


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_VALID, 8, generator=generator)
    y = (x[:, :3].sum(dim=1) > 0).long() + (x[:, 3] > 1).long()
    return x, y


def slow(factory: lamploop.BatchStreamFactory, seconds: float) -> lamploop.BatchStreamFactory:
    """The same batches, each after ``seconds`` (a step long enough to watch)."""
    if seconds <= 0:
        return factory

    def make(context: lamploop.BatchContext) -> Any:
        async def stream() -> Any:
            async for batch in factory(context):
                time.sleep(seconds)  # noqa: ASYNC251 (compute-like: a busy thread, not an idle one)
                yield batch

        return stream()

    return make


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-sleep", type=float, default=0.0)
    parser.add_argument("--prometheus-port", type=int)
    parser.add_argument("--tensorboard", type=Path)
    parser.add_argument("--metrics-file", type=Path)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    reporters: list[Any] = [EventFile(args.out / "events.jsonl")]
    if args.prometheus_port is not None:
        from lamploop.reporting.prometheus import PrometheusReporter

        reporters.append(PrometheusReporter(args.prometheus_port))
    if args.tensorboard is not None:
        from lamploop.reporting.tensorboard import TensorBoardReporter

        reporters.append(TensorBoardReporter(args.tensorboard))
    if args.metrics_file is not None:
        from lamploop.reporting.metrics_file import MetricsFileReporter

        reporters.append(MetricsFileReporter(args.metrics_file))
    x, y = data()
    torch.manual_seed(1)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    lamploop.fit(
        model=lamploop.SupervisedModel(
            module, lamploop.cross_entropy_loss, metrics={"accuracy": lamploop.accuracy}
        ),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=slow(
            lamploop.tensor_batches(x[:N_TRAIN], y[:N_TRAIN], batch_size=BATCH), args.batch_sleep
        ),
        validation_batches=lamploop.tensor_batches(x[N_TRAIN:], y[N_TRAIN:], batch_size=64, shuffle=False),
        max_epochs=args.epochs,
        learning_rate_schedule=lamploop.linear(start=1.0, end=0.5, max_steps=args.epochs),
        checkpoint_dir=args.out / "checkpoints",
        world_size=args.world_size,
        reporters=reporters,
    )


def iter_events(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text().splitlines():
        yield json.loads(line)


if __name__ == "__main__":
    main(sys.argv[1:])
