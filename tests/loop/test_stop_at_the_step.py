"""One rank stops after the step in progress when SIGINT or SIGTERM comes during it.

A one-rank ``fit`` over batches in memory never waits, so its event loop, which hands the
signal to the run's stop request, gets a turn only when the pass gives it one. Before that
was so, a signal during step 6 of 12 stopped the run at the end of the epoch (step 8), and a
Slurm pre-emption of a long epoch was not honoured before its SIGKILL. Steps here last 30 ms,
longer than the pass's turn-giving period (20 ms), so the stop lands on the step itself.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

import lamploop
from lamploop.batches import BatchContext
from lamploop.errors import TrainingInterrupted

STEPS_PER_EPOCH = 4


def _batches(context: BatchContext) -> AsyncIterator[Any]:
    generator = torch.Generator().manual_seed(context.epoch)
    x = torch.randn(STEPS_PER_EPOCH * 4, 3, generator=generator)
    y = (x.sum(dim=1) > 0).long()

    async def stream() -> AsyncIterator[Any]:
        for i in range(STEPS_PER_EPOCH):
            yield x[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4]

    return stream()


@pytest.mark.parametrize(
    ("signum", "signal_in_step"), [(signal.SIGINT, 2), (signal.SIGTERM, 6), (signal.SIGINT, 7)]
)
def test_one_rank_stops_after_the_step_during_which_the_signal_came(
    tmp_path: Path, signum: signal.Signals, signal_in_step: int
) -> None:
    taken: list[int] = []

    class SignalledSGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            taken.append(len(taken) + 1)
            time.sleep(0.03)
            if len(taken) == signal_in_step:
                os.kill(os.getpid(), signum)  # inside the step, as a scheduler's signal would land
            return super().step(closure)

    torch.manual_seed(0)
    with pytest.raises(TrainingInterrupted) as stopped:
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
            optimizer_factory=lambda params: SignalledSGD(params, lr=0.1),
            train_batches=_batches,
            max_epochs=3,
            world_size=1,
            reporters=[],
            checkpoint_dir=tmp_path,
        )
    epoch, step = divmod(signal_in_step, STEPS_PER_EPOCH)
    if step == 0:  # the epoch's last step: its end is the boundary
        epoch, step = epoch - 1, STEPS_PER_EPOCH
    assert len(taken) == signal_in_step, f"{len(taken)} steps taken: {stopped.value}"
    assert stopped.value.reason == signum.name
    assert (stopped.value.epoch, stopped.value.steps_done) == (epoch, step), str(stopped.value)
    latest = (tmp_path / "latest").read_text().strip()
    assert latest == f"epoch-{epoch:06d}-step-{step:06d}", latest
