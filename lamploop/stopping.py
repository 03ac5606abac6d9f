"""Who may stop a run, and how ``fit`` blocks: signals, Ctrl-C in a notebook, a running event loop.

A run stops gracefully (after the step in progress, with a checkpoint) on a first request
and at once on a second.  Requests come from:

- SIGTERM and SIGINT, when ``fit`` runs on the main thread (a script, the CLI);
- Ctrl-C in a notebook: there the kernel's event loop already runs on the main thread, so
  :func:`blocking` runs the training on a thread of its own with its own event loop, and
  turns each ``KeyboardInterrupt`` that reaches the waiting main thread into a request;
- another rank: :func:`share_stop_requests` makes a request on any rank one on every rank,
  through the control channel, so that a rank that waits for data (and so never reaches the
  step boundary where requests travel with the step's count) hears it too.

.. versionadded:: 0.3
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

from lamploop.control.commands import ControlFollower, ControlRoot
from lamploop.errors import PeerLostError, TrainingInterrupted, error_detected_by_every_rank, exception_leaves
from lamploop.forked_children import signals_stay_with_this_process
from lamploop.interruptible import StopAtOnce, held
from lamploop.loop.stop_request import SIGNAL_TURNS, StopRequest
from lamploop.reporting.emitter import EventEmitter
from lamploop.reporting.events import PeerLost, RunFailed, RunStopped

__all__ = [
    "blocking",
    "event_loop_running",
    "reported_run",
    "share_stop_requests",
    "stop_if_requested_before_training",
    "stop_on_signals",
    "stop_request",
    "stopped_at_once",
]

logger = logging.getLogger("lamploop")

P = ParamSpec("P")
R = TypeVar("R")


_POLL_S = 0.1
"""How often a run off the main thread looks for a request to stop at once."""

_outer_stop: contextvars.ContextVar[StopRequest | None] = contextvars.ContextVar(
    "lamploop_stop", default=None
)


def stop_request() -> StopRequest:
    """The run's stop request: the one :func:`blocking` made for it, else a new one."""
    return _outer_stop.get() or StopRequest()


