"""Failure bookkeeping of a protocol's end: background failures surface where the owner waits.

The control root and follower, the sample receiver and the producer run their connections
in a :class:`Supervisor`'s task group.  The tasks never raise: they report a
:class:`~lamploop.errors.TransportError` to :meth:`Supervisor.fail`, and the supervisor
decides where it surfaces (see the class).

On the control channel, a peer that failed with an error every rank detects itself (a NaN loss...: see
:mod:`lamploop.errors`) says so in its Abort.  Its failure is then *expected alike*: the
owner's body is given :data:`OWN_VERDICT_GRACE_S` to end with its own error, which wins over
the peer's abort (:meth:`Supervisor.close` raises the body's own error); only if the body is
still running then, or asks the channel for more (a method inside :meth:`Supervisor.waiting`),
does the peer's abort surface as usual.

.. versionadded:: 0.3
   moved here from the control channel's private modules; the Abort a control channel's
   end sends is made by :func:`lamploop.control.connection.abort_message`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import anyio
import anyio.abc

from lamploop.errors import TransportError, error_detected_by_every_rank, failure_reason, shortened

__all__ = ["OWN_VERDICT_GRACE_S", "Supervisor"]

logger = logging.getLogger("lamploop.control")

OWN_VERDICT_GRACE_S = 5.0
"""Seconds the owner's body may take to fail by itself with the error that a peer failed with
and that every rank detects (the ranks learn it from the same numbers, so it comes at once
unless this rank is starved of CPU); after that the peer's abort is raised."""


class Supervisor:
    """A task group whose tasks report failures here instead of raising them.

    The first failure wins.  If the owner is waiting in one of the channel's methods
    (inside :meth:`waiting`) that method raises it; otherwise the owner's ``async with``
    body -- and only the body: the background tasks still have last words to say -- is
    cancelled, and :meth:`close` raises the failure.  A failure *expected alike* (a peer
    failed with an error every rank detects itself, see the module) waits up to
    :data:`OWN_VERDICT_GRACE_S` for the body to end with its own error first.

    Args:
        on_failure: called once, on the first failure, to wake up whatever the owner waits on.
    """

    def __init__(self, on_failure: Callable[[], None]) -> None:
        self.failure: TransportError | None = None
        self.failure_alike = False  # the failure is a peer's error that this side detects too
        self._tg: anyio.abc.TaskGroup | None = None
        self._body: anyio.CancelScope | None = None
        self._body_left = False
        self._pending = False  # a failure expected alike, not yet raised or acted upon
        self._waiting = 0
        self._on_failure = on_failure

    @property
    def tg(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            msg = "use the control channel inside `async with`"
            raise TransportError(msg)
        return self._tg

    def require_inside(self, what: str) -> None:
        """Raise unless the owner's ``async with`` block runs: ``what`` would wait for ever."""
        if self._tg is None or self._body_left:
            state = "after its block ended" if self._body_left else "before `async with`"
            msg = f"{what} {state}: use the control channel inside `async with`"
            raise TransportError(msg)

    async def enter(self) -> None:
        """Start the task group, then a cancel scope around the owner's body (left in :meth:`leave_body`)."""
        if self._tg is not None:
            msg = "a control channel can be entered only once"
            raise TransportError(msg)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._body = anyio.CancelScope()
        self._body.__enter__()

    def fail(self, error: TransportError, *, alike: bool = False) -> None:
        """Record ``error``; the first one wins.

        ``alike``: a peer failed with an error that every rank detects itself (its Abort says
        so), so the owner's body, unless waiting in the channel, gets :data:`OWN_VERDICT_GRACE_S`
        to fail with its own error before it is cancelled.
        """
        if self.failure is not None:
            logger.debug("after the first failure, also: %s", error)
            return
        self.failure = error
        self.failure_alike = alike
        if alike and self._waiting == 0 and self._body is not None and not self._body_left:
            self._pending = True
            self.tg.start_soon(self._act_after_grace)
            return
        self._act()

    def _act(self) -> None:
        """Make the failure surface: wake up the channel's waits, or cancel the owner's body."""
        self._pending = False
        self._on_failure()
        if self._waiting == 0 and self._body is not None:
            self._body.cancel()

    async def _act_after_grace(self) -> None:
        await anyio.sleep(OWN_VERDICT_GRACE_S)
        if self._pending and not self._body_left:
            logger.debug("no error of our own within %g s; raising: %s", OWN_VERDICT_GRACE_S, self.failure)
            self._act()

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Mark the owner as waiting in a channel method, which raises failures itself.

        Entering it with a failure expected alike still pending raises that failure: the owner
        went on without failing itself.
        """
        if self._pending and self.failure is not None:
            self._pending = False
            self._on_failure()
            raise self.failure
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    def describe_exit(self, exc: BaseException | None, who: str) -> str:
        """Why the ``who`` leaves, for the Abort sent to its peers; ``exc`` is from :meth:`leave_body`."""
        own = error_detected_by_every_rank(exc)
        if own is not None:  # this side's own verdict, which every rank reaches too
            return failure_reason(who, own)
        if self.failure is not None:
            return shortened(str(self.failure))
        if exc is None:
            return f"the {who} closed the channel before Stop"
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            return f"the {who} was cancelled"
        return failure_reason(who, exc)

    def leave_body(self, exc: BaseException | None) -> BaseException | None:
        """Leave the body's scope; the exception still in flight (``None`` if it was our cancellation)."""
        if self._body is None:
            msg = "the control channel was not entered"
            raise TransportError(msg)
        self._body_left = True
        self._pending = False
        if self._body.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None):
            return None
        return exc

    async def close(self, exc: BaseException | None, *, swallowed: bool) -> bool:
        """Stop every task; raise the recorded failure unless the body's own exception explains more.

        ``exc`` is what :meth:`leave_body` returned; ``swallowed`` says whether it swallowed
        the body's cancellation (then this returns ``True`` or raises the failure).
        """
        tg = self.tg
        tg.cancel_scope.cancel()
        if exc is not None and isinstance(exc, anyio.get_cancelled_exc_class()):
            # An outer cancellation: the task group re-raises it.
            await tg.__aexit__(type(exc), exc, exc.__traceback__)
        else:
            # The tasks never raise, so the group ends cleanly and the body's exception propagates unwrapped.
            await tg.__aexit__(None, None, None)
        if self.failure is not None and exc is not self.failure:
            if exc is None:
                raise self.failure
            if self.failure_alike and error_detected_by_every_rank(exc) is not None:
                logger.debug("a peer failed alike: %s", self.failure)  # the block's own error says it
            else:
                logger.warning(
                    "control channel failure while the block ended with an error: %s", self.failure
                )
        return swallowed and exc is None
