"""The one framed connection of lamploop's TCP protocols: frames out, decoded items in.

:class:`FramedConnection` wraps a byte stream (TCP, or TLS over it) and a protocol's
:class:`~lamploop.transport.frames.FrameDecoder`: the reading loop, the end-of-stream rules
(clean between frames, an error inside one), the transport errors turned into
:class:`~lamploop.errors.TransportError` (or the protocol's subclass of it), the pre-authentication
limits lifted once the peer proved the token (:meth:`FramedConnection.authenticated`), last
words sent within :data:`GOODBYE_TIMEOUT` even when cancelled, and a close that never waits.
The control channel's connection adds heartbeats and a half-close on top
(:mod:`lamploop.control.connection`).  Callers bound the time of every call.

.. versionadded:: 0.3
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Generic, TypeVar

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from lamploop.errors import TransportError
from lamploop.forked_children import not_inherited_by_workers
from lamploop.transport.frames import FrameDecoder
from lamploop.transport.receive_into import receive_into
from lamploop.transport.scatter import scatter_transport, write_parts

__all__ = [
    "GOODBYE_TIMEOUT",
    "RECEIVE_BYTES",
    "TRANSPORT_ERRORS",
    "FramedConnection",
    "address_text",
    "explain",
    "remote",
]

logger = logging.getLogger("lamploop")

Item = TypeVar("Item")

GOODBYE_TIMEOUT: Final = 2.0
"""Seconds for the last words: a Refuse or an Abort, or waiting for the peer's EOF after Stop."""

RECEIVE_BYTES: Final = 1024 * 1024
"""The most read from the socket at once."""

TRANSPORT_ERRORS: Final = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError)
"""What a socket stream raises when the connection fails."""


def explain(exc: BaseException) -> str:
    """``Type: message`` of a transport error, or of its cause when it has none (BrokenResourceError)."""
    if not str(exc) and exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def address_text(address: object) -> str:
    """``host:port`` (``[host]:port`` for IPv6) of a socket address."""
    if isinstance(address, tuple):
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(address)


def remote(stream: anyio.abc.ByteStream) -> str:
    """The peer's address as ``host:port`` (``[host]:port`` for IPv6), for messages."""
    try:
        return address_text(stream.extra(SocketAttribute.remote_address))
    except (anyio.TypedAttributeLookupError, OSError):
        return "an unknown peer"


