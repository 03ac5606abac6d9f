"""``LoggingReporter``: one line per epoch on the ``"lamploop"`` logger, also without any set-up.

When nothing is configured to handle the ``"lamploop"`` logger (no handler on it or its
ancestors, as in a fresh script or notebook), the reporter writes its lines to stderr
itself (``lamploop: epoch 3: ...``), so ``fit`` shows its progress without set-up; once
the application configures logging, the lines go where that says, at ``level``.
"""

from __future__ import annotations

import logging
import sys

from lamploop.errors import ConfigurationError
from lamploop.reporting.events import (
    CheckpointWritten,
    EpochFinished,
    Event,
    PeerLost,
    RunFailed,
    RunFinished,
    RunStarted,
    RunStopped,
    StepBreakdown,
)

__all__ = ["LoggingReporter", "describe_epoch", "describe_step_breakdown"]

_PART_NAMES = {
    "data_wait": "data wait",
    "forward_backward": "forward+backward",
    "communication_wait": "communication wait",
    "optimizer": "optimizer",
    "checkpoint": "checkpoint",
}


def describe_epoch(event: EpochFinished) -> str:
    """``epoch 3: train loss 0.1234, validation loss 0.2345 (smoothed 0.2400)``, then the metrics.

    With metrics: ``..., train accuracy 0.9100, validation accuracy 0.8800 (smoothed 0.8700)``.
    """
    entry = event.state.learning_curve[-1]
    text = f"epoch {entry.epoch}: train loss {entry.training_loss:.4f}"
    if entry.validation_loss is not None:
        smoothed, raw = entry.validation_loss
        text += f", validation loss {raw:.4f}{_smoothed(smoothed, raw)}"
    for name, value in entry.training_metrics.items():
        text += f", train {name} {value:.4f}"
    for name, (smoothed, raw) in entry.validation_metrics.items():
        text += f", validation {name} {raw:.4f}{_smoothed(smoothed, raw)}"
    return text


def describe_step_breakdown(breakdown: StepBreakdown) -> str:
    """``per step 3.21 ms: data wait 4%, forward+backward 80%, ..., other 0%`` (shares of the steps' time).

    >>> two_steps = StepBreakdown(steps=2, seconds=0.01, data_wait=0.001, forward_backward=0.008)
    >>> print(describe_step_breakdown(two_steps))  # doctest: +NORMALIZE_WHITESPACE
    per step 5.00 ms: data wait 10%, forward+backward 80%, communication wait 0%, optimizer 0%,
    checkpoint 0%, other 10%
    """
    whole = breakdown.seconds if breakdown.seconds > 0 else 1.0
    shares = [(_PART_NAMES[name], value) for name, value in breakdown.parts().items()]
    shares.append(("other", breakdown.other))
    mean_ms = 1000 * breakdown.seconds / max(breakdown.steps, 1)
    return f"per step {mean_ms:.2f} ms: " + ", ".join(f"{name} {100 * v / whole:.0f}%" for name, v in shares)


def _smoothed(smoothed: float, raw: float) -> str:
    """`` (smoothed x)`` where smoothing changed the value (never with the default factor 1.0)."""
    return "" if smoothed == raw else f" (smoothed {smoothed:.4f})"


def describe_run_started(event: RunStarted) -> str:
    """The line of a run's start; a resumed run with no epoch left says so, and how to train on."""
    if event.epoch >= event.max_epochs:
        return (
            f"nothing to train: the run is at epoch {event.epoch} and max_epochs is {event.max_epochs} "
            "(raise max_epochs, e.g. lamploop demo --epochs N, to train on)"
        )
    return f"training on {event.nranks} rank(s) from epoch {event.epoch} to {event.max_epochs}"


_DETAIL = -1
"""A level in :func:`_describe`'s answer: one level below the reporter's (see :class:`LoggingReporter`)."""


