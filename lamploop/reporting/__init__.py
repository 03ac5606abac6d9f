"""Reporting: what a run says about itself, as plain events handed to reporters.

A :class:`Reporter` receives :data:`Event` values (frozen attrs data) on the root rank;
:class:`LoggingReporter`, the default of :func:`lamploop.fit`, writes one log line per
epoch on the ``"lamploop"`` logger.  Other reporters (progress bars, TensorBoard,
Prometheus, CSV) are modules of their own behind the same protocol.

.. versionadded:: 0.2
"""

from lamploop.reporting.events import EpochFinished, Event, RunFailed, RunFinished, RunStarted
from lamploop.reporting.logging_reporter import LoggingReporter
from lamploop.reporting.reporter import Reporter, report_all

__all__ = [
    "EpochFinished",
    "Event",
    "LoggingReporter",
    "Reporter",
    "RunFailed",
    "RunFinished",
    "RunStarted",
    "report_all",
]
