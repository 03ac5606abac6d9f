"""The in-process control channel: every rank is a task in one event loop.

For one process that drives several devices (``local_data_parallel_training_loop``)
and for tests.  Commands travel through anyio memory object streams, one per
follower; nothing runs in the background, there is no handshake (the ranks share the
same objects) and no heartbeat (a rank cannot go silent without its task ending).

Usage::

    root, followers = local_control(3)          # followers are ranks 1 and 2

    async def follow(follower):
        async with follower:
            rendezvous, commands = await follower.join()
            async for command in commands:      # ends after Stop
                ...

    async with root:                            # in the root's task
        await root.on_rendezvous_ready(Rendezvous("127.0.0.1", store_port))
        await root.broadcast(Train(epoch=0, lr_factor=1.0))
        await root.broadcast(Stop("done"))

The ``async with`` blocks are optional but recommended: leaving a root block without
having broadcast :class:`Stop` makes every follower's iterator raise
:class:`PeerLostError` with the reason, and leaving a follower block before ``Stop``
makes the root's next :meth:`~LocalControlRoot.broadcast` raise it, naming the rank.
``aclose()`` does the same without a block.  All ranks must run in the same event
loop (the objects are not thread-safe).

.. versionadded:: 0.1
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from lamploop.control.commands import Command, Rendezvous, Stop, check_command
from lamploop.errors import (
    ConfigurationError,
    ControlChannelError,
    HandshakeError,
    PeerLostError,
    error_detected_by_every_rank,
    failure_reason,
)

__all__ = ["MAX_UNREAD_COMMANDS", "LocalControlFollower", "LocalControlRoot", "local_control"]

MAX_UNREAD_COMMANDS = 1024
"""A follower this many commands behind makes :meth:`LocalControlRoot.broadcast` fail."""


@attrs.frozen
class _Aborted:
    """Queued to the followers when the root leaves without Stop; names the lost rank if one was."""

    reason: str
    lost_rank: int = 0
    how: str = "aborted"


def _lost_rank(exc: BaseException | None, own_rank: int) -> tuple[int, str] | None:
    """The rank (and how) that ``exc`` blames, when it is a PeerLostError naming another rank."""
    if isinstance(exc, PeerLostError) and exc.rank is not None and exc.rank != own_rank:
        return exc.rank, exc.how or "aborted"
    return None


def _close_streams(streams: list[MemoryObjectSendStream[Any] | MemoryObjectReceiveStream[Any]]) -> None:
    for stream in streams:
        stream.close()


def _every_rank(exc: BaseException | None) -> bool:
    """Whether ``exc`` is an error every rank detects itself (its peers raise their own)."""
    return error_detected_by_every_rank(exc) is not None


def _how_left(exc: BaseException | None) -> str:
    return "closed" if exc is None or isinstance(exc, anyio.get_cancelled_exc_class()) else "aborted"


def _describe_exit(exc: BaseException | None, what: str) -> str:
    if exc is None:
        return f"the {what} closed the channel before Stop"
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return f"the {what} was cancelled"
    return failure_reason(what, exc)


class _Hub:
    """State shared by the root and the followers of one local channel."""

    def __init__(self, nranks: int, join_timeout: float) -> None:
        self.nranks = nranks
        self.join_timeout = join_timeout
        self.joined: set[int] = set()
        self.all_joined = anyio.Event()
        self.rendezvous: Rendezvous | None = None
        self.root_left: str | None = None
        self.rendezvous_or_root_left = anyio.Event()
        self.gone: dict[int, tuple[str, str]] = {}  # rank -> (why, how) it left before Stop
        # A rank that left before Stop with an error the others do not detect themselves: set
        # for the ranks' wait_for_abort (a rank blocked in a collective reads no command).
        self.follower_aborted = anyio.Event()
        self.aborted_rank = 0  # the first follower that set follower_aborted
        self.first_follower_failure: BaseException | None = None  # what its abort_run was given
        self.root_failure: BaseException | None = None  # what the root's abort_run was given
        self.root_aborted: _Aborted | None = None
        self.root_aborted_event = anyio.Event()
        self.finished = False  # the root broadcast Stop
        self.stop_reason: str | None = None  # the first rank's request to stop every rank
        self.stop_requested = anyio.Event()
        self.sends: dict[int, MemoryObjectSendStream[Command | _Aborted]] = {}
        self.receives: dict[int, MemoryObjectReceiveStream[Command | _Aborted]] = {}
        for rank in range(1, nranks):
            send, receive = anyio.create_memory_object_stream[Command | _Aborted](MAX_UNREAD_COMMANDS)
            self.sends[rank] = send
            self.receives[rank] = receive
        # A channel never entered (a driver refused its arguments first) closes its streams when
        # it is collected, instead of each warning that it was left open.
        closing = weakref.finalize(self, _close_streams, [*self.sends.values(), *self.receives.values()])
        closing.atexit = False  # not at exit: a second Ctrl-C there printed a traceback (CI run 23)
        if nranks == 1:
            self.all_joined.set()

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None and not self.finished:
            self.stop_reason = reason
            self.stop_requested.set()

    async def wait_for_stop_request(self) -> str:
        await self.stop_requested.wait()
        return self.stop_reason or ""


def local_control(
    nranks: int, *, join_timeout: float = 60.0
) -> tuple[LocalControlRoot, list[LocalControlFollower]]:
    """A connected root and its ``nranks - 1`` followers (ranks ``1..nranks-1``, in order).

    Args:
        nranks: the world size, root included (at least 1).
        join_timeout: seconds :meth:`LocalControlRoot.on_rendezvous_ready` waits for every
            follower to call :meth:`~LocalControlFollower.join`, and a follower waits for the
            rendezvous.

    Raises:
        ConfigurationError: ``nranks < 1`` or ``join_timeout`` not positive.
    """
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
        msg = f"nranks must be an integer >= 1, got {nranks!r}"
        raise ConfigurationError(msg)
    if not join_timeout > 0:
        msg = f"join_timeout must be positive, got {join_timeout!r}"
        raise ConfigurationError(msg)
    hub = _Hub(nranks, join_timeout)
    return LocalControlRoot(hub), [LocalControlFollower(hub, rank) for rank in range(1, nranks)]


class LocalControlRoot:
    """The root's end of an in-process channel; made by :func:`local_control`.

    Implements :class:`~lamploop.control.ControlRoot`.
    """

    def __init__(self, hub: _Hub) -> None:
        self._hub = hub
        self._rendezvous_sent = False
        self._stopped = False
        self._closed = False

    @property
    def nranks(self) -> int:
        """The world size this channel was made for, root included."""
        return self._hub.nranks

    @property
    def first_follower_failure(self) -> BaseException | None:
        """The error the first follower that failed gave its ``abort_run``, as it was raised there.

        The ranks share one process: :func:`~lamploop.distributed.local_data_parallel_training_loop`
        raises this rather than the root's :class:`PeerLostError` quoting it, should the
        follower's own unwinding be cancelled before its error reached the caller.
        """
        return self._hub.first_follower_failure

    @property
    def root_failure(self) -> BaseException | None:
        """The error the root gave its ``abort_run``, as it was raised there.

        Like :attr:`first_follower_failure`, for the root: a follower told of it may end
        first, and the root's own unwinding then be cancelled before its error reached the
        caller (:func:`~lamploop.distributed.local_data_parallel_training_loop` raised the
        follower's ``PeerLostError`` quoting it, 9 times in 200 here).
        """
        return self._hub.root_failure

    async def __aenter__(self) -> LocalControlRoot:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close(_describe_exit(exc, "root"), _lost_rank(exc, 0), every_rank=_every_rank(exc))

    async def aclose(self) -> None:
        """Close the channel; followers that have not received :class:`Stop` see the run aborted."""
        self._close(_describe_exit(None, "root"), None)

    async def abort_run(self, error: BaseException) -> None:
        """Tell every follower now that the run failed with ``error``, as leaving the channel with it would.

        :func:`~lamploop.drive_distributed_training` calls this when its run fails, so that
        a root that stays in the channel after the failure (every rank a task of this
        process, inside the root's ``async with``) holds nobody.  Leaving later adds nothing.
        """
        if self._hub.root_failure is None:
            self._hub.root_failure = error
        self._close(_describe_exit(error, "root"), _lost_rank(error, 0), every_rank=_every_rank(error))

    async def wait_for_abort(self) -> PeerLostError:
        """Wait until a follower left the run before :class:`Stop` (failed, closed or cancelled); that loss.

        :func:`~lamploop.drive_distributed_training` watches this beside its epochs: a root
        blocked in a collective reads no channel, and an in-process follower that failed
        holds no connection whose end the collective would see.  A follower's error that
        every rank detects itself (:func:`lamploop.errors.error_detected_by_every_rank`) does
        not count: the root raises its own.
        """
        hub = self._hub
        await hub.follower_aborted.wait()
        rank = hub.aborted_rank
        reason, how = hub.gone[rank]
        return PeerLostError(f"rank {rank} is gone: {reason}", rank=rank, how=how)

    def _close(self, reason: str, lost: tuple[int, str] | None, *, every_rank: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        hub = self._hub
        if not self._stopped:
            hub.root_left = reason
            hub.rendezvous_or_root_left.set()
            aborted = _Aborted(reason, *lost) if lost else _Aborted(reason)
            if not every_rank:
                hub.root_aborted = aborted
                hub.root_aborted_event.set()
            for rank, send in hub.sends.items():
                if rank not in hub.gone:
                    # A follower that is gone or hopelessly behind only gets the closed stream.
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.WouldBlock):
                        send.send_nowait(aborted)
        for send in hub.sends.values():
            send.close()
        for rank, receive in hub.receives.items():
            if rank not in hub.joined:  # nobody will read those
                receive.close()

    async def on_rendezvous_ready(self, rendezvous: Rendezvous) -> None:
        """Wait until every follower has joined, then hand them ``rendezvous``.

        Raises:
            HandshakeError: not every follower joined within the join timeout (names the
                missing ranks).
            ControlChannelError: the root is closed or the rendezvous was already sent.
        """
        self._check_open("on_rendezvous_ready()")
        if self._rendezvous_sent:
            msg = "on_rendezvous_ready() was already called"
            raise ControlChannelError(msg)
        hub = self._hub
        with anyio.move_on_after(hub.join_timeout):
            await hub.all_joined.wait()
        if not hub.all_joined.is_set():
            missing = sorted(set(range(1, hub.nranks)) - hub.joined)
            msg = (
                f"only ranks {sorted(hub.joined)} of 1..{hub.nranks - 1} joined within "
                f"{hub.join_timeout:g} s; missing ranks {missing}"
            )
            raise HandshakeError(msg)
        self._rendezvous_sent = True
        hub.rendezvous = rendezvous
        hub.rendezvous_or_root_left.set()

    def peers(self) -> tuple[int, ...]:
        """The ranks of the followers that have joined so far, sorted."""
        return tuple(sorted(self._hub.joined))

    async def broadcast(self, command: Command) -> None:
        """Queue ``command`` to every follower; never blocks.

        Raises:
            PeerLostError: a follower left before :class:`Stop` (names the rank and why);
                nothing is sent then.
            ControlChannelError: called before :meth:`on_rendezvous_ready`, after ``Stop``
                or after closing, or a follower has :data:`MAX_UNREAD_COMMANDS` unread commands.
            TypeError: ``command`` is not a Train, Valid or Stop (as over TCP).
        """
        check_command(command)
        self._check_open("broadcast()")
        if not self._rendezvous_sent:
            msg = "broadcast() before on_rendezvous_ready(): the followers have not all joined"
            raise ControlChannelError(msg)
        if self._stopped:
            msg = f"broadcast({command!r}) after Stop: the channel is finished"
            raise ControlChannelError(msg)
        hub = self._hub
        for rank, (reason, how) in sorted(hub.gone.items()):
            msg = f"rank {rank} is gone: {reason}"
            raise PeerLostError(msg, rank=rank, how=how)
        for rank, send in hub.sends.items():
            try:
                send.send_nowait(command)
            except anyio.BrokenResourceError as exc:
                msg = f"rank {rank} is gone: it closed its end of the channel"
                raise PeerLostError(msg, rank=rank, how="closed") from exc
            except anyio.WouldBlock as exc:
                msg = f"rank {rank} has {MAX_UNREAD_COMMANDS} unread commands: is it reading them?"
                raise ControlChannelError(msg) from exc
        await anyio.lowlevel.checkpoint()
        if isinstance(command, Stop):
            self._stopped = True
            hub.finished = True
            for send in hub.sends.values():
                send.close()

    async def request_stop(self, reason: str) -> None:
        """Ask every rank to stop after the step in progress (see :meth:`ControlRoot.request_stop`)."""
        self._hub.request_stop(reason)
        await anyio.lowlevel.checkpoint()

    async def wait_for_stop_request(self) -> str:
        """Wait until a rank asked every rank to stop; its reason."""
        return await self._hub.wait_for_stop_request()

    def _check_open(self, what: str) -> None:
        if self._closed:
            msg = f"{what} on a closed control root"
            raise ControlChannelError(msg)


class LocalControlFollower:
    """A follower's end of an in-process channel; made by :func:`local_control`.

    Implements :class:`~lamploop.control.ControlFollower`.
    """

    def __init__(self, hub: _Hub, rank: int) -> None:
        self._hub = hub
        self.rank = rank
        self._joined = False
        self._commands = _LocalCommands(hub.receives[rank], rank)

    @property
    def nranks(self) -> int:
        """The world size this channel was made for, root included."""
        return self._hub.nranks

    async def __aenter__(self) -> LocalControlFollower:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close(_describe_exit(exc, f"follower of rank {self.rank}"), _how_left(exc), _every_rank(exc))

    async def aclose(self) -> None:
        """Leave the channel; the root's next broadcast fails unless :class:`Stop` was received."""
        self._close(_describe_exit(None, f"follower of rank {self.rank}"), "closed")

    async def abort_run(self, error: BaseException) -> None:
        """Tell the root now that this rank failed with ``error``, as leaving the channel with it would.

        :func:`~lamploop.follow_distributed_training` calls this when its run fails.  Leaving
        later adds nothing.
        """
        who = f"follower of rank {self.rank}"
        if self._hub.first_follower_failure is None:
            self._hub.first_follower_failure = error
        self._close(_describe_exit(error, who), _how_left(error), _every_rank(error))

    async def wait_for_abort(self) -> PeerLostError:
        """Wait until the root left the run before :class:`Stop` (failed, closed or cancelled); that loss.

        :func:`~lamploop.follow_distributed_training` watches this beside its commands: a
        follower blocked in a collective reads no command.  An error that every rank detects
        itself does not count: the follower raises its own.
        """
        hub = self._hub
        await hub.root_aborted_event.wait()
        aborted = hub.root_aborted
        assert aborted is not None  # set before the event
        return PeerLostError(f"rank {self.rank}: {aborted.reason}", rank=aborted.lost_rank, how=aborted.how)

    def _close(self, reason: str, how: str, every_rank: bool = False) -> None:
        hub = self._hub
        if not self._commands.stopped and self.rank not in hub.gone:
            hub.gone[self.rank] = (reason, how)
            if not every_rank and not hub.follower_aborted.is_set():
                hub.aborted_rank = self.rank
                hub.follower_aborted.set()
        self._commands.close()

    async def join(self) -> tuple[Rendezvous, AsyncIterator[Command]]:
        """Join the root and wait for its rendezvous.

        Raises:
            ControlChannelError: joined twice, or the root sent no rendezvous within the
                join timeout.
            PeerLostError: the root left before sending the rendezvous.
        """
        if self._joined:
            msg = f"rank {self.rank} already joined"
            raise ControlChannelError(msg)
        self._joined = True
        hub = self._hub
        hub.joined.add(self.rank)
        if len(hub.joined) == hub.nranks - 1:
            hub.all_joined.set()
        with anyio.move_on_after(hub.join_timeout):
            await hub.rendezvous_or_root_left.wait()
        if hub.rendezvous is not None:
            return hub.rendezvous, self._commands
        if hub.root_left is not None:
            msg = f"rank {self.rank}: {hub.root_left} (before sending the rendezvous)"
            raise PeerLostError(msg, rank=0, how="closed")
        msg = f"rank {self.rank}: the root sent no rendezvous within {hub.join_timeout:g} s"
        raise ControlChannelError(msg)

    async def request_stop(self, reason: str) -> None:
        """Ask every rank to stop after the step in progress (see :meth:`ControlFollower.request_stop`)."""
        self._hub.request_stop(reason)
        await anyio.lowlevel.checkpoint()

    async def wait_for_stop_request(self) -> str:
        """Wait until a rank asked every rank to stop; its reason."""
        return await self._hub.wait_for_stop_request()


class _LocalCommands(AsyncIterator[Command]):
    """The commands of one follower; ends after :class:`Stop`."""

    def __init__(self, receive: MemoryObjectReceiveStream[Command | _Aborted], rank: int) -> None:
        self._receive = receive
        self._rank = rank
        self.stopped = False

    def close(self) -> None:
        self._receive.close()

    async def __anext__(self) -> Command:
        if self.stopped:
            raise StopAsyncIteration
        try:
            item = await self._receive.receive()
        except anyio.EndOfStream as exc:
            msg = f"rank {self._rank}: the root closed the channel before Stop"
            raise PeerLostError(msg, rank=0, how="closed") from exc
        except anyio.ClosedResourceError as exc:
            msg = f"rank {self._rank}: commands read after the follower was closed"
            raise ControlChannelError(msg) from exc
        if isinstance(item, _Aborted):
            msg = f"rank {self._rank}: {item.reason}"
            raise PeerLostError(msg, rank=item.lost_rank, how=item.how)
        if isinstance(item, Stop):
            self.stopped = True
        return item