def _describe(event: Event) -> tuple[int, str] | None:
    """The level (0: the reporter's; :data:`_DETAIL`: one below; ERROR/WARNING as is) and text of an event."""
    if isinstance(event, EpochFinished):
        if event.step_breakdown is None:
            return 0, describe_epoch(event)
        return 0, f"{describe_epoch(event)} ({describe_step_breakdown(event.step_breakdown)})"
    if isinstance(event, RunStarted):
        return 0, describe_run_started(event)
    if isinstance(event, RunFinished):
        return 0, finished_line(event)
    if isinstance(event, RunStopped):
        return 0, event.message
    if isinstance(event, PeerLost):
        return logging.WARNING, f"lost rank {event.rank} ({event.how})"
    if isinstance(event, RunFailed):
        return logging.ERROR, f"training failed: {event.error}"
    if isinstance(event, CheckpointWritten):
        where = f" in {event.path}" if event.path else ""
        return _DETAIL, f"checkpoint of epoch {event.epoch} step {event.steps_done}{where}"
    return None


class LoggingReporter:
    """Logs a run's epochs, start and end at ``level`` (INFO by default) on ``logger``.

    The start is followed by the model's summary (a record of its own: a heading, then a
    table of the top-level modules; see :mod:`lamploop.summary`) when the run made one.

    Warnings (a lost rank) and errors (the run failed) keep their own levels; progress
    samples are not logged.  A line per checkpoint written goes one level below ``level``
    (``level - 10``, and never below ``logging.DEBUG`` unless ``level`` is): ``DEBUG`` with
    the default ``INFO``, so that a run shows one line per epoch, and ``INFO`` with
    ``level=logging.WARNING``; with ``level=logging.DEBUG`` every line is at ``DEBUG``.
    """

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        if logger is not None and not isinstance(logger, logging.Logger | logging.LoggerAdapter):
            msg = f"LoggingReporter: logger must be a logging.Logger, got {type(logger).__name__}"
            raise ConfigurationError(msg)
        if isinstance(level, bool) or not isinstance(level, int):
            msg = (
                f"LoggingReporter: level must be a logging level (an int: logging.INFO...), got {level!r:.40}"
            )
            raise ConfigurationError(msg)
        self.logger = logger if logger is not None else logging.getLogger("lamploop")
        self.level = level
        self._fallback = logging.StreamHandler(sys.stderr)
        self._fallback.setFormatter(logging.Formatter("lamploop: %(message)s"))

    def report(self, event: Event) -> None:
        described = _describe(event)
        if described is None:
            return
        level, text = described
        self._log(self._level_of(level), text)
        if isinstance(event, RunStarted) and event.model_summary is not None:
            self._log(self.level, str(event.model_summary))  # a record of its own: heading and table

    def _level_of(self, level: int) -> int:
        """The level to log at for :func:`_describe`'s ``level``."""
        if level == 0:
            return self.level
        if level == _DETAIL:
            return max(self.level - 10, min(self.level, logging.DEBUG))
        return level

    def _log(self, level: int, text: str) -> None:
        if self.logger.hasHandlers():
            self.logger.log(level, "%s", text)
        elif level >= self.level and level > logging.DEBUG:
            # Nothing configured: say it on stderr ourselves (the root logger's last resort
            # would drop INFO), without touching the application's logging set-up.
            self._fallback.stream = sys.stderr  # whatever stderr is now (pytest swaps it)
            self._fallback.handle(self.logger.makeRecord(self.logger.name, level, "", 0, text, (), None))

    def __repr__(self) -> str:
        return f"LoggingReporter({self.logger.name!r})"


def finished_line(event: RunFinished) -> str:
    """``"finished after epoch 3: early stopping: ..."``: what a run that ended normally did, and why."""
    done = event.state.epoch
    text = f"finished after epoch {done - 1}" if done > 0 else "finished (no epoch to run)"
    return f"{text}: {event.reason}" if event.reason else text