def event_loop_running() -> bool:
    """Whether this thread is already inside an asyncio event loop (a notebook cell, an async app)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@asynccontextmanager
async def stop_on_signals(stop: StopRequest) -> AsyncIterator[anyio.CancelScope]:
    """Turn stop requests into stops: the first at the next step boundary, a second at once.

    Yields the scope that a second request cancels.  On the main thread SIGTERM and SIGINT
    are the requests; elsewhere (see :func:`blocking`) the thread that waits makes them.
    The body's exceptions pass through unwrapped.  Enter one per run: leaving it sets back
    the handlers the caller had installed (``signal.signal``), and otherwise the signals'
    defaults, also under an outer one.
    """
    # Processes forked while it runs (DataLoader workers) must not write their copy of a
    # group signal into this event loop's wake-up socket: one Ctrl-C would count as two.
    failure: BaseException | None = None
    with anyio.CancelScope() as scope, signals_stay_with_this_process():
        async with anyio.create_task_group() as watchers:
            on_main = threading.current_thread() is threading.main_thread()
            # start, not start_soon: the handlers are in place before the body runs (fit restores
            # its checkpoint next, without an await that would let a watcher begin).
            await watchers.start(_watch_signals if on_main else _watch_at_once, stop, scope)
            try:
                yield scope
            except Exception as exc:  # raised below as it is: the task group would wrap it in a group
                failure = exc
            except BaseException as exc:
                exiting = _exit_inside(exc)
                if exiting is not None:  # sys.exit(3) in a forward exits with 3, a KeyboardInterrupt is one
                    failure = exiting
                elif not _stopped_at_once_in_a_held_loop(exc, stop):
                    raise
            finally:
                watchers.cancel_scope.cancel()
    if failure is not None:
        raise failure


def _stopped_at_once_in_a_held_loop(exc: BaseException, stop: StopRequest) -> bool:
    """Whether ``exc`` is (or holds only) the :class:`StopAtOnce` that a second signal raised in
    a plain iterable (the run then ends as one stopped at once: ``stop.at_once()``)."""
    return stop.at_once() and _only_stops_at_once(exc)


def _exit_inside(exc: BaseException) -> BaseException | None:
    """The ``SystemExit`` or ``KeyboardInterrupt`` that ``exc`` is, or that the task groups'
    exception groups in it hold alone (cancellations aside): ``None`` when there is none, or
    something else beside it."""
    leaves = [e for e in exception_leaves(exc) if not isinstance(e, anyio.get_cancelled_exc_class())]
    exits = [e for e in leaves if isinstance(e, SystemExit | KeyboardInterrupt)]
    return exits[0] if exits and len(exits) == len(leaves) else None


def _only_stops_at_once(exc: BaseException) -> bool:
    leaves = exception_leaves(exc)
    return bool(leaves) and all(isinstance(e, StopAtOnce) for e in leaves)


async def _watch_signals(
    stop: StopRequest, scope: anyio.CancelScope, *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    signalled = False  # a request relayed from another rank (see share_stop_requests) is no first signal
    callers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with (
            anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals,
            _at_once_in_held_loops(stop),
        ):
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if signalled:
                    scope.cancel()
                    return
                signalled = True
                stop.request(name)
                logger.info("%s: stopping after the current step (again to stop at once)", name)
    finally:
        _give_back(callers)


def _give_back(callers: Mapping[signal.Signals, Any]) -> None:
    """Set back the handlers the caller had installed (the receiver sets the defaults back).

    Not an outer event loop's own handler: its registration went with the receiver's, so the
    default is what stands for it (see :func:`stop_on_signals`).
    """
    for signum, handler in callers.items():
        if handler is None or getattr(handler, "__name__", "") == "_sighandler_noop":
            continue
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


@contextmanager
def _at_once_in_held_loops(stop: StopRequest) -> Iterator[None]:
    """While the loop's signal receiver is open: a second SIGTERM or SIGINT that comes while a
    plain iterable holds the loop (:mod:`lamploop.interruptible`) raises StopAtOnce there.

    The event loop keeps receiving every signal (its wake-up socket is written by the C-level
    handler whatever the Python-level one is); this Python-level handler, which runs on the
    main thread between two bytecodes even while the loop is held, only counts them and acts
    when the loop cannot.
    """
    seen = 0
    run = os.getpid()

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal seen
        if os.getpid() != run:  # a process forked from the run (a loader's worker) leaves it to the run
            return
        seen += 1
        if seen >= 2 and held():
            stop.request(signal.Signals(signum).name)
            stop.request_at_once()
            raise StopAtOnce(signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if signal.getsignal(signum) is on_signal:  # else the receiver has set its default back
                signal.signal(signum, handler)


async def _watch_at_once(
    stop: StopRequest, scope: anyio.CancelScope, *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    task_status.started()
    # The request comes from another thread, which cannot set an anyio.Event here: poll.
    while not stop.at_once():  # noqa: ASYNC110
        await anyio.sleep(_POLL_S)
    scope.cancel()


def share_stop_requests(
    stop: StopRequest, control: ControlRoot | ControlFollower | None
) -> AbstractAsyncContextManager[None]:
    """``async with share_stop_requests(stop, control):`` a stop request on any rank is one on all.

    While the body runs, a request on this rank (``stop`` set: a signal, a program) is sent to
    the others through ``control`` (:meth:`~lamploop.control.ControlRoot.request_stop`), and a
    request from another rank sets ``stop`` here, with that rank's reason (``"SIGTERM"``).  A
    rank training on data that flows would learn it at the next step anyway (requests travel
    with the step's example count); one that waits for data learns it only this way, and its
    batch stream ends the wait (:mod:`lamploop.loop.stop_aware`).  ``control`` may be ``None``
    (one rank): then nothing is shared.

    Exceptions of the body pass through unwrapped (the relay's tasks never raise).
    """
    return _SharedStopRequests(stop, control)


class _SharedStopRequests:
    """The context manager of :func:`share_stop_requests`: two relay tasks beside the body."""

    def __init__(self, stop: StopRequest, control: ControlRoot | ControlFollower | None) -> None:
        self._stop = stop
        self._control = control
        self._relay: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> None:
        if self._control is None:
            return
        self._relay = anyio.create_task_group()
        await self._relay.__aenter__()
        self._relay.start_soon(_tell_the_others, self._stop, self._control)
        self._relay.start_soon(_hear_the_others, self._stop, self._control)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._relay is None:
            return
        self._relay.cancel_scope.cancel()
        if isinstance(exc, anyio.get_cancelled_exc_class()):  # an outer cancellation: the group re-raises it
            await self._relay.__aexit__(exc_type, exc, tb)
        else:  # the tasks never raise: the group ends cleanly, the body's exception propagates as it is
            await self._relay.__aexit__(None, None, None)


async def _tell_the_others(stop: StopRequest, control: ControlRoot | ControlFollower) -> None:
    while not stop.is_set():  # noqa: ASYNC110  (set from a signal handler or another thread)
        await anyio.sleep(_POLL_S)
    await control.request_stop(stop.reason)


async def _hear_the_others(stop: StopRequest, control: ControlRoot | ControlFollower) -> None:
    reason = await control.wait_for_stop_request()
    if not stop.is_set():
        logger.info("%s on another rank: stopping after the current step", reason)
        stop.request(reason)


def blocking(run: Callable[P, Awaitable[R]]) -> Callable[P, R]:
    """The blocking form of an async function, with its signature (for type checkers and IDEs).

    Outside an event loop it is ``anyio.run``.  Inside one (Jupyter runs cells inside its
    event loop, where ``anyio.run`` would fail with "Already running asyncio in this
    thread") it runs ``run`` on a thread of its own and waits; Ctrl-C while it waits asks
    the run to stop after the current step, a second Ctrl-C to stop at once.
    """

    @functools.wraps(run)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        job = functools.partial(run, *args, **kwargs)
        if not event_loop_running():
            return anyio.run(job)
        return _beside_the_loop(job)

    name = run.__name__.removesuffix("_async")
    call.__name__ = call.__qualname__ = name
    call.__doc__ = _blocking_doc(run.__doc__ or "", run.__name__)
    return call


def _blocking_doc(doc: str, async_name: str) -> str:
    """``doc`` with a paragraph after its summary line saying how the blocking form runs."""
    summary, _, rest = doc.partition("\n")
    note = (
        f"Blocking: runs :func:`{async_name}` in a new event loop, on a thread of its own when\n"
        "called inside one (as in a notebook)."
    )
    indent = next((line[: len(line) - len(line.lstrip())] for line in rest.splitlines() if line.strip()), "")
    paragraph = "\n".join(indent + line for line in note.splitlines())
    return f"{summary}\n\n{paragraph}\n{rest}" if rest else f"{summary}\n\n{paragraph}\n"


def _beside_the_loop(job: Callable[[], Awaitable[R]]) -> R:
    stop = StopRequest()

    def in_thread() -> R:
        _outer_stop.set(stop)  # this thread's context: anyio.run's tasks inherit it
        return anyio.run(job)

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lamploop-fit")
    with _ctrl_c_requests_stops(stop):
        try:
            result = pool.submit(in_thread)
            while True:
                try:
                    return result.result()
                except KeyboardInterrupt:  # SIGINT's handler is not ours (not the main thread)
                    _interrupted(stop)
        finally:
            # Only reached once the run has ended (result() returned or raised its error).
            pool.shutdown(wait=False)


def _interrupted(stop: StopRequest) -> None:
    if stop.is_set():
        stop.request_at_once()
        logger.info("interrupted again: stopping at once")
    else:
        stop.request("SIGINT")
        logger.info("interrupted: stopping after the current step (again to stop at once)")


@contextmanager
def _ctrl_c_requests_stops(stop: StopRequest) -> Iterator[None]:
    """While the main thread waits for the run, SIGINT requests a stop instead of raising.

    A ``KeyboardInterrupt`` can be raised at any bytecode: a second Ctrl-C arriving while the
    first one's was being handled, or one arriving outside the wait, would escape and leave
    the run going on its thread.  A handler of our own never raises.  Off the main thread
    (where no handler can be set) a ``KeyboardInterrupt`` is turned into a request instead.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: _interrupted(stop))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


async def reported_run(
    run: Awaitable[R], stop: StopRequest, emit: EventEmitter, at_once: anyio.CancelScope
) -> R:
    """Await the root's run inside :func:`stop_on_signals` (scope ``at_once``); report a stop or a failure.

    The run itself reports everything up to :class:`~lamploop.reporting.events.RunFinished`;
    how it ended otherwise is known here: a stop on request is a
    :class:`~lamploop.reporting.events.RunStopped` (also a stop at once, whose cancellation
    passes on to ``at_once``: see :func:`stopped_at_once`), anything else a
    :class:`~lamploop.reporting.events.RunFailed` (after a
    :class:`~lamploop.reporting.events.PeerLost` naming a lost rank).  The first error inside
    the task groups' exception groups is raised, with its own cause.

    Raises:
        TrainingInterrupted: stopped at the next step boundary.
        LamploopError: the run's first error.
    """
    try:
        return await run
    except anyio.get_cancelled_exc_class():
        if at_once.cancel_called:
            emit(RunStopped(stop.reason, stopped_at_once(stop).args[0]))
        raise
    except Exception as exc:
        error = _first_error(exc)
        if isinstance(error, TrainingInterrupted):  # a stop on request is no failure
            emit(RunStopped(error.reason, str(error)))
        else:
            if isinstance(error, PeerLostError) and error.rank is not None:
                emit(PeerLost(error.rank, error.how or "lost", str(error)))
            emit(RunFailed(f"{type(error).__name__}: {error}"))
        if error is exc:
            raise
        if error.__cause__ is not None:
            raise error from error.__cause__  # its own cause says more than the task groups' wrapping
        raise error from exc  # the task groups' wrapping, kept as the cause


def stopped_at_once(stop: StopRequest) -> TrainingInterrupted:
    """The error of a run that a second request stopped at once (:func:`stop_on_signals`' scope cancelled)."""
    msg = f"stopped at once by a second {stop.reason}: the work since the last checkpoint is lost"
    return TrainingInterrupted(msg, epoch=-1, steps_done=-1, reason=stop.reason)


async def stop_if_requested_before_training(stop: StopRequest, epoch: int) -> None:
    """Raise :class:`TrainingInterrupted` if a stop was requested before training started.

    Called inside :func:`stop_on_signals` once ``fit`` has checked its arguments and restored
    the checkpoint it resumes from, work that keeps this thread busy: a signal that came
    meanwhile waits in the event loop's wake-up socket.  The loop is first given a few turns
    to hand it to the watcher (reading the socket, running the handler, waking the watcher).

    Raises:
        TrainingInterrupted: a stop was requested (nothing was written).
    """
    for _ in range(SIGNAL_TURNS):
        await anyio.lowlevel.checkpoint()
    if stop.is_set():
        msg = (
            f"stopped by {stop.reason} before training started (while fit checked its arguments "
            "and restored its checkpoint): nothing was written, a checkpoint resumed from is untouched"
        )
        raise TrainingInterrupted(msg, epoch=epoch, steps_done=0, reason=stop.reason)


def _first_error(exc: BaseException) -> BaseException:
    """The first error inside the exception groups that task groups wrap errors in (cancellations skipped).

    An error that every rank detects itself (a NaN loss...) comes first: what it causes
    elsewhere (a follower's abort, its process exiting with status 1) only follows from it.
    """
    own = error_detected_by_every_rank(exc)
    if own is not None:
        return own
    inner = getattr(exc, "exceptions", None)
    if not isinstance(inner, tuple):
        return exc
    leaves = [_first_error(e) for e in inner]
    errors = [e for e in leaves if not isinstance(e, anyio.get_cancelled_exc_class())]
    return errors[0] if errors else exc
