"""Where a second stop request ends a run at once although its event loop is held.

The event loop handles SIGTERM and SIGINT between its tasks' steps.  A plain (synchronous)
iterable that takes long to make its next batch holds the loop meanwhile, and a second signal,
which should stop the run at once, would wait for that batch.  While such an iterable runs on
the main thread (:func:`holding_the_loop`), the run's signal handler (:mod:`lamploop.stopping`)
raises :class:`StopAtOnce` right there instead, as Python's own ``KeyboardInterrupt`` does.

.. versionadded:: 0.3
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager

__all__ = ["StopAtOnce", "held", "holding_the_loop"]


class StopAtOnce(BaseException):
    """A second stop request came while a plain iterable held the event loop.

    A ``BaseException``, as ``KeyboardInterrupt``: an iterable's ``except Exception`` does not
    swallow it.  ``fit`` turns it into the :class:`~lamploop.errors.TrainingInterrupted` of a
    run stopped at once.
    """


class _Holding:
    """The context of :func:`holding_the_loop` (a class: entered once per batch, it costs less
    than a generator-based context manager)."""

    def __init__(self) -> None:
        self.count = 0  # changed on the main thread only; read there by the signal handler
        self._main = threading.main_thread().ident

    def __enter__(self) -> None:
        if threading.get_ident() == self._main:
            self.count += 1

    def __exit__(self, *_exc: object) -> None:
        if threading.get_ident() == self._main:
            self.count -= 1


_HOLDING = _Holding()


def holding_the_loop() -> AbstractContextManager[None]:
    """Mark the block as code that holds the event loop for an unknown time (counted on the
    main thread only, where signal handlers run)."""
    return _HOLDING


def held() -> bool:
    """Whether the main thread is inside :func:`holding_the_loop` now."""
    return _HOLDING.count > 0
