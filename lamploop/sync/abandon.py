"""Leaving behind a process group whose run failed with a collective still pending.

A Gloo operation that a frozen or cut-off peer never joins cannot be cancelled, and
destroying its process group blocks until the operation fails by itself (up to the
collective timeout): ``abort()`` and ``shutdown()`` return without unblocking it.  The
interpreter destroys the group at exit too, so a process whose run failed would hang
there instead of exiting with its status.

So a failed run's group is *abandoned*: :func:`abandon` takes an extra reference to it
that is never released (not even when the interpreter clears its modules at exit), so
its destructor never runs.  The operations still in flight and their tensors are
abandoned with it: otherwise, when a peer's exit finally fails such an operation, the
Gloo thread that ran it drops the last reference, and the operation's destructor frees
the Python objects it captured with the thread-local state it was started in (a backward
pass stashes one), which needs the interpreter.  If that happens while the interpreter
finalizes, the thread is ended inside C++ code and the process aborts (``terminate
called without an active exception``, status -6) instead of exiting with its status.

The process then exits at once with the status it was going to exit with; the group's
threads end with the process.

A process that goes on after a failed run (a notebook trying again, a test suite) would keep
every failed run's group, its threads and its store's listening port.  So once everything
that was in flight on an abandoned group has ended (its peers exited, failing it), nothing of
the above holds any more, and :func:`reclaim_ended` releases the group: its destructor no
longer blocks, and what it frees is freed on a Python thread.  ``fit`` does that after a failed
run whose followers it started and saw exit.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

__all__ = ["abandon", "abandoned_count", "reclaim_ended"]

_lock = threading.Lock()
_abandoned: list[tuple[Any, tuple[Any, ...]]] = []  # each group, with what was in flight on it


def abandon(group: Any, *in_flight: Any) -> None:
    """Keep ``group`` (and what is ``in_flight`` on it) alive until it has all ended.

    Neither the run's end nor the process's then blocks on the group, and no thread of
    the group ever frees a Python object.
    """
    with _lock:
        _abandoned.append((group, in_flight))
        # Extra references the interpreter never drops, even while it finalizes (CPython).
        for obj in (group, *in_flight):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def abandoned_count() -> int:
    """How many process groups this process keeps abandoned."""
    return len(_abandoned)


def reclaim_ended() -> int:
    """Release the abandoned groups whose operations have all ended; how many are still kept.

    Call it on a Python thread while the interpreter runs (not from a finalizer): the last
    references may go here.
    """
    with _lock:
        ended = [entry for entry in _abandoned if all(_ended(obj) for obj in entry[1])]
        for entry in ended:
            _abandoned.remove(entry)
        kept = len(_abandoned)
    for group, in_flight in ended:
        for obj in (group, *in_flight):
            ctypes.pythonapi.Py_DecRef(ctypes.py_object(obj))
    return kept


def _ended(obj: Any) -> bool:
    """A collective's work that completed (or failed), or anything else (its tensors)."""
    completed = getattr(obj, "is_completed", None)
    return not callable(completed) or bool(completed())
