"""A one-rank ``fit`` over DataLoaders with worker processes, for the stop tests.

    python tests/workers/stop_dataloader.py OUT_DIR MODE

Trains a linear model on a data set whose every example takes ``ITEM_S`` to load, through a
``DataLoader`` with ``WORKERS`` worker processes (``dataloader_batches``), validating every
epoch on another such loader, checkpointing into ``OUT_DIR/checkpoints``.  ``MODE``:

- ``plain``: the loaders as a user writes them;
- ``ignoring``: the loaders' workers run
  :func:`lamploop.forked_children.leave_stop_signals_to_the_run` (``worker_init_fn``);
- ``slow-validation``: plain loaders, validation four times slower; ``OUT_DIR/validating.json``
  names the epoch whose validation pass has begun (on rank 0);
- ``slow-validation-2``: the same on two ranks (``fit(world_size=2)`` starts rank 1 itself);
- ``persistent``: the training loader keeps its workers between epochs
  (``persistent_workers=True``); three epochs;
- ``first-of-two``: one epoch, with a checkpoint extra (checkpoints at epoch ends);
- ``slow-resume``: resumes from ``OUT_DIR/checkpoints`` (``first-of-two`` wrote it) through
  that checkpoint extra whose restore takes ``RESTORE_S``; ``OUT_DIR/restoring.json``
  is written when it begins (fit has begun, no training yet).

``OUT_DIR/started.json`` holds this process's pid once the script runs.  Exit status: 143
after a stop by SIGTERM, 130 by SIGINT (the ``TrainingInterrupted`` message on stderr), 0
when ``MAX_EPOCHS`` are done.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import lamploop
from lamploop.batches import BatchContext
from lamploop.forked_children import leave_stop_signals_to_the_run

ITEM_S = 0.01
WORKERS = 2
BATCH = 8
EXAMPLES = 96
MAX_EPOCHS = 50
RESTORE_S = 1.0


def _write(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


class Slow(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Example ``i``, after ``delay`` seconds of loading."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return x, (x.sum() > 0).long()


class Restoring:
    """A checkpoint extra whose restore is slow (a big buffer read back)."""

    def __init__(self, marker: Path | None) -> None:
        self.marker = marker

    def state_dict(self) -> tuple[dict[str, torch.Tensor], Any]:
        return {"x": torch.zeros(1)}, {}

    def load_state_dict(self, tensors: Any, meta: Any) -> None:
        if self.marker is not None:
            _write(self.marker, {"at": time.time()})
            time.sleep(RESTORE_S)


def main(out: Path, mode: str) -> int:
    _write(out / "started.json", {"pid": os.getpid()})
    torch.manual_seed(0)
    init = leave_stop_signals_to_the_run if mode == "ignoring" else None
    persistent = mode == "persistent"
    train = lamploop.dataloader_batches(
        DataLoader(
            Slow(ITEM_S),
            batch_size=BATCH,
            shuffle=True,
            num_workers=WORKERS,
            worker_init_fn=init,
            persistent_workers=persistent,
        )
    )
    slow_validation = mode in ("slow-validation", "slow-validation-2")
    validation_delay = ITEM_S * (4 if slow_validation else 1)

    def validation(context: BatchContext) -> DataLoader[Any]:
        if slow_validation and context.rank == 0:
            _write(out / "validating.json", {"epoch": context.epoch, "at": time.time()})
        return DataLoader(Slow(validation_delay), batch_size=BATCH, num_workers=WORKERS, worker_init_fn=init)

    marker = out / "restoring.json" if mode == "slow-resume" else None
    # An extra makes checkpoints epoch-end only: only the resume scenarios carry one.
    extras = {"slow": Restoring(marker)} if mode in ("first-of-two", "slow-resume") else None
    try:
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(4, 2), lamploop.cross_entropy_loss),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=train,
            validation_batches=lamploop.dataloader_batches(validation),
            max_epochs=1 if mode == "first-of-two" else 3 if persistent else MAX_EPOCHS,
            world_size=2 if mode == "slow-validation-2" else None,
            checkpoint_dir=out / "checkpoints",
            checkpoint_extras=extras,
            reporters=[],
        )
    except lamploop.errors.TrainingInterrupted as exc:
        print(f"at {time.time():.3f}: {exc}", file=sys.stderr, flush=True)
        return 143 if exc.reason == "SIGTERM" else 130
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
