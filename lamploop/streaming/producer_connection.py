"""An :class:`~lamploop.streaming.async_producer.AsyncProducer`'s connection, in the background.

Split from :mod:`lamploop.streaming.async_producer`: :class:`ProducerConnectionLoop` is the part
of the producer that connects (with backoff, following a receiver's redirect), runs the
producer's side of the handshake (:mod:`lamploop.streaming.producer_handshake`), then writes
batches from the :class:`~lamploop.streaming.outbox.Outbox` and reads acknowledgements on each
connection.  :class:`~lamploop.streaming.async_producer.AsyncProducer` inherits it and sets
every attribute it declares.
"""

from __future__ import annotations

import logging
import math
import ssl
from typing import TYPE_CHECKING

import anyio
import attrs

from lamploop.errors import StreamingError, TransportError
from lamploop.streaming.outbox import Outbox
from lamploop.streaming.producer_handshake import ConnectionLost, Redirected, connect, greet
from lamploop.streaming.wire import Ack, Done, FramedStream, Refuse, Welcome, encode_frame
from lamploop.transport import frames
from lamploop.transport.connection import explain
from lamploop.transport.supervisor import Supervisor

__all__ = ["ProducerConnectionLoop"]

logger = logging.getLogger("lamploop.streaming")

_FIRST_BACKOFF, _MAX_BACKOFF = 0.05, 1.0


class _Signal:
    """Wakes up every task waiting for "something changed" (one event loop, no lock needed)."""

    def __init__(self) -> None:
        self._event: anyio.Event | None = None  # made by the first waiter: notify() is per sample

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


class _Unanswered(ConnectionLost):
    """The receiver took nothing for ``ack_timeout``: a full buffer nobody reads (back-pressure,
    the connection is renewed for as long as it lasts) or a receiver gone without a word (the
    next connection fails, and that counts towards ``reconnect_timeout``)."""


@attrs.define
class _Session:
    """One connection's progress: the highest seq sent on it, whether Done was sent."""

    sent: int
    done_sent: bool = False


