"""A byte stream that sends encoded frames and receives what a sans-IO decoder makes of the bytes.

The sample receiver's and producer's connections (:mod:`lamploop.streaming.wire`) and the
federated link (:mod:`lamploop.federated.link`) are this, each with its own codec: the
reading loop, the end-of-stream rules (clean between frames, an error inside one), the
transport errors turned into the package's own error, last words sent within a bound even
when cancelled, and a close that never waits.  The callers bound the time of every call.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Final, Generic, Protocol, TypeVar

import anyio
import anyio.abc

from lamploop.control._connection import GOODBYE_TIMEOUT, explain, remote
from lamploop.errors import ControlChannelError

__all__ = ["Decoder", "FramedBytes"]

logger = logging.getLogger("lamploop")

Item = TypeVar("Item")
Item_co = TypeVar("Item_co", covariant=True)

RECEIVE_BYTES: Final = 1024 * 1024
"""The most read from the socket at once."""

_TRANSPORT_ERRORS: Final = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError)


class Decoder(Protocol[Item_co]):
    """A sans-IO frame decoder: bytes in, whole items out; ``buffered`` bytes of a frame begun."""

    @property
    def buffered(self) -> int: ...

    def feed(self, data: bytes) -> Iterable[Item_co]: ...


class FramedBytes(Generic[Item]):
    """Frames out, decoded items in, over ``stream`` (see the module).

    Args:
        stream: the connection (TCP, or TLS over it).
        decoder: turns received bytes into items (raises :class:`~lamploop.errors.FrameError`).
        peer: who is at the other end, for messages (default: the socket's ``host:port``).
        error: the :class:`~lamploop.errors.ControlChannelError` subclass transport failures
            become.
    """

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        decoder: Decoder[Item],
        *,
        peer: str | None = None,
        error: type[ControlChannelError] = ControlChannelError,
    ) -> None:
        self.stream = stream
        self.decoder = decoder
        self._peer = peer
        self._error = error
        self._pending: deque[Item] = deque()
        self._ended = False
        self._more_buffered = False

    @property
    def peer(self) -> str:
        """Who is at the other end, for messages (``host:port`` unless named)."""
        if self._peer is None:
            self._peer = remote(self.stream)
        return self._peer

    @property
    def has_pending(self) -> bool:
        """Whether an item already received waits to be read (the peer is not idle)."""
        return bool(self._pending)

    async def send_bytes(self, data: bytes) -> None:
        """Send encoded frames.

        Raises:
            ControlChannelError: (the ``error`` class) the connection failed.
        """
        try:
            await self.stream.send(data)
        except _TRANSPORT_ERRORS as exc:
            msg = f"sending to {self.peer} failed: {explain(exc)}"
            raise self._error(msg) from exc

    async def receive_item(self) -> Item | None:
        """The next decoded item, or ``None`` at a clean end of stream (between frames).

        Raises:
            FrameError: a bad frame.
            ControlChannelError: (the ``error`` class) the connection failed or ended inside a frame.
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
            except _TRANSPORT_ERRORS as exc:
                msg = f"receiving from {self.peer} failed: {explain(exc)}"
                raise self._error(msg) from exc
            self._feed(data)
        return self._pending.popleft()

    def _feed(self, data: bytes) -> None:
        self._pending.extend(self.decoder.feed(data))
        # A decoder that hands out one frame per feed (until a limit is lifted, once the peer
        # proved the token) may keep whole frames: look again before reading more.
        self._more_buffered = (
            bool(getattr(self.decoder, "one_at_a_time", False)) and self.decoder.buffered > 0
        )

    async def last_words(self, send: Callable[[], Awaitable[None]], what: object) -> None:
        """Try ``send()`` (a Refuse...) within :data:`GOODBYE_TIMEOUT`, even in a cancelled scope."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(GOODBYE_TIMEOUT):
            try:
                await send()
            except ControlChannelError as exc:
                logger.debug("could not tell %s %r: %s", self.peer, what, exc)

    async def aclose(self) -> None:
        """Close at once, also in a cancelled scope."""
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(self.stream)
