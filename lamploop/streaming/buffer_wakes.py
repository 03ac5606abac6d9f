"""The waits of a stream buffer shared by several threads, each with its own event loop.

A buffer is filled by a receiver and read by a trainer.  Both may run on one event loop, or
the receiver on a thread of its own (its own event loop), so that receiving and decoding do
not take the training thread's time.  A task that must wait (a read before the watermark, a
put into a full FIFO) waits on an ``anyio.Event`` of its own loop, registered here under the
buffer's lock; whoever changes the buffer wakes the waiters under the same lock, so no wake
is lost.  An event of another thread's loop is set on that loop (``call_soon_threadsafe``
with asyncio; the token's non-waiting call with trio): never from the wrong thread.

.. versionadded:: 0.3
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

__all__ = ["Waiters"]


def _current_loop() -> tuple[object, Callable[[Callable[[], object]], object]]:
    """The running event loop, and a function that runs a callback soon on it from any thread."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # pragma: no cover - anyio's other backend (trio), not installed here
        # Its token's run_sync_soon, which does not wait: a wake is sent under the buffer's
        # lock, and a call that waited for the other loop could wait for that lock.
        native: Any = anyio.lowlevel.current_token().native_token
        return native, native.run_sync_soon
    return loop, loop.call_soon_threadsafe


class _Wait:
    """One loop's event, set from its own thread directly or from another through its loop."""

    __slots__ = ("event", "loop", "schedule", "thread")

    def __init__(self, loop: object, schedule: Callable[[Callable[[], object]], object]) -> None:
        self.event = anyio.Event()
        self.thread = threading.get_ident()
        self.loop, self.schedule = loop, schedule

    def set(self) -> None:
        if threading.get_ident() == self.thread:
            self.event.set()
            return
        with contextlib.suppress(RuntimeError):  # that loop has ended: nobody waits there any more
            self.schedule(self.event.set)


class Waiters:
    """The tasks waiting for one change of a buffer (a read may succeed; a put may), per loop.

    :meth:`event` and :meth:`wake` are called with the buffer's lock held.
    """

    __slots__ = ("_waits",)

    def __init__(self) -> None:
        self._waits: dict[int, _Wait] = {}

    def event(self) -> anyio.Event:
        """The event the calling task waits on (one per loop, shared by its waiting tasks)."""
        thread = threading.get_ident()
        loop, schedule = _current_loop()
        wait = self._waits.get(thread)
        if wait is None or wait.loop != loop:  # (a loop this thread ran before left it behind)
            wait = self._waits[thread] = _Wait(loop, schedule)
        return wait.event

    def wake(self) -> None:
        """Wake every waiting task, on every loop; the next wait registers anew."""
        if self._waits:
            waits = list(self._waits.values())
            self._waits.clear()
            for wait in waits:
                wait.set()