class ProducerConnectionLoop:
    """The producer's connection task: connect, greet, then write and read until lost or done.

    A base of :class:`~lamploop.streaming.async_producer.AsyncProducer`, which sets the
    attributes below in its ``__init__`` and starts :meth:`_run` in its supervisor.
    """

    name: str
    _token: bytes
    _root: tuple[str, int]
    _host: str
    _port: int
    _outbox: Outbox
    _max_frame_bytes: int
    _reconnect_timeout: float
    _handshake_timeout: float
    _ack_timeout: float
    _tls: ssl.SSLContext | None
    _sup: Supervisor
    _changed: _Signal
    _done_requested: bool
    _finished: bool
    _connections: int
    _writer_idle: bool

    if TYPE_CHECKING:

        @property
        def unacknowledged(self) -> int: ...

    @property
    def _receiver(self) -> str:
        return f"the receiver at {self._host}:{self._port}"

    # -- the connection, in the background --

    def _has_work(self) -> bool:
        pending_done = self._done_requested and not self._finished
        return self._connections == 0 or self.unacknowledged > 0 or pending_done

    async def _run(self) -> None:
        try:
            await self._connect_forever()
        except TransportError as exc:
            self._sup.fail(exc)
        except Exception as exc:  # a bug: reported like a failure, so that no send() waits on a dead task
            error = StreamingError(f"producer {self.name!r}: its connection task failed: {explain(exc)}")
            error.__cause__ = exc
            self._sup.fail(error)

    async def _connect_forever(self) -> None:
        failing_since: float | None = None
        delay = _FIRST_BACKOFF
        attempts = 0
        while not self._finished:
            while not self._has_work():  # idle: connect again when there is something to send
                await self._changed.wait()
            try:
                conn = await self._connect()
                try:
                    welcome = await self._greet(conn)
                    self._connections += 1
                    cut = await self._session(conn, welcome)
                finally:
                    await conn.aclose()
                if cut is None:
                    # It got somewhere, or the receiver is there and takes nothing (back-pressure):
                    # not a failure, however long it lasts.  Again at once.
                    failing_since, attempts, delay = None, 0, _FIRST_BACKOFF
                    continue
                # Cut before the receiver took anything: a failure like an unreachable receiver,
                # or a link that always breaks mid-frame would be retried forever.
                error = cut
            except Redirected as redirect:
                if (self._host, self._port) != self._root:
                    error = f"{self._receiver} redirected this producer again, to {redirect}"
                    self._host, self._port = self._root
                else:  # at the root: on to the assigned receiver at once
                    logger.info("producer %r: redirected to %s", self.name, redirect)
                    self._host, self._port = redirect.address
                    continue
            except ConnectionLost as exc:
                error = str(exc)
                # The assigned receiver is unreachable or gone: ask the root again (it may have
                # restarted, with the same assignment at another address).
                self._host, self._port = self._root
            attempts += 1
            now = anyio.current_time()
            failing_since = now if failing_since is None else failing_since
            if now - failing_since >= self._reconnect_timeout:
                msg = (
                    f"producer {self.name!r} could not reach {self._receiver} for "
                    f"{self._reconnect_timeout:g} s ({attempts} attempts; last error: {error})"
                )
                raise StreamingError(msg)
            logger.debug("producer %r: %s; retrying in %g s", self.name, error, delay)
            await anyio.sleep(min(delay, self._reconnect_timeout - (now - failing_since)))
            delay = min(delay * 2, _MAX_BACKOFF)

    async def _connect(self) -> FramedStream:
        return await connect(
            (self._host, self._port),
            receiver=self._receiver,
            handshake_timeout=self._handshake_timeout,
            max_frame_bytes=self._max_frame_bytes,
        )

    async def _greet(self, conn: FramedStream) -> Welcome:
        return await greet(
            conn,
            name=self.name,
            token=self._token,
            ssl_context=self._tls,
            host=self._host,
            receiver=self._receiver,
            handshake_timeout=self._handshake_timeout,
        )

    async def _session(self, conn: FramedStream, welcome: Welcome) -> str | None:
        """Send and resend on one connection until it is lost or done (returns) or fails for good (raises).

        Returns why the connection was cut when it was cut before the receiver acknowledged
        anything new (in its welcome or on the connection); None when it got somewhere, ended
        done, or was renewed because the receiver took nothing for ``ack_timeout`` (back-pressure).
        """
        box = self._outbox
        acked_before = box.acked
        box.take_welcome(welcome.acked_seq, welcome.max_frame_bytes, receiver=self._receiver)
        self._changed.notify()
        # The receiver proved the token; it sends only small frames (acknowledgements).
        conn.authenticated(frames.preauth_frame_bytes(self._max_frame_bytes))
        logger.info("producer %r connected to %s (holds up to %d)", self.name, self._receiver, box.acked)
        session = _Session(sent=box.acked)
        lost: list[ConnectionLost] = []
        refused: list[TransportError] = []  # raised outside the task group, unwrapped
        async with anyio.create_task_group() as tg:

            async def write() -> None:
                try:
                    await self._write(conn, session)
                except ConnectionLost as exc:
                    lost.append(exc)
                except TransportError as exc:  # a sample the receiver can never take
                    refused.append(exc)
                tg.cancel_scope.cancel()

            tg.start_soon(write)
            try:
                await self._read(conn, session)
            except ConnectionLost as exc:
                lost.append(exc)
            except TransportError as exc:
                refused.append(exc)
            tg.cancel_scope.cancel()
        if refused:
            raise refused[0]
        if self._finished or not lost:
            return None
        logger.info("producer %r: lost the connection (%s); reconnecting", self.name, lost[0])
        if box.acked > acked_before or isinstance(lost[0], _Unanswered):
            return None
        return str(lost[0])

    async def _write(self, conn: FramedStream, session: _Session) -> None:
        # One scope bounds every send (its deadline moved before each, lifted while idle):
        # a fail_after per frame cost as much as a tenth of the producer's time.
        with anyio.CancelScope() as stuck:
            while True:
                box = self._outbox
                session.sent = max(session.sent, box.acked)
                batch = box.batch_parts(session.sent, receiver=self._receiver)
                if batch is not None:
                    count, parts = batch
                    stuck.deadline = anyio.current_time() + self._ack_timeout
                    await self._send(conn, parts)
                    session.sent = box.record_sent(session.sent, count)
                    continue
                if self._done_requested and not session.done_sent and session.sent >= box.next_seq - 1:
                    stuck.deadline = anyio.current_time() + self._ack_timeout
                    await self._send(conn, [encode_frame(Done(box.next_seq - 1))])
                    session.done_sent = True
                stuck.deadline = math.inf
                self._writer_idle = True
                try:
                    await self._changed.wait()
                finally:
                    self._writer_idle = False
        raise _Unanswered(f"sending to {self._receiver} took over {self._ack_timeout:g} s")

    async def _send(self, conn: FramedStream, parts: list[bytes]) -> None:
        try:
            await conn.send_parts(parts)
        except TransportError as exc:
            raise ConnectionLost(str(exc)) from exc

    async def _read(self, conn: FramedStream, session: _Session) -> None:
        """Read acknowledgements until the receiver answers Done; raises ConnectionLost when lost."""
        while not self._finished:
            message = None
            with anyio.move_on_after(self._ack_timeout) as silence:
                try:
                    message = await conn.receive()
                except TransportError as exc:  # FrameError included
                    raise ConnectionLost(str(exc)) from exc
            if silence.cancelled_caught:
                if session.sent > self._outbox.acked or session.done_sent:
                    raise _Unanswered(f"{self._receiver} acknowledged nothing for {self._ack_timeout:g} s")
                continue
            if message is None:
                raise ConnectionLost(f"{self._receiver} closed the connection")
            if isinstance(message, Refuse):
                msg = f"producer {self.name!r} refused by {self._receiver}: {message.reason}"
                raise StreamingError(msg)
            if (
                isinstance(message, Done)
                and session.done_sent
                and message.last_seq >= self._outbox.next_seq - 1
            ):
                self._outbox.acknowledge(message.last_seq)
                self._finished = True  # the receiver recorded our Done and holds every sample
                self._changed.notify()
                return
            if not isinstance(message, Ack) or message.upto_seq > session.sent:
                what = f"Ack({message.upto_seq})" if isinstance(message, Ack) else type(message).__name__
                msg = f"{self._receiver} broke the protocol: it sent {what} (sent up to {session.sent})"
                raise ConnectionLost(msg)
            if self._outbox.acknowledge(message.upto_seq):
                self._changed.notify()
