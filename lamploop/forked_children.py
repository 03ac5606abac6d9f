"""Processes forked during a run leave SIGINT and SIGTERM to the run (DataLoader workers).

A run that handles its signals (:func:`lamploop.stopping.stop_on_signals`) has them written
into its event loop's wake-up socket (``signal.set_wakeup_fd``).  A process forked from it
inherits that socket and the handlers: a ``DataLoader`` worker that receives the same SIGINT
(Ctrl-C reaches the terminal's whole process group) writes it into the *run's* socket, and the
run counts two SIGINTs for one, a second request, which stops at once, without the checkpoint
of the step boundary.  Measured: ``fit`` over a ``DataLoader`` with 2 workers, one SIGINT to
the process group: "stopped at once by a second SIGINT" before, the graceful stop with its
checkpoint after.

- :func:`signals_stay_with_this_process`: while its block runs, a process forked from this one
  drops the inherited wake-up socket at once (``os.register_at_fork``; the forking thread
  blocks SIGINT and SIGTERM across the fork, so a signal that reaches the child before its
  hook ran waits until the socket is dropped); the signal watcher enters it;
- :func:`leave_stop_signals_to_the_run`: a ``DataLoader`` ``worker_init_fn`` (or the first
  thing one calls) that makes the worker ignore SIGINT and SIGTERM.  A worker then outlives
  a SIGTERM sent to the whole job (Slurm's ``scancel``, ``kill -TERM -PGID``), which otherwise
  kills it (torch's worker handler exits only on its parent's SIGTERM) and fails the run with
  ``DataLoader worker ... is killed by signal: Terminated`` instead of stopping it at the step
  boundary; the run shuts its workers down itself when it stops.  A worker stuck in native
  code then ignores the SIGTERM of its DataLoader's shutdown too: it ends when it sees its
  parent gone (torch's watchdog);
- :func:`workers_forked_here_wait_for_their_init`: workers forked in its block hold the stop
  signals until that init ignores them (a SIGTERM in between killed one);
- :func:`shut_down_at_exit`: such workers also ignore the SIGTERM of Python's exit, which then
  joins them without a bound; a DataLoader iterator given to it has its workers shut down first.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, Protocol

__all__ = [
    "leave_stop_signals_to_the_run",
    "not_inherited_by_workers",
    "shut_down_at_exit",
    "signals_stay_with_this_process",
    "workers_forked_here_wait_for_their_init",
    "worker_init_leaving_signals",
]

_lock = threading.Lock()
_watching = 0
"""How many blocks of :func:`signals_stay_with_this_process` run in this process now."""
_registered = False


@contextmanager
def signals_stay_with_this_process() -> Iterator[None]:
    """While the block runs, processes forked from this one do not signal its event loop.

    Re-entrant and thread-safe; costs nothing per fork outside such a block.
    """
    global _watching
    with _lock:
        _register()
        _watching += 1
    try:
        yield
    finally:
        with _lock:
            _watching -= 1


def _register() -> None:
    global _registered
    if not _registered:  # (under _lock)
        os.register_at_fork(
            before=_before_fork, after_in_parent=_restore_mask, after_in_child=_after_fork_in_child
        )
        _registered = True


@contextmanager
def workers_forked_here_wait_for_their_init() -> Iterator[None]:
    """Processes forked from this thread in the block start with SIGINT and SIGTERM blocked
    until :func:`leave_stop_signals_to_the_run` (their ``worker_init_fn``) ignores them.

    A ``DataLoader`` forks its workers when an epoch's iteration begins; torch's worker code
    installs a SIGTERM handler that kills the worker on anyone's SIGTERM but its parent's
    before it calls ``worker_init_fn``.  A SIGTERM to the whole job in that window killed a
    worker and failed the run ("DataLoader worker ... exited unexpectedly") instead of stopping
    it at the step boundary (a CI run saw it).  Blocked, the signal waits in the worker until
    its init ignores it.  Only for forks whose workers do run that init.
    """
    with _lock:
        _register()
    _forks_wait_for_init.on = True
    try:
        yield
    finally:
        _forks_wait_for_init.on = False


_forks_wait_for_init = threading.local()
"""Whether forks from this thread keep the stop signals blocked in the child until its init."""

_blocked_until_init = False
"""In a worker forked under :func:`workers_forked_here_wait_for_their_init`: still blocked."""


class HasFileno(Protocol):
    def fileno(self) -> int: ...


_sockets_of_the_run: weakref.WeakSet[HasFileno] = weakref.WeakSet()
"""The run's connections, which the processes it forks must not hold (:func:`not_inherited_by_workers`)."""


