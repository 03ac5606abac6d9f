"""The reporter protocol: one method, called on the root's event loop."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from lamploop.errors import ConfigurationError
from lamploop.reporting.events import Event

__all__ = ["Reporter", "close_all", "report_all", "start_all"]

logger = logging.getLogger("lamploop")


@runtime_checkable
class Reporter(Protocol):
    """Receives a run's events (see :mod:`lamploop.reporting.events`).

    ``report`` is called on the root rank's event-loop thread, one event at a time, in
    the order the events happened; it must be quick (it runs between training steps, or
    between epochs).  A reporter may also have a ``start()`` method, which :func:`lamploop.fit`
    calls on the root before training (an error there stops the run before it starts: a
    port in use, a file that cannot be written), and a ``close()`` method, called once when
    the run ends, however it ends (after the last event), on every rank.
    """

    def report(self, event: Event) -> None:
        """Take one event."""
        ...


def report_all(reporters: Iterable[Reporter], event: Event) -> None:
    """Hand ``event`` to every reporter; a reporter that fails is logged, never fails the run."""
    try:
        each = iter(reporters)  # what the loop does anyway: no check of its own per event
    except TypeError:
        msg = f"report_all: reporters must be an iterable of reporters, got {type(reporters).__name__}"
        raise ConfigurationError(msg) from None
    for reporter in each:
        try:
            reporter.report(event)
        except Exception:  # a broken reporter must not lose the training run
            logger.exception("reporter %r failed on %s", reporter, type(event).__name__)


def start_all(reporters: Iterable[Reporter]) -> None:
    """Call ``start()`` on every reporter that has one; an error there is raised (nothing ran yet)."""
    for reporter in reporters:
        start = getattr(reporter, "start", None)
        if callable(start):
            start()


def close_all(reporters: Iterable[Reporter]) -> None:
    """Call ``close()`` on every reporter that has one; failures are logged."""
    for reporter in reporters:
        close = getattr(reporter, "close", None)
        if not callable(close):
            continue
        try:
            close()
        except Exception:
            logger.exception("closing reporter %r failed", reporter)
