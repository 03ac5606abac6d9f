"""``StopRequest``: a request to stop a run at its next step boundary, set from any thread.

A signal handler, a notebook's Ctrl-C or another rank sets it (:mod:`lamploop.stopping`);
every rank's training pass looks at it at each step boundary
(:class:`~lamploop.distributed.boundaries.RankBoundary`), and a batch stream waiting for
data looks at it too (:mod:`lamploop.loop.stop_aware`).  It is plain data for the layers
above the loop, so it lives here, below all of them.
"""

from __future__ import annotations

import threading
from typing import Final

__all__ = ["SIGNAL_TURNS", "StopRequest"]

SIGNAL_TURNS: Final = 8
"""Turns of the event loop that hand a signal waiting in its wake-up socket to the run's stop
request (three suffice with asyncio: read the socket, run the handler, wake the watcher)."""


class StopRequest:
    """Set from a signal handler (any thread): stop at the next step boundary."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._at_once = threading.Event()
        self.reason = ""

    def request(self, reason: str) -> None:
        """Stop at the next step boundary."""
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        """Whether a stop was requested."""
        return self._event.is_set()

    def request_at_once(self) -> None:
        """Stop now, without a checkpoint (a second request)."""
        self._at_once.set()

    def at_once(self) -> bool:
        """Whether a stop at once was requested."""
        return self._at_once.is_set()
