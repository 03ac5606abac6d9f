"""A user's training script for tests/test_acceptance_docs_r6.py: ``fit`` with a checkpoint
directory, a CSV metrics file and an event log, stopped by a real signal and run again.

``python docs_r6_worker.py OUT MAX_EPOCHS EVENTS [in_loop]`` trains (with ``in_loop``, calling
``fit`` inside a running event loop, as a notebook does), checkpointing into ``OUT/ck`` and
appending one CSV row per epoch to ``OUT/metrics.csv``; every event goes to the JSON-lines file
``EVENTS`` as it happens (flushed, so the test can wait for a point in the run). On
``TrainingInterrupted`` it prints ``INTERRUPTED {json}`` and exits 3; at the end it writes the
final parameters to ``OUT/final.safetensors`` and prints ``DONE``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import lamploop
from lamploop.errors import TrainingInterrupted
from lamploop.reporting import MetricsFileReporter

STEP_SLEEP_S = 0.006
"""Each forward pass sleeps this long, so that a signal lands inside an epoch."""


class SlowNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(STEP_SLEEP_S)
        return self.body(x)


class EventLog:
    """Every event as one JSON line: its type and the fields a test reads."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def report(self, event: Any) -> None:
        row = {"type": type(event).__name__}
        for name in ("epoch", "steps_done", "examples_done", "reason", "path"):
            value = getattr(event, name, None)
            if value is not None:
                row[name] = value if isinstance(value, (int, float, str)) else str(value)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(320, 4, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, y


def train(out: Path, max_epochs: int, events: Path | None) -> tuple[Any, torch.nn.Module]:
    x, y = data()
    torch.manual_seed(0)
    module = SlowNet()
    reporters: list[Any] = [MetricsFileReporter(out / "metrics.csv")]
    if events is not None:
        reporters.append(EventLog(events))
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        train_batches=lamploop.tensor_batches(x[:256], y[:256], batch_size=8),  # 32 steps per epoch
        validation_batches=lamploop.tensor_batches(x[256:], y[256:], batch_size=32, shuffle=False),
        max_epochs=max_epochs,
        checkpoint_dir=out / "ck",
        reporters=reporters,
        device="cpu",
    )
    return state, module


def main() -> int:
    out, max_epochs, events = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    in_loop = sys.argv[4:] == ["in_loop"]
    out.mkdir(parents=True, exist_ok=True)
    try:
        if in_loop:  # as a notebook cell calls it: inside a running event loop

            async def cell() -> tuple[Any, torch.nn.Module]:
                return train(out, max_epochs, events)

            _, module = asyncio.run(cell())
        else:
            _, module = train(out, max_epochs, events)
    except TrainingInterrupted as stop:
        info = {"epoch": stop.epoch, "steps_done": stop.steps_done, "reason": stop.reason}
        print("INTERRUPTED " + json.dumps(info), flush=True)
        return 3
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(out / "final.safetensors"))
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
