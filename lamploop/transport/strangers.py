"""Keeping strangers in check on a server's port: bounded handshakes and rate-limited refusal logs.

The servers are the control root, a sample receiver and the aggregator.

A flood of connections that never prove the token must not starve a real follower's join,
exhaust file descriptors or fill the log.  :class:`PendingHandshakes` bounds the
connections still handshaking: at the bound, the *oldest* is dropped (a real follower
answers the challenge within milliseconds, so it is never the oldest for long), instead of
queueing newcomers behind silent strangers.  :class:`RefusalLog` writes at most a few
warnings per window and then one line saying how many more were refused.

The cheapest refusal comes first: the server speaks first (its challenge), so a peer whose
bytes, or whose hang-up, are already there when the connection is accepted is not one of
its clients.  :func:`spoke_first` finds those with one non-blocking peek on the raw
socket, and the server closes them without starting a handshake, which under a flood of
strangers is most of them.

.. versionadded:: 0.3
   moved here from the control channel's private modules.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

__all__ = ["REFUSALS_LOGGER", "PendingHandshakes", "RefusalLog", "spoke_first"]

REFUSALS_LOGGER = "lamploop.control"
"""The logger of refusals, by default: the control root's, where they were first logged."""


def spoke_first(sock: socket.socket) -> bool:
    """Whether the peer of a just-accepted socket sent bytes or hung up before being spoken to."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # b"" at a hang-up, else a byte
    except BlockingIOError:
        return False  # nothing yet: as a follower waiting for the challenge
    except OSError:  # reset already: not worth a handshake either
        return True
    return True


class PendingHandshakes:
    """At most ``limit`` handshakes at once; a new one past the limit cancels the oldest."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._scopes: OrderedDict[int, anyio.CancelScope] = OrderedDict()
        self._next = 0
        self.evicted = 0

    @contextmanager
    def slot(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope for one handshake; check ``cancelled_caught`` to learn of an eviction."""
        key, self._next = self._next, self._next + 1
        while len(self._scopes) >= self._limit:
            _, oldest = self._scopes.popitem(last=False)
            oldest.cancel()
            self.evicted += 1
        with anyio.CancelScope() as scope:
            self._scopes[key] = scope
            try:
                yield scope
            finally:
                self._scopes.pop(key, None)


class RefusalLog:
    """Logs refused strangers, at most ``burst`` lines per ``window`` seconds; remembers the last few.

    ``who`` names the refusing side in the log lines (the control root, a sample receiver);
    ``logger`` is where they go (default :data:`REFUSALS_LOGGER`).
    """

    def __init__(
        self,
        *,
        burst: int = 10,
        window: float = 10.0,
        remember: int = 16,
        who: str = "control root",
        logger: str = REFUSALS_LOGGER,
    ) -> None:
        self._logger = logging.getLogger(logger)
        self._who = who
        self._burst = burst
        self._window = window
        self._window_start = time.monotonic()
        self._logged = 0
        self._suppressed = 0
        self.recent: deque[str] = deque(maxlen=remember)
        self.total = 0

    def refused(self, peer: str, reason: str) -> None:
        self.total += 1
        self.recent.append(f"{peer}: {reason}")
        now = time.monotonic()
        if now - self._window_start >= self._window:
            self.flush()
            self._window_start, self._logged = now, 0
        if self._logged < self._burst:
            self._logged += 1
            self._logger.warning("%s refused %s: %s", self._who, peer, reason)
        else:
            self._suppressed += 1

    def flush(self) -> None:
        """Log how many refusals went unlogged since the last line, if any."""
        if self._suppressed:
            self._logger.warning(
                "%s refused %d more connections in the last %g s (logged %d per %g s)",
                self._who,
                self._suppressed,
                self._window,
                self._burst,
                self._window,
            )
            self._suppressed = 0
