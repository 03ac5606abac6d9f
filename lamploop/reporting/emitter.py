"""``EventEmitter``: hands events to the reporters on the root's event-loop thread, from any thread.

A multi-rank epoch runs on a worker thread (see docs/architecture.md); its progress events
are handed over to the event loop, which is free then (it only serves heartbeats), and the
worker waits the few microseconds that takes.  Reporters thus always run on one thread,
one event at a time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import anyio.from_thread
import anyio.lowlevel

from lamploop.reporting.events import Event
from lamploop.reporting.reporter import Reporter, report_all

__all__ = ["EventEmitter"]

logger = logging.getLogger("lamploop")


class EventEmitter:
    """Reports events to ``reporters``; make it on the event loop's thread (inside a task)."""

    def __init__(self, reporters: Sequence[Reporter]) -> None:
        self.reporters = tuple(reporters)
        self._loop_thread = threading.get_ident()
        self._token = anyio.lowlevel.current_token()

    def __bool__(self) -> bool:
        """Whether anyone listens (a run without reporters makes no events)."""
        return bool(self.reporters)

    def __call__(self, event: Event) -> None:
        if not self.reporters:
            return
        if threading.get_ident() == self._loop_thread:
            report_all(self.reporters, event)
            return
        try:
            anyio.from_thread.run_sync(report_all, self.reporters, event, token=self._token)
        except Exception as exc:  # the event loop is closing: an event lost is no reason to fail
            logger.debug("could not report %s: %s", type(event).__name__, exc)
