"""A `fit` run reading a slow `DataLoader` with workers, for the signal test of test_acceptance_docs.

Written from docs/reliability.md ("waiting in a DataLoader with workers"): a SIGTERM to the
whole process group reaches the loader's workers too; `dataloader_batches` makes them leave it
to the run, which stops at the next step boundary with status 143 and that boundary's
checkpoint.

Usage: ``python acceptance_dataloader_stop.py CHECKPOINT_DIR READY_FILE``. The dataset touches
``READY_FILE`` from a worker process once the loader's workers serve batches.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import lamploop
from lamploop.errors import TrainingInterrupted


class SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """64 examples, each taking 20 ms to read: the run spends its time waiting on the workers."""

    def __init__(self, ready: Path) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 4, generator=generator)
        self.y = torch.randint(0, 2, (64,), generator=generator)
        self.ready = ready

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.02)
        info = torch.utils.data.get_worker_info()
        if info is not None and not self.ready.exists():
            self.ready.write_text(str(os.getpid()))
        return self.x[index], self.y[index]


def main() -> None:
    """Train until a signal stops the run (many epochs: the signal comes long before the end)."""
    checkpoint_dir, ready = Path(sys.argv[1]), Path(sys.argv[2])
    torch.manual_seed(0)
    loader = DataLoader(SlowDataset(ready), batch_size=8, shuffle=True, num_workers=2)
    try:
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(4, 2)),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=lamploop.dataloader_batches(loader),
            max_epochs=1000,
            checkpoint_dir=checkpoint_dir,
            device="cpu",
            reporters=[],
        )
    except TrainingInterrupted as stop:
        # As the lamploop command does: one line, then 143 for SIGTERM (130 for SIGINT).
        print(f"interrupted: {stop.reason} epoch {stop.epoch} step {stop.steps_done}", flush=True)
        sys.exit(143 if stop.reason == "SIGTERM" else 130)
    sys.exit(3)  # the run ended by itself: the test's signal did not stop it


if __name__ == "__main__":
    main()
