"""One framed TCP connection of the control channel: whole messages in and out, heartbeats, last words.

:class:`Connection` wraps a socket stream with the sans-IO codec of :mod:`lamploop.control.wire`.
Transport errors (``OSError``, anyio's broken/closed resources, a send that outlasts the
heartbeat timeout) become :class:`~lamploop.errors.ControlChannelError`; an oversized or
malformed frame raises :class:`~lamploop.errors.FrameError`.  :meth:`Connection.receive_live`
turns all of those, a peer's silence and its end of stream into :class:`Gone`, which the
root and the follower report in their own words.  It knows neither the handshake
(:mod:`lamploop.control._handshake`) nor which end it serves.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable

import anyio
import anyio.abc
import attrs
from anyio.abc import SocketAttribute

from lamploop.control._settings import Link
from lamploop.control.wire import EndOfMessages, FrameDecoder, Heartbeat, Message, encode_frame
from lamploop.errors import ControlChannelError

__all__ = ["GOODBYE_TIMEOUT", "Connection", "Gone", "remote"]

logger = logging.getLogger("lamploop.control")

GOODBYE_TIMEOUT = 2.0
"""Seconds for the last words: an Abort, or waiting for the peer's EOF after Stop."""

_RECEIVE_BYTES = 65536


@attrs.frozen
class Gone:
    """How a peer was lost while reading; ``what`` completes a sentence that names the peer.

    ``how`` is :attr:`lamploop.errors.PeerLostError.how`'s word for it.
    """

    what: str
    how: str


def explain(exc: BaseException) -> str:
    """``Type: message`` of a transport error, or of its cause when it has none (BrokenResourceError)."""
    if not str(exc) and exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def remote(stream: anyio.abc.ByteStream) -> str:
    """The peer's address as ``host:port`` (``[host]:port`` for IPv6), for messages."""
    try:
        return address_text(stream.extra(SocketAttribute.remote_address))
    except (anyio.TypedAttributeLookupError, OSError):
        return "an unknown peer"


def address_text(address: object) -> str:
    """``host:port`` (``[host]:port`` for IPv6) of a socket address."""
    if isinstance(address, tuple):
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(address)


class Connection:
    """A socket stream that sends and receives whole messages; transport errors become ControlChannelError."""

    def __init__(self, stream: anyio.abc.ByteStream, *, peer: str | None = None, link: Link):
        self.stream = stream
        self._peer = peer  # looked up when first needed: most strangers are never named
        self.rank: int | None = None
        self.finished = False  # Stop went through, or this side is leaving: the peer's EOF is expected
        self._link = link
        self._decoder = FrameDecoder(max_frame_bytes=link.max_frame_bytes)
        self._pending: deque[Message] = deque()
        self._send_lock = anyio.Lock()
        self._write_closed = False
        self._peer_ended = False  # an EndOfMessages arrived (the half-close of a TLS stream)

    @property
    def peer(self) -> str:
        """Who is at the other end, for messages (``host:port`` unless given)."""
        if self._peer is None:
            self._peer = remote(self.stream)
        return self._peer

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame accepted from the peer now."""
        return self._decoder.max_frame_bytes

    @max_frame_bytes.setter
    def max_frame_bytes(self, value: int) -> None:
        self._decoder.max_frame_bytes = value

    def encode(self, message: Message) -> bytes:
        return encode_frame(message, max_frame_bytes=self._link.max_frame_bytes)

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
                    await self._send_now(data)
        except TimeoutError as exc:
            msg = f"sending to {self.peer} took over {send_timeout:g} s: is it still reading?"
            raise ControlChannelError(msg) from exc
        return True

    async def send_first(self, message: Message) -> None:
        """Send the first message of a handshake, whose caller bounds the time (no lock, no own timeout)."""
        await self._send_now(self.encode(message))

    async def _send_now(self, data: bytes) -> None:
        try:
            await self.stream.send(data)
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            msg = f"sending to {self.peer} failed: {explain(exc)}"
            raise ControlChannelError(msg) from exc

    async def send_best_effort(self, message: Message) -> None:
        """Try to send last words (Refuse, Abort) within a short bound, even in a cancelled scope."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(GOODBYE_TIMEOUT):
            try:
                await self.send(message)
            except ControlChannelError as exc:
                logger.debug("could not tell %s %r: %s", self.peer, message, exc)

    async def send_eof(self) -> None:
        """Close the sending direction after what was sent; heartbeats stop.

        A TLS stream cannot close one direction: there an ``EndOfMessages`` frame says it.
        """
        async with self._send_lock:
            self._write_closed = True
            with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                try:
                    await self.stream.send_eof()  # only fails if the connection is already gone
                except NotImplementedError:
                    await self.stream.send(self.encode(EndOfMessages()))

    async def receive(self) -> Message | None:
        """The next message, or ``None`` at a clean end of stream; raises ControlChannelError / FrameError."""
        while not self._pending:
            if self._peer_ended:
                return None
            try:
                data = await self.stream.receive(_RECEIVE_BYTES)
            except anyio.EndOfStream:
                if self._decoder.buffered:
                    msg = f"{self.peer} closed the connection in the middle of a frame"
                    raise ControlChannelError(msg) from None
                return None
            except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
                msg = f"receiving from {self.peer} failed: {explain(exc)}"
                raise ControlChannelError(msg) from exc
            self._pending.extend(self._decoder.feed(data))
        message = self._pending.popleft()
        if isinstance(message, EndOfMessages):
            self._peer_ended = True
            self._pending.clear()  # nothing may follow it
            return None
        return message

    async def receive_live(self) -> Message | Gone:
        """The next message from a joined peer, or how it is gone.

        Gone: the connection failed (a malformed frame included), the peer sent nothing for
        the heartbeat timeout, or it closed the connection.  Raises nothing of its own.
        """
        timeout = self._link.heartbeat_timeout
        message: Message | None = None
        with anyio.move_on_after(timeout) as silence:
            try:
                message = await self.receive()
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

    async def aclose(self) -> None:
        """Close at once (a socket stream's close does not wait), also in a cancelled scope."""
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()
