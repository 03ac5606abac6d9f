"""``LoggingReporter``: one line per epoch on the ``"lamploop"`` logger."""

from __future__ import annotations

import logging

from lamploop.reporting.events import EpochFinished, Event, RunFailed, RunFinished, RunStarted

__all__ = ["LoggingReporter", "describe_epoch"]


def describe_epoch(event: EpochFinished) -> str:
    """``epoch 3: train loss 0.1234, validation loss 0.2345 (smoothed 0.2400)``, then the metrics.

    With metrics: ``..., train accuracy 0.9100, validation accuracy 0.8800 (smoothed 0.8700)``.
    """
    entry = event.state.learning_curve[-1]
    text = f"epoch {entry.epoch}: train loss {entry.training_loss:.4f}"
    if entry.validation_loss is not None:
        smoothed, raw = entry.validation_loss
        text += f", validation loss {raw:.4f} (smoothed {smoothed:.4f})"
    for name, value in entry.training_metrics.items():
        text += f", train {name} {value:.4f}"
    for name, (smoothed, raw) in entry.validation_metrics.items():
        text += f", validation {name} {raw:.4f} (smoothed {smoothed:.4f})"
    return text


class LoggingReporter:
    """Logs each event at ``level`` (INFO by default) on ``logger``."""

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self.logger = logger if logger is not None else logging.getLogger("lamploop")
        self.level = level

    def report(self, event: Event) -> None:
        if isinstance(event, EpochFinished):
            self.logger.log(self.level, "%s", describe_epoch(event))
        elif isinstance(event, RunStarted):
            self.logger.log(
                self.level,
                "training on %d rank(s) from epoch %d to %d",
                event.nranks,
                event.epoch,
                event.max_epochs,
            )
        elif isinstance(event, RunFinished):
            self.logger.log(self.level, "finished after epoch %d", event.state.epoch - 1)
        elif isinstance(event, RunFailed):
            self.logger.error("training failed: %s", event.error)

    def __repr__(self) -> str:
        return f"LoggingReporter({self.logger.name!r})"