def not_inherited_by_workers(connection: HasFileno) -> None:
    """Processes this run forks (DataLoader workers) do not keep ``connection`` open.

    ``connection`` is held weakly; its ``fileno()`` names its socket's descriptor (negative
    once closed).  A forked process holds a copy of every descriptor: when a rank died
    (SIGKILL) with its loader's workers alive, those orphans kept its control connections
    open, and its peers saw no end of stream: they found it lost only at the heartbeat timeout
    (4 s), not at once.  In such a child the descriptor is pointed at ``/dev/null`` (not
    closed: the number stays taken, so nothing the child opens later gets it while the copied
    socket object names it).
    """
    with _lock:
        _sockets_of_the_run.add(connection)


def _drop_the_runs_sockets() -> None:
    descriptors = [fd for fd in (conn.fileno() for conn in list(_sockets_of_the_run)) if fd >= 0]
    if not descriptors:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in descriptors:
            with suppress(OSError):
                os.dup2(null, fd)
    finally:
        os.close(null)


_STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
_mask_before_fork = threading.local()
"""The forking thread's signal mask, kept by :func:`_before_fork` until the fork returns."""


def _before_fork() -> None:
    # A child signalled between the fork and its first hook would write into the parent's
    # wake-up socket (the C handler runs from the child's first instruction; on a loaded
    # machine the child may wait milliseconds to run): the forking thread blocks the stop
    # signals across the fork, so such a signal waits in the child until its hook dropped the
    # socket.  The parent's other threads (its main thread) still take them meanwhile.
    if _watching or getattr(_forks_wait_for_init, "on", False):
        _mask_before_fork.mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)


def _restore_mask() -> None:
    mask = getattr(_mask_before_fork, "mask", None)
    if mask is not None:
        _mask_before_fork.mask = None
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _after_fork_in_child() -> None:
    global _watching, _blocked_until_init
    waits_for_init = getattr(_forks_wait_for_init, "on", False)
    if _watching or waits_for_init:
        _watching = 0  # this child watches nothing of its own yet
        # The parent's event loop's socket: its signals are not ours.  (Forked from a thread
        # other than the main one: no wake-up fd to drop.)
        with suppress(ValueError):
            signal.set_wakeup_fd(-1)
        _drop_the_runs_sockets()
    if waits_for_init:
        _forks_wait_for_init.on = False
        _blocked_until_init = True  # leave_stop_signals_to_the_run unblocks them, ignored
        _mask_before_fork.mask = None
        return
    _restore_mask()  # a stop signal that came meanwhile is delivered now, to this child alone


_to_shut_down: weakref.WeakSet[Any] = weakref.WeakSet()
"""DataLoader iterators whose workers this process's exit ends (see :func:`shut_down_at_exit`)."""

_at_exit_registered = False


def shut_down_at_exit(iterator: Any) -> None:
    """Shut down ``iterator``'s workers (a DataLoader's) when this process exits, if still alive.

    Workers that leave the stop signals to the run also ignore the SIGTERM of Python's exit
    (``multiprocessing`` terminates its daemonic children, then joins them without a bound):
    a process whose persistent workers were alive at its exit waited forever.  This runs
    before that join (``atexit`` runs the last registered first, and ``multiprocessing``
    registered at import), through torch's own shutdown of the iterator.
    """
    global _at_exit_registered
    with _lock:
        if not _at_exit_registered:
            atexit.register(_shut_down_what_is_left)
            _at_exit_registered = True
        _to_shut_down.add(iterator)


def _shut_down_what_is_left() -> None:
    for iterator in list(_to_shut_down):
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if callable(shutdown):
            with suppress(Exception):  # exiting: a worker that cannot be asked is left to the OS
                shutdown()


def leave_stop_signals_to_the_run(worker_id: int = 0) -> None:
    """A ``DataLoader`` ``worker_init_fn``: this worker ignores SIGINT and SIGTERM (see the module).

    The run (the worker's parent) stops on them at its next step boundary and shuts the
    workers down then; the worker's own signal would otherwise kill it or be counted twice.
    """
    global _blocked_until_init
    del worker_id  # every worker alike
    with suppress(ValueError):  # not the main thread: no wake-up fd to drop
        signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if _blocked_until_init:  # a stop signal that came since the fork is discarded now, ignored
        _blocked_until_init = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def worker_init_leaving_signals(
    worker_init_fn: Callable[[int], object] | None,
) -> Callable[[int], None]:
    """``worker_init_fn`` (``None``: nothing) preceded by :func:`leave_stop_signals_to_the_run`."""
    if getattr(worker_init_fn, "_leaves_stop_signals_to_the_run", False):
        return worker_init_fn  # type: ignore[return-value]  # already wrapped (a loader made twice)

    def init(worker_id: int) -> None:
        leave_stop_signals_to_the_run(worker_id)
        if worker_init_fn is not None:
            worker_init_fn(worker_id)

    init._leaves_stop_signals_to_the_run = True  # type: ignore[attr-defined]
    return init