class FramedConnection(Generic[Item]):
    """Frames out, decoded items in, over ``stream`` (see the module).

    Args:
        stream: the connection (TCP, or TLS over it).
        decoder: turns received bytes into items (raises :class:`~lamploop.errors.FrameError`);
            made with the pre-authentication limit and ``one_at_a_time`` until the peer proves
            the token.
        peer: who is at the other end, for messages (default: the socket's ``host:port``).
        error: the :class:`~lamploop.errors.TransportError` subclass transport failures become.
    """

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        decoder: FrameDecoder[Item],
        *,
        peer: str | None = None,
        error: type[TransportError] = TransportError,
    ) -> None:
        self.stream = stream
        self.decoder = decoder
        not_inherited_by_workers(self)  # a rank's DataLoader workers must not keep it open when it dies
        # Looked up now, while the socket is connected: a peer that resets the connection
        # (a port scanner does) has no address to ask for once it is gone.
        self._peer = peer if peer is not None else remote(stream)
        self._error = error
        self._pending: deque[Item] = deque()
        self._ended = False
        self._more_buffered = False

    @property
    def peer(self) -> str:
        """Who is at the other end, for messages (``host:port`` unless named)."""
        return self._peer

    def fileno(self) -> int:
        """The socket's descriptor (-1 when closed, or not a socket)."""
        raw = self.stream.extra(SocketAttribute.raw_socket, None)
        return -1 if raw is None else int(raw.fileno())

    @property
    def has_pending(self) -> bool:
        """Whether an item already received waits to be read (the peer is not idle)."""
        return bool(self._pending)

    def read_in_large_chunks(self) -> None:
        """Let the socket hand over up to :data:`RECEIVE_BYTES` per read (a peer that streams
        large frames: fewer reads, and fewer event-loop turns, per frame).

        asyncio's socket transport reads at most 256 KiB at a time (its ``max_size``), each read
        a turn of the event loop and a chunk for the decoder; a TLS stream, or another backend,
        is left as it is.
        """
        transport = getattr(self.stream, "_transport", None)  # anyio's asyncio socket stream
        if transport is not None and isinstance(getattr(transport, "max_size", None), int):
            transport.max_size = max(transport.max_size, RECEIVE_BYTES)

    def receive_into_frames(self) -> bool:
        """Read large frame bodies from the socket straight into their own memory from now on
        (:mod:`lamploop.transport.receive_into`; after the handshake, with nothing sent or
        received at the moment); whether the stream allows it (anyio's TCP stream on asyncio's
        selector event loop).  Else the socket is read in large chunks
        (:meth:`read_in_large_chunks`)."""
        if receive_into(self.stream, self.decoder):
            return True
        self.read_in_large_chunks()
        return False

    def authenticated(self, max_frame_bytes: int, *, name: str | None = None) -> None:
        """The peer proved the token: take frames up to ``max_frame_bytes``, several per read;
        ``name`` it in messages from now on, if given."""
        if name is not None:
            self._peer = name
        self.decoder.authenticated(max_frame_bytes)

    async def send_bytes(self, data: bytes) -> None:
        """Send encoded frames.

        Raises:
            TransportError: (the ``error`` class) the connection failed.
        """
        try:
            await self.stream.send(data)
        except TRANSPORT_ERRORS as exc:
            raise self._send_failed(exc) from exc

    def _send_failed(self, exc: BaseException) -> TransportError:
        return self._error(f"sending to {self.peer} failed: {explain(exc)}")

    async def send_parts(self, parts: Sequence[bytes]) -> None:
        """Send an encoded frame given as parts (:func:`~lamploop.transport.frames.frame_parts`),
        their large ones not copied again on a plain TCP stream (:mod:`lamploop.transport.scatter`);
        on another stream (TLS), joined and sent.  One task sends on a connection.

        Raises:
            TransportError: (the ``error`` class) the connection failed.
        """
        transport = scatter_transport(self.stream) if len(parts) > 1 else None
        if transport is None:
            await self.send_bytes(parts[0] if len(parts) == 1 else b"".join(parts))
            return
        try:
            write_parts(transport, parts)
        except OSError as exc:
            raise self._send_failed(exc) from exc
        # As the stream's own send after its write: the connection's failure raised, and the
        # wait while the transport holds more than its limit of unsent bytes.
        await self.send_bytes(b"")

    async def receive_item(self) -> Item | None:
        """The next decoded item, or ``None`` at a clean end of stream (between frames).

        Raises:
            FrameError: a bad frame.
            TransportError: (the ``error`` class) the connection failed or ended inside a frame.
        """
        while not self._pending:
            if self._more_buffered:  # whole frames the decoder kept for later: take them first
                self._feed(b"")
                continue
            if self._ended:
                return None
            try:
                data = await self.stream.receive(RECEIVE_BYTES)
            except anyio.EndOfStream:
                self._ended = True
                if self.decoder.buffered:
                    msg = f"{self.peer} closed the connection in the middle of a frame"
                    raise self._error(msg) from None
                return None
            except TRANSPORT_ERRORS as exc:
                msg = f"receiving from {self.peer} failed: {explain(exc)}"
                raise self._error(msg) from exc
            self._feed(data)
        return self._pending.popleft()

    def _feed(self, data: bytes) -> None:
        items = self.decoder.feed(data)
        self._pending.extend(items)
        # A decoder that hands out one frame per feed (until the peer proved the token) may
        # keep whole frames: look again before reading more, unless it kept only part of one.
        self._more_buffered = self.decoder.one_at_a_time and bool(items) and self.decoder.buffered > 0

    def drop_pending(self) -> None:
        """Forget the items received and not read yet (nothing may follow an end of messages)."""
        self._pending.clear()
        self._more_buffered = False

    async def last_words(self, send: Callable[[], Awaitable[object]], what: object) -> None:
        """Try ``send()`` (a Refuse, an Abort) within :data:`GOODBYE_TIMEOUT`, even in a cancelled scope."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(GOODBYE_TIMEOUT):
            try:
                await send()
            except TransportError as exc:
                logger.debug("could not tell %s %r: %s", self.peer, what, exc)

    async def aclose(self) -> None:
        """Close at once, also in a cancelled scope."""
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(self.stream)
