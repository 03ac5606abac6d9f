"""``TensorBoardReporter``: a run's losses, metrics and speed as TensorBoard scalars.

Every training scalar is written at the run's global step (see
:mod:`lamploop.reporting.global_step`), the epochs' included, with the epoch as a scalar of
its own, ``epoch``: per-step and per-epoch curves share one x axis.
``tensorboard --logdir <log_dir>`` shows them.  It needs the ``tensorboard`` package
(``pip install "lamploop[tensorboard]"``).

>>> import tempfile
>>> from lamploop.reporting import EpochFinished, TensorBoardReporter
>>> from lamploop.state import LearningCurveEntry, LoopState
>>> log_dir = tempfile.mkdtemp()
>>> board = TensorBoardReporter(log_dir)  # the event file is made at the first event
>>> state = LoopState(epoch=1, learning_curve=[LearningCurveEntry(0, 0.5, validation_loss=(0.6, 0.7))])
>>> board.report(EpochFinished(state, seconds=2.0, steps=10, examples=640))
>>> board.close()
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from lamploop.checks import check_directory
from lamploop.errors import ConfigurationError
from lamploop.reporting.events import (
    CheckpointWritten,
    EpochFinished,
    EpochStarted,
    Event,
    IngestionSampled,
    ProgressSampled,
)
from lamploop.reporting.extras import require_extra
from lamploop.reporting.global_step import GlobalStep
from lamploop.reporting.scalars import epoch_scalars, progress_scalars

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["TensorBoardReporter"]


class TensorBoardReporter:
    """Writes a run's events as TensorBoard scalars under ``log_dir``.

    Args:
        log_dir: the directory of the event files (made at the first event).
        flush_secs: how often the writer flushes on its own, besides after each epoch.

    The x axis is the global step: the optimizer steps this process trained so far, over
    every epoch (:class:`~lamploop.reporting.global_step.GlobalStep`; a resumed process
    counts from 0 again).

    ``ProgressSampled``, at its ``total_steps``: ``epoch`` (the epoch in progress),
    ``train/loss_sampled`` (when a step finished since the previous sample),
    ``perf/examples_per_second``, and when it counts steps ``perf/step_seconds`` and
    ``perf/communication_seconds`` (per step).

    ``EpochFinished``, at the global step of the epoch's last step: ``epoch`` (the epoch
    that finished), ``train/loss``, ``validation/loss`` (raw) and
    ``validation/loss_smoothed`` (epochs that validated), ``train/<metric>``,
    ``validation/<metric>`` (raw) and ``validation/<metric>_smoothed``,
    ``schedule/learning_rate_factor`` (when recorded) and ``perf/epoch_seconds``; then the
    writer flushes.

    ``CheckpointWritten``: ``checkpoint/seconds``, at its step boundary's global step (an
    epoch's end for the end-of-epoch checkpoint).

    ``IngestionSampled`` (a streamed run), on an x axis of its own, ``samples`` (received
    so far: the intake goes on before and between steps):
    ``ingest/samples_per_second``, ``ingest/bytes_per_second``, ``ingest/put_seconds`` (the
    mean wait of a put), ``ingest/buffer_fill`` (the fraction of the capacity held) and
    ``ingest/reads``; under ``ingest/rank<r>/`` for ranks other than 0.  Other events write
    nothing.

    Raises:
        MissingDependencyError: tensorboard is not installed.
        ConfigurationError: ``flush_secs`` is not positive.
    """

    def __init__(self, log_dir: str | Path, *, flush_secs: float = 10) -> None:
        require_extra("TensorBoardReporter", "tensorboard", "tensorboard", "torch.utils.tensorboard")
        if not flush_secs > 0:
            msg = f"TensorBoardReporter: flush_secs must be > 0, got {flush_secs!r}"
            raise ConfigurationError(msg)
        self.log_dir = check_directory("TensorBoardReporter: log_dir", log_dir)
        self.flush_secs = float(flush_secs)
        self._writer: SummaryWriter | None = None
        self._closed = False
        self._steps = GlobalStep()

    def _get_writer(self) -> SummaryWriter:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir), flush_secs=self.flush_secs)
        return self._writer

    def report(self, event: Event) -> None:
        """Write the scalars of ``event`` (see the class docstring); nothing after :meth:`close`."""
        if self._closed:
            return
        if isinstance(event, ProgressSampled):
            step = self._steps.see(event)
            self._add(self._get_writer(), {"epoch": event.epoch, **progress_scalars(event)}, step, event.time)
        elif isinstance(event, EpochFinished):
            writer, step = self._get_writer(), self._steps.see(event)
            epoch = event.state.learning_curve[-1].epoch
            self._add(writer, {"epoch": epoch, **epoch_scalars(event)}, step, event.time)
            writer.flush()
        elif isinstance(event, CheckpointWritten):
            step = self._steps.see(event)
            self._get_writer().add_scalar("checkpoint/seconds", event.seconds, step, event.time)
        elif isinstance(event, EpochStarted):
            self._steps.see(event)  # where a resumed epoch's steps start
        elif isinstance(event, IngestionSampled):
            add, step = self._get_writer().add_scalar, event.samples  # x: samples received so far
            prefix = f"ingest/rank{event.rank}" if event.rank else "ingest"
            add(f"{prefix}/samples_per_second", event.samples_per_second, step, event.time)
            add(f"{prefix}/bytes_per_second", event.bytes_per_second, step, event.time)
            add(f"{prefix}/put_seconds", event.put_seconds_mean, step, event.time)
            add(f"{prefix}/buffer_fill", event.fill / event.capacity, step, event.time)
            add(f"{prefix}/reads", event.reads, step, event.time)

    @staticmethod
    def _add(writer: SummaryWriter, values: Mapping[str, float], step: int, at: float) -> None:
        for name, value in values.items():
            writer.add_scalar(name, value, step, at)

    def close(self) -> None:
        """Flush and close the event file (calling it again does nothing)."""
        self._closed = True
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def __repr__(self) -> str:
        return f"TensorBoardReporter({str(self.log_dir)!r})"
