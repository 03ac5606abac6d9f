"""One framed TCP connection of the control channel: the transport's, with heartbeats and a half-close.

:class:`Connection` is the transport's :class:`~lamploop.transport.connection.FramedConnection`
over the codec of :mod:`lamploop.control.wire`; it adds what only the control channel does:
a send lock with the heartbeat timeout as its bound, heartbeats, the half-close that ends a
run (an ``EndOfMessages`` frame under TLS), and :meth:`Connection.receive_live`, which turns
a transport failure, a peer's silence and its end of stream into :class:`Gone`, which the root
and the follower report in their own words.  :func:`abort_message` is the Abort a side sends
when it leaves before Stop.  It knows neither the handshake (:mod:`lamploop.control.handshake`)
nor which end it serves.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import anyio
import anyio.abc
import attrs

from lamploop.control.settings import Link
from lamploop.control.wire import Abort, EndOfMessages, FrameDecoder, Heartbeat, Message, encode_frame
from lamploop.errors import ControlChannelError, FrameError, PeerLostError, error_detected_by_every_rank
from lamploop.transport.connection import TRANSPORT_ERRORS, FramedConnection
from lamploop.transport.supervisor import Supervisor

__all__ = ["Connection", "Gone", "abort_message"]

logger = logging.getLogger("lamploop.control")


@attrs.frozen
class Gone:
    """How a peer was lost while reading; ``what`` completes a sentence that names the peer.

    ``how`` is :attr:`lamploop.errors.PeerLostError.how`'s word for it.
    """

    what: str
    how: str


class Connection(FramedConnection[Message]):
    """A socket stream that sends and receives whole control messages (see the module).

    It starts with the pre-authentication limit ``preauth_frame_bytes``, one frame at a
    time; :meth:`authenticated` lifts it to the link's once the peer proved the token.
    """

    def __init__(
        self, stream: anyio.abc.ByteStream, *, peer: str | None = None, link: Link, preauth_frame_bytes: int
    ):
        decoder = FrameDecoder(max_frame_bytes=preauth_frame_bytes, one_at_a_time=True)
        super().__init__(stream, decoder, peer=peer, error=ControlChannelError)
        self.rank: int | None = None
        self.finished = False  # Stop went through, or this side is leaving: the peer's EOF is expected
        self._link = link
        self._send_lock = anyio.Lock()
        self._write_closed = False
        self._peer_ended = False  # an EndOfMessages arrived (the half-close of a TLS stream)

    def encode(self, message: Message) -> bytes:
        return encode_frame(message, max_frame_bytes=self._link.max_frame_bytes)

    def joined(self) -> None:
        """The peer proved the token: frames up to the link's ``max_frame_bytes`` from now on."""
        self.authenticated(self._link.max_frame_bytes)

    async def send(self, message: Message | bytes, *, unless_closed: bool = False) -> bool:
        """Send a message (or an already encoded frame); raises ControlChannelError.

        Once this side has closed for sending, raises too, or with ``unless_closed`` returns
        ``False`` instead.
        """
        data = message if isinstance(message, bytes) else self.encode(message)
        send_timeout = self._link.heartbeat_timeout
        try:
            with anyio.fail_after(send_timeout):
                async with self._send_lock:
                    if self._write_closed:
                        if unless_closed:
                            return False
                        msg = f"cannot send to {self.peer}: this side has closed the connection for sending"
                        raise ControlChannelError(msg)
                    await self.send_bytes(data)
        except TimeoutError as exc:
            msg = f"sending to {self.peer} took over {send_timeout:g} s: is it still reading?"
            raise ControlChannelError(msg) from exc
        return True

    async def send_first(self, message: Message) -> None:
        """Send the first message of a handshake, whose caller bounds the time (no lock, no own timeout)."""
        await self.send_bytes(self.encode(message))

    async def send_best_effort(self, message: Message) -> None:
        """Try to send last words (Refuse, Abort) within a short bound, even in a cancelled scope."""
        await self.last_words(lambda: self.send(message), message)

    async def send_eof(self) -> None:
        """Close the sending direction after what was sent; heartbeats stop.

        A TLS stream cannot close one direction: there an ``EndOfMessages`` frame says it.
        """
        async with self._send_lock:
            self._write_closed = True
            with contextlib.suppress(*TRANSPORT_ERRORS):
                try:
                    await self.stream.send_eof()  # only fails if the connection is already gone
                except NotImplementedError:
                    await self.stream.send(self.encode(EndOfMessages()))

    async def receive(self) -> Message | None:
        """The next message, or ``None`` at a clean end of stream; raises ControlChannelError / FrameError."""
        if self._peer_ended:
            return None
        message = await self.receive_item()
        if isinstance(message, EndOfMessages):
            self._peer_ended = True
            self.drop_pending()  # nothing may follow it
            return None
        return message

    async def receive_live(self) -> Message | Gone:
        """The next message from a joined peer, or how it is gone.

        Gone: the connection failed, the peer sent a malformed frame (``"protocol"``), sent
        nothing for the heartbeat timeout, or closed the connection.  Raises nothing of its own.
        """
        timeout = self._link.heartbeat_timeout
        message: Message | None = None
        with anyio.move_on_after(timeout) as silence:
            try:
                message = await self.receive()
            except FrameError as exc:  # alive, but what it sent is no frame of this protocol
                return Gone(f"broke the protocol: {exc}", "protocol")
            except ControlChannelError as exc:
                return Gone(f"is gone: {exc}", "died")
        if silence.cancelled_caught:
            return Gone(f"sent nothing for {timeout:g} s (heartbeat timeout)", "silent")
        if message is None:
            return Gone("closed the connection before Stop", "closed")
        return message

    async def heartbeat_forever(self, on_error: Callable[[ControlChannelError], None]) -> None:
        """Send a heartbeat every interval until closed for sending or failing."""
        while True:
            await anyio.sleep(self._link.heartbeat_interval)
            try:
                if not await self.send(Heartbeat(), unless_closed=True):
                    return
            except ControlChannelError as exc:
                on_error(exc)
                return


def abort_message(sup: Supervisor, exc: BaseException | None, who: str, *, own_rank: int) -> Abort:
    """The Abort to send when leaving before Stop: why, and which rank was lost if one was.

    ``exc`` is what :meth:`Supervisor.leave_body` returned.  An error every rank detects
    itself (the owner's, or a peer's it passes on) travels with ``detected_by_every_rank``, so
    that the peers raise their own instead of this abort.  A lost rank (the channel's own
    failure, or a :class:`PeerLostError` the owner raised) travels as ``lost_rank``/``how``, so
    that the peers blame it and not this side.
    """
    reason = sup.describe_exit(exc, who)
    if error_detected_by_every_rank(exc) is not None:
        return Abort(reason, detected_by_every_rank=True)
    for error in (sup.failure, exc):
        if isinstance(error, PeerLostError) and error.rank is not None and error.rank != own_rank:
            alike = error is sup.failure and sup.failure_alike
            return Abort(reason, lost_rank=error.rank, how=error.how, detected_by_every_rank=alike)
    return Abort(reason)
