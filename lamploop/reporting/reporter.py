"""The reporter protocol: one method, called on the root's event loop."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from lamploop.reporting.events import Event

__all__ = ["Reporter", "report_all"]

logger = logging.getLogger("lamploop")


@runtime_checkable
class Reporter(Protocol):
    """Receives a run's events.  ``report`` must be quick: it runs between epochs, on the root."""

    def report(self, event: Event) -> None:
        """Take one event."""
        ...


def report_all(reporters: Iterable[Reporter], event: Event) -> None:
    """Hand ``event`` to every reporter; a reporter that fails is logged, never fails the run."""
    for reporter in reporters:
        try:
            reporter.report(event)
        except Exception:  # a broken reporter must not lose the training run
            logger.exception("reporter %r failed on %s", reporter, type(event).__name__)
