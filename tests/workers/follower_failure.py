"""A two-rank ``fit`` whose follower fails, for the tests of what the root then says.

    python tests/workers/follower_failure.py OUT_DIR MODE

Rank 0 runs :func:`lamploop.fit` with ``world_size=2``, which starts rank 1 by running this
script again (``launch_command``).  ``MODE`` says how rank 1 fails:

- ``optimizer``: its ``optimizer_factory`` raises ``ValueError(OPTIMIZER_MESSAGE)`` (rank 0's
  builds the optimizer), before rank 1 has joined the root;
- ``dataloader``: its training ``DataLoader`` (one worker process) raises
  ``ValueError(DATALOADER_MESSAGE)`` from deep inside the data set, so that the error rank 1
  sees is the DataLoader's re-raise: a message holding the worker's whole traceback (over
  ``TRACEBACK_FLOOR`` characters), with the data set's own message on its last line.

Each rank writes what it raised (type, message, and a lost rank's ``rank`` and ``how``) to
``OUT_DIR/rank<r>`` with :func:`workers.records.save_record` (JSON, no pickle), and exits
with status 1 when it raised.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import lamploop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from workers.records import save_record

OPTIMIZER_MESSAGE = "rank 1's optimizer factory refuses these parameters"
DATALOADER_MESSAGE = "sample 5 of rank 1 is unreadable: the user's own message, at the very end"
TRACEBACK_FLOOR = 3000
"""The DataLoader's re-raised message is longer than this (the old cut was at 1,000)."""
DEPTH = 20
"""How many pairs of nested calls the data set's error is raised under (a long traceback)."""


def _rank() -> int:
    return int(os.environ.get("LAMPLOOP_RANK", "0"))


def _deep(level: int, index: int) -> torch.Tensor:
    if level == 0:
        raise ValueError(DATALOADER_MESSAGE)
    return _deeper(level - 1, index)


def _deeper(level: int, index: int) -> torch.Tensor:
    # Two functions in turn: a traceback shows every frame (one function calling itself
    # is shown as "[Previous line repeated N more times]").
    return _deep(level, index)


class Examples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """32 examples of 3 features; on rank 1 example 5 cannot be read."""

    def __init__(self, rank: int) -> None:
        generator = torch.Generator().manual_seed(11)
        self.x = torch.randn(32, 3, generator=generator)
        self.y = torch.randint(0, 2, (32,), generator=generator)
        self.rank = rank

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rank == 1 and index == 5:
            _deep(DEPTH, index)
        return self.x[index], self.y[index]


def main(out: Path, mode: str) -> int:
    rank = _rank()

    def optimizer_factory(params: Any) -> torch.optim.Optimizer:
        if mode == "optimizer" and rank == 1:
            raise ValueError(OPTIMIZER_MESSAGE)
        return torch.optim.SGD(params, lr=0.1)

    torch.manual_seed(3)
    loader = DataLoader(Examples(rank), batch_size=4, num_workers=1 if mode == "dataloader" else 0)
    command = [sys.executable, str(Path(__file__).resolve()), str(out), mode]
    try:
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
            optimizer_factory=optimizer_factory,
            train_batches=lamploop.dataloader_batches(loader),
            max_epochs=2,
            world_size=2,
            launch_command=command,
            device="cpu",
            heartbeat_timeout=30.0,  # a loaded machine: only the failure ends the run
        )
    except Exception as exc:
        save_record(
            {
                "type": type(exc).__name__,
                "message": str(exc),
                "rank": getattr(exc, "rank", None),
                "how": getattr(exc, "how", None),
            },
            out / f"rank{rank}",
        )
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    save_record({"type": None, "message": "", "rank": None, "how": None}, out / f"rank{rank}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
