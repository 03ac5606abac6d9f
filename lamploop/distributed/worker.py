"""Where a rank's epoch runs: on a worker thread, so the event loop stays free for the control channel.

In a run of several ranks the event loop carries the control channel: heartbeats, the
detection of a lost rank, cancellation.  Compute and blocking collective waits must not
hold it, or a long step looks like a dead rank and a dead rank is found only when a
collective times out.  So :func:`run_on_worker` runs each epoch on a worker thread with
an event loop of its own (batch streams are async iterables) and keeps awaiting it,
cancellably: when the control channel fails, the awaiting task is cancelled,
:func:`run_on_worker` sets the rank's :class:`~lamploop.sync.collectives.AbortSignal`,
and the worker, whose every collective wait looks at that signal between short slices,
gives up within a slice (or, where it may be blocked out of the signal's reach, is given up
on: see :func:`run_on_worker`).  The cancellation then goes on; the control channel raises the
error that names the lost rank.  Unless the worker had failed by then with an error that
every rank detects itself (a NaN loss...: see :mod:`lamploop.errors`): that error is raised
instead of the cancellation it outlived, since the cancellation came from another rank
failing alike.

What runs where::

    event loop (main thread)                worker thread (one epoch at a time)
    ------------------------                ----------------------------------
    control channel: heartbeats, commands   one_epoch: batches, forward, backward,
    epochs(): schedule, checkpoints         optimizer step, collective waits (sliced,
    run_on_worker(): awaits, aborts         abort signal checked between slices)
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final, TypeVar, cast

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from lamploop.errors import DistributedError, error_detected_by_every_rank
from lamploop.sync.collectives import DEFAULT_GIVE_UP_AFTER_S, AbortSignal

__all__ = [
    "EpochRunner",
    "RankThread",
    "mark_raised_by_work",
    "open_rank_thread",
    "raised_by_work",
    "run_here",
    "run_on_worker",
    "worker_runner",
]

T = TypeVar("T")
_CANCELLED = "the run was cancelled on this rank (the control channel failed or the caller gave up)"
EpochRunner = Callable[[Callable[[], Awaitable[float]]], Awaitable[float]]
"""Runs one epoch coroutine function and returns its result."""


async def run_here(epoch: Callable[[], Awaitable[float]]) -> float:
    """Run the epoch on the event loop itself (one rank: no heartbeats to keep)."""
    return await epoch()


async def run_on_worker(work: Callable[[], T], abort: AbortSignal) -> T:
    """Call ``work`` on a thread of its own; if the awaiting task is cancelled, set ``abort``.

    Returns what ``work`` returns and raises what it raises; on cancellation, waits for the
    worker to give up (it does within a collective's wait slice) and re-raises the cancellation,
    unless the worker failed with an error that every rank detects itself: that one wins.

    The worker is waited for ``abort.give_up_after`` after the signal (by default
    :data:`~lamploop.sync.collectives.DEFAULT_GIVE_UP_AFTER_S`; shorter for a sharded model,
    whose ``DTensor`` collectives wait out of the signal's reach), no longer: the cancellation
    then goes on and the worker is left where it is (the user's batch source or forward that
    blocks; it may still change the model until it returns).  It runs on a daemon thread, so
    that it never holds the process's exit.  A rank's epochs run on its :class:`RankThread`.
    """
    async with open_rank_thread(abort) as thread:
        return await thread.run(work)


class RankThread:
    """The one daemon thread a rank's blocking work runs on, job after job, for the whole run.

    One thread, not one per epoch: torch keeps state per thread that must outlive an epoch
    (a profiler's window spans epochs, and its callbacks must run on the thread that
    registered them: a second thread crashed the process).  Open it with
    :func:`open_rank_thread`; :meth:`run` is :func:`run_on_worker` on this thread.
    """

    def __init__(self, abort: AbortSignal) -> None:
        self._abort = abort
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="lamploop rank worker", daemon=True)
        self.given_up = False  # a job was left blocked after the abort: the thread is never joined

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    async def run(self, work: Callable[[], T]) -> T:
        """Call ``work`` on this thread and await it, cancellably (see :func:`run_on_worker`)."""
        if self.given_up:
            msg = "the rank's worker thread was given up on (blocked after the abort): it runs nothing more"
            raise DistributedError(msg)
        try:  # an owner already cancelled queues nothing (a join after the channel failed)
            await anyio.lowlevel.checkpoint_if_cancelled()
        except anyio.get_cancelled_exc_class():
            self._abort.set(_CANCELLED)
            raise
        outcome: list[tuple[bool, object]] = []
        finished = anyio.Event()
        token = anyio.lowlevel.current_token()

        def call() -> None:
            try:
                outcome.append((True, work()))  # a fresh context: the thread's own event loops
            except BaseException as exc:  # handed to the awaiting task, which raises it
                outcome.append((False, exc))
            finally:
                # The awaiting task may be gone (a worker given up on): then so may the event loop.
                with contextlib.suppress(RuntimeError):
                    anyio.from_thread.run_sync(finished.set, token=token)

        self._jobs.put(call)
        try:
            await finished.wait()
        except anyio.get_cancelled_exc_class():
            self._abort.set(_CANCELLED)
            # A thread cannot be cancelled: wait for it to give up, shielded from the cancellation.
            with anyio.CancelScope(shield=True) as waiting:
                give_up_after = self._abort.give_up_after
                waiting.deadline = anyio.current_time() + (
                    DEFAULT_GIVE_UP_AFTER_S if give_up_after is None else give_up_after
                )
                await finished.wait()
            self.given_up = not finished.is_set()
            # The worker's own verdict, if every rank reaches it, outranks a cancellation caused by
            # another rank failing alike.
            failed = outcome and not outcome[0][0]
            own = error_detected_by_every_rank(cast(BaseException, outcome[0][1])) if failed else None
            if own is not None:
                raise own from None
            raise
        ok, value = outcome[0]
        if not ok:
            error = cast(BaseException, value)
            if isinstance(error, anyio.get_cancelled_exc_class()):
                # Nothing cancelled this task: the job's own code raised it (a user's forward).
                mark_raised_by_work(error)
            raise error
        return cast(T, value)

    async def _close(self) -> None:
        """End the thread and wait until it is gone, unless it was given up on.

        A daemon thread still ending while the interpreter finalizes is stopped where it
        stands: without this join, a rank whose run succeeded exited now and then with status
        -6 (``terminate called without an active exception``).  Only a thread given up on
        (blocked in C++, out of the interpreter's way) is left alive.
        """
        self._jobs.put(None)  # a thread given up on ends too, should its job ever return
        if self.given_up:
            return
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._thread.join)


@contextlib.asynccontextmanager
async def open_rank_thread(abort: AbortSignal) -> AsyncIterator[RankThread]:
    """A :class:`RankThread` for ``abort``'s rank, started here and ended on leaving."""
    thread = RankThread(abort)
    thread._thread.start()
    try:
        yield thread
    finally:
        await thread._close()


def worker_runner(thread: RankThread) -> EpochRunner:
    """An :data:`EpochRunner` that runs each epoch in an event loop of its own on the rank's ``thread``."""

    async def run(epoch: Callable[[], Awaitable[float]]) -> float:
        return await thread.run(functools.partial(anyio.run, epoch))

    return run


_RAISED_BY_WORK: Final = "_lamploop_raised_by_work"


def mark_raised_by_work(error: BaseException) -> None:
    """Note that ``error``, a cancellation exception, was raised by a rank's work, not by a cancellation."""
    setattr(error, _RAISED_BY_WORK, True)


def raised_by_work(error: BaseException) -> bool:
    """Whether ``error`` is a cancellation exception that a rank's work raised (:func:`mark_raised_by_work`).

    The drivers tell their peers of it as of an error: no cancel scope made it, so it is not
    the rank's answer to a peer's loss.
    """
    return bool(getattr(error, _RAISED_BY_WORK, False))
