"""A follower's end of the TCP control channel: reach the root, join, and hand out its commands.

:class:`TcpControlFollower` connects with backoff (followers may start before the root
listens), runs the follower's side of :mod:`lamploop.control.handshake`, keeps a heartbeat
with the root, and queues the root's commands for the owner's iterator (at most
:data:`MAX_UNREAD_COMMANDS` unread).  How its failures surface is
:mod:`lamploop.transport.supervisor`'s business; the protocol as a whole is described in
:mod:`lamploop.control.tcp`.

.. versionadded:: 0.1
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator
from types import TracebackType

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from lamploop.control.commands import Command, Rendezvous, Stop, Train, Valid
from lamploop.control.connection import Connection, Gone, abort_message
from lamploop.control.handshake import HungUpBeforeChallenge, greet_root
from lamploop.control.root_admission import RUN_FINISHED
from lamploop.control.settings import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TIMEOUT_S, Link, Run
from lamploop.control.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Heartbeat,
    Interrupt,
    preauth_frame_limit,
)
from lamploop.errors import ControlChannelError, FrameError, HandshakeError, PeerLostError
from lamploop.modelspec import ModelSpec
from lamploop.transport import tls
from lamploop.transport.connection import GOODBYE_TIMEOUT
from lamploop.transport.settings import check_int_in, check_seconds_each
from lamploop.transport.supervisor import Supervisor

__all__ = ["MAX_UNREAD_COMMANDS", "TcpControlFollower"]

logger = logging.getLogger("lamploop.control")

MAX_UNREAD_COMMANDS = 1024
"""A follower this many commands behind fails with :class:`ControlChannelError`."""

HANGUPS_BEFORE_CHALLENGE_TRIED = 3
"""Connections that end before the root's challenge a follower tries past, within its connect
timeout: a root ending its run hangs up once on a connection queued on its listener."""


class TcpControlFollower:
    """A follower's end of the TCP control channel; implements :class:`~lamploop.control.ControlFollower`.

    ``async with TcpControlFollower(...) as follower:`` then ``await follower.join()``
    connects to the root at ``host:port``, retrying with exponential backoff (0.05 s
    doubling to 1 s) for up to ``connect_timeout`` seconds, so followers may start
    before the root listens.

    Args:
        host, port: the root's :attr:`TcpControlRoot.address`.
        rank: this follower's rank, ``1..nranks-1``.
        nranks, token: as given to the root.
        model_spec: this rank's model spec; the root refuses it unless it equals its own.
        connect_timeout: seconds to keep trying to reach the root.
        heartbeat_interval, heartbeat_timeout: as for the root; the root is lost when silent
            past the timeout.
        handshake_timeout: seconds the root may take to answer, once connected.
        max_frame_bytes: the largest frame body sent or accepted.
        ssl_context: TLS for this connection: a client context
            (``ssl.create_default_context(cafile=...)``) that trusts the root's certificate;
            the root's ``host`` is checked against it.  ``None`` (default): no TLS.

    Raises:
        ConfigurationError: an argument is out of range.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        nranks: int,
        token: bytes | str,
        model_spec: ModelSpec,
        connect_timeout: float = 60.0,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        handshake_timeout: float = 10.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        ssl_context: ssl.SSLContext | None = None,
        _protocol_version: int = PROTOCOL_VERSION,
    ) -> None:
        self._run = Run.checked(nranks, token, model_spec)
        self._link = Link.checked(heartbeat_interval, heartbeat_timeout, max_frame_bytes)
        check_seconds_each(connect_timeout=connect_timeout, handshake_timeout=handshake_timeout)
        check_int_in("port", port, 1, 65535)
        check_int_in("rank", rank, 1, nranks - 1)
        self.rank = rank
        self._host = host
        self._port = port
        self._root = f"the root at {host}:{port}"
        self._connect_timeout = connect_timeout
        self._handshake_timeout = handshake_timeout
        self._protocol_version = _protocol_version
        self._tls = tls.check_context("ssl_context", ssl_context, server_side=False)
        self._sup = Supervisor(on_failure=self._wake_up)
        self._conn: Connection | None = None
        self._join_called = False
        self._hangups = 0
        self._rendezvous: Rendezvous | None = None
        self._rendezvous_or_failed = anyio.Event()
        self._drained = anyio.Event()
        self._stop_reason: str | None = None  # the first rank's request to stop every rank
        self._stop_requested = anyio.Event()
        self._stop_told = False  # this follower's own request went to the root
        self._send_commands: MemoryObjectSendStream[Command]  # made on entering, closed on leaving
        self._commands: _TcpCommands

    @property
    def nranks(self) -> int:
        """The world size this channel was made for, root included."""
        return self._run.nranks

    async def __aenter__(self) -> TcpControlFollower:
        await self._sup.enter()
        self._send_commands, receive = anyio.create_memory_object_stream[Command](MAX_UNREAD_COMMANDS)
        self._commands = _TcpCommands(receive, self._sup)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        conn = self._conn
        remaining = self._sup.leave_body(exc)
        try:
            if conn is not None and conn.rank is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(GOODBYE_TIMEOUT):
                    if not conn.finished:  # leaving before Stop: tell the root why
                        await self._say_abort(conn, remaining)
                    await self._drained.wait()  # read until the root closes, so nothing is lost to a reset
            return await self._sup.close(remaining, swallowed=exc is not None and remaining is None)
        finally:
            self._send_commands.close()
            self._commands.close()
            if conn is not None:
                await conn.aclose()

    async def abort_run(self, error: BaseException) -> None:
        """Tell the root now that this rank failed with ``error``, as leaving the channel with it would.

        :func:`~lamploop.follow_distributed_training` calls this when its run fails, so that
        a follower that stays in the channel after the failure holds nobody.  Leaving later
        sends nothing more.  Does nothing before joining, after :class:`Stop` or a first call.
        """
        conn = self._conn
        if conn is None or conn.rank is None or conn.finished:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(GOODBYE_TIMEOUT):
            await self._say_abort(conn, error)

    async def _say_abort(self, conn: Connection, error: BaseException | None) -> None:
        conn.finished = True
        who = f"follower of rank {self.rank}"
        await conn.send_best_effort(abort_message(self._sup, error, who, own_rank=self.rank))
        await conn.send_eof()

    def _wake_up(self) -> None:
        self._rendezvous_or_failed.set()
        self._send_commands.close()

    async def join(self) -> tuple[Rendezvous, AsyncIterator[Command]]:
        """Connect, authenticate both ways, and wait for the root's rendezvous.

        Waiting for the rendezvous is bounded by the root's join timeout (after which the
        root aborts the run) and by the heartbeat timeout (if the root goes silent).

        Raises:
            HandshakeError: the root refused this follower (carries the root's reason), or the
                root did not prove the shared token.
            ControlChannelError: the root was not reachable within ``connect_timeout``, did
                not answer within ``handshake_timeout``, or does not speak this protocol;
                also when called twice or outside ``async with``.
            PeerLostError: the root went silent, disconnected or aborted before the rendezvous.
        """
        tg = self._sup.tg
        if self._join_called:
            msg = f"rank {self.rank} already called join()"
            raise ControlChannelError(msg)
        self._join_called = True  # before the first await: a concurrent second call is refused too
        deadline = anyio.current_time() + self._connect_timeout
        conn = await self._connect_and_greet(deadline)
        while conn is None:  # the previous run's root, still ending: until this run's root listens
            await anyio.sleep(min(0.05, max(deadline - anyio.current_time(), 0.0)))
            conn = await self._connect_and_greet(deadline)
        self._conn = conn
        conn.rank = 0
        logger.info("rank %d joined %s", self.rank, self._root)
        tg.start_soon(conn.heartbeat_forever, self._on_heartbeat_error)
        tg.start_soon(self._read_root, conn)
        if self._stop_reason is not None:  # a stop was requested here before joining
            self._tell_root(self._stop_reason)
        with self._sup.waiting():
            await self._rendezvous_or_failed.wait()
        self._sup.raise_failure()
        if self._rendezvous is None:  # the event is set only by the rendezvous or a failure
            msg = f"rank {self.rank}: woken up without a rendezvous"
            raise ControlChannelError(msg)
        return self._rendezvous, self._commands

    async def _secure(self, stream: anyio.abc.ByteStream, context: ssl.SSLContext) -> anyio.abc.ByteStream:
        try:
            return await tls.wrap(stream, context, server_side=False, hostname=self._host)
        except ControlChannelError as exc:
            await anyio.aclose_forcefully(stream)
            question = f"is {self._root} a lamploop root with TLS, and is its certificate trusted?"
            msg = f"rank {self.rank}: {exc} ({question})"
            raise HandshakeError(msg) from exc

    async def _connect_and_greet(self, deadline: float) -> Connection | None:
        """A connection to the root, greeted; ``None`` when the root's run was finished
        (:data:`~lamploop.control.root_admission.RUN_FINISHED`) or the connection ended before
        the root's challenge, and ``deadline`` is not past."""
        stream: anyio.abc.ByteStream = await self._connect(deadline)
        preauth = preauth_frame_limit(self._run.nranks, self._run.model_spec, self._link.max_frame_bytes)
        conn = Connection(stream, peer=self._root, link=self._link, preauth_frame_bytes=preauth)
        greeted = False
        try:
            with anyio.fail_after(self._handshake_timeout):
                if self._tls is not None:
                    conn.stream = await self._secure(stream, self._tls)
                await greet_root(conn, self._run, rank=self.rank, protocol_version=self._protocol_version)
            greeted = True
        except TimeoutError as exc:
            timeout = self._handshake_timeout
            msg = f"rank {self.rank}: {self._root} did not finish the handshake in {timeout:g} s"
            raise ControlChannelError(msg) from exc
        except HandshakeError as exc:
            if RUN_FINISHED in str(exc) and anyio.current_time() < deadline:
                logger.debug("rank %d: %s ends its run; waiting for the next", self.rank, self._root)
                return None
            raise
        except FrameError as exc:  # the root's answer is no frame of this protocol
            msg = f"rank {self.rank}: {self._root} answered the handshake with a bad frame: {exc}"
            raise ControlChannelError(msg) from exc
        except HungUpBeforeChallenge as exc:
            # A previous run's root closing its listener (with this connection queued on it),
            # as a process running fit again at once meets: the next root comes on the same port,
            # refusing connections meanwhile.  What hangs up on every try (a TLS root, another
            # service) is named after a few.
            self._hangups += 1
            if self._hangups < HANGUPS_BEFORE_CHALLENGE_TRIED and anyio.current_time() < deadline:
                logger.debug("rank %d: %s; trying again", self.rank, exc)
                return None
            raise
        finally:
            if not greeted:  # whatever ended the handshake: this connection is done with
                with anyio.CancelScope(shield=True):
                    await conn.aclose()
        return conn

    async def _connect(self, deadline: float) -> anyio.abc.SocketStream:
        delay = 0.05
        attempts = 0
        while True:
            attempts += 1
            try:
                with anyio.fail_after(max(deadline - anyio.current_time(), 0.001)):
                    return await anyio.connect_tcp(self._host, self._port)
            except OSError as exc:  # includes TimeoutError and refused connections
                error = exc
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                msg = (
                    f"rank {self.rank} could not reach {self._root} within {self._connect_timeout:g} s "
                    f"({attempts} attempts; last error: {type(error).__name__}: {error})"
                )
                raise ControlChannelError(msg) from error
            logger.debug("rank %d: %s not reachable yet (%s); retrying", self.rank, self._root, error)
            await anyio.sleep(min(delay, remaining))
            delay = min(delay * 2, 1.0)

    async def request_stop(self, reason: str) -> None:
        """Ask every rank to stop after the step in progress (see :meth:`ControlFollower.request_stop`).

        The root passes it on to the other followers.  Only the first request counts; the
        send runs in the background (once joined): this returns at once and raises nothing.
        """
        if self._stop_reason is None:
            self._stop_reason = reason
            self._stop_requested.set()
            conn = self._conn
            if conn is not None and conn.rank is not None:
                self._tell_root(reason)
        await anyio.lowlevel.checkpoint()

    async def wait_for_stop_request(self) -> str:
        """Wait until a rank (this one, the root or another follower) asked every rank to stop; its reason."""
        if not self._stop_requested.is_set():  # outside the block no request could ever come
            self._sup.require_inside("wait_for_stop_request()")
        await self._stop_requested.wait()
        return self._stop_reason or ""

    def _tell_root(self, reason: str) -> None:
        if not self._stop_told:
            self._stop_told = True
            self._sup.tg.start_soon(self._send_interrupt, reason)

    async def _send_interrupt(self, reason: str) -> None:
        conn = self._conn
        if conn is None or conn.finished:
            return
        try:
            await conn.send(Interrupt(reason), unless_closed=True)
        except ControlChannelError as exc:  # the root is gone: the connection reports that
            logger.debug("rank %d could not pass the stop request to the root: %s", self.rank, exc)

    def _on_heartbeat_error(self, exc: ControlChannelError) -> None:
        self._lost(f"is gone: {exc}", "died")

    def _lost(self, what: str, how: str, *, rank: int = 0, alike: bool = False) -> None:
        conn = self._conn
        if conn is not None and conn.finished:
            logger.debug("rank %d: after Stop, %s %s", self.rank, self._root, what)
            return
        error = PeerLostError(f"rank {self.rank}: {self._root} {what}", rank=rank, how=how)
        self._sup.fail(error, alike=alike)

    async def _read_root(self, conn: Connection) -> None:
        try:
            await self._read_messages(conn)
        finally:
            self._drained.set()

    async def _read_messages(self, conn: Connection) -> None:
        while True:
            message = await conn.receive_live()
            if isinstance(message, Gone):
                self._lost(message.what, message.how)
                return
            if isinstance(message, Heartbeat) or conn.finished:
                continue
            if isinstance(message, Interrupt):
                if self._stop_reason is None:
                    self._stop_reason = message.reason
                    self._stop_requested.set()
                continue
            if isinstance(message, Abort):
                # An error every rank detects itself: this rank's own verdict is awaited first.
                alike = message.detected_by_every_rank
                if message.lost_rank is not None and message.lost_rank != 0:  # the root lost another rank
                    how = message.how or "aborted"
                    self._lost(f"aborted the run: {message.reason}", how, rank=message.lost_rank, alike=alike)
                else:
                    self._lost(f"aborted the run: {message.reason}", "aborted", alike=alike)
                return
            if isinstance(message, Rendezvous) and self._rendezvous is None:
                self._rendezvous = message
                self._rendezvous_or_failed.set()
            elif isinstance(message, (Train, Valid, Stop)) and self._rendezvous is not None:
                if not self._deliver(message):
                    return
                if isinstance(message, Stop):
                    conn.finished = True  # the root's EOF follows; answer with ours
                    self._send_commands.close()
                    await conn.send_eof()
            else:
                self._lost(f"broke the protocol: it sent a {type(message).__name__} message", "protocol")
                return

    def _deliver(self, command: Command) -> bool:
        try:
            self._send_commands.send_nowait(command)
        except anyio.WouldBlock:
            msg = f"rank {self.rank} has {MAX_UNREAD_COMMANDS} unread commands: is it reading them?"
            self._sup.fail(ControlChannelError(msg))
            return False
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            logger.debug("rank %d: the commands are no longer read; dropping %r", self.rank, command)
        return True


class _TcpCommands(AsyncIterator[Command]):
    """The root's commands as received by one follower; ends after :class:`Stop`."""

    def __init__(self, receive: MemoryObjectReceiveStream[Command], sup: Supervisor) -> None:
        self._receive = receive
        self._sup = sup
        self._stopped = False

    def close(self) -> None:
        self._receive.close()

    async def __anext__(self) -> Command:
        if self._stopped:
            raise StopAsyncIteration
        with self._sup.waiting():
            try:
                command = await self._receive.receive()
            except anyio.EndOfStream:
                self._sup.raise_failure()
                msg = "the command stream ended before Stop"
                raise ControlChannelError(msg) from None
            except anyio.ClosedResourceError as exc:
                msg = "commands read after the follower was closed"
                raise ControlChannelError(msg) from exc
        if isinstance(command, Stop):
            self._stopped = True
        return command
