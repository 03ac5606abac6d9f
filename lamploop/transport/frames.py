"""The one frame decoder of lamploop's three TCP protocols, without I/O (sans-IO).

Every frame of the control channel, the streaming transport and the federated link is a
4-byte big-endian body length followed by the body; what a body holds is each protocol's
business (:meth:`FrameDecoder.decode_body`).  The decoder here owns the rules every
protocol shares, so that a fix to them is made once:

- the announced length is checked against :attr:`FrameDecoder.max_frame_bytes` as soon as
  the 4-byte header is complete, before a byte of the body is buffered;
- before the peer has proved the token, the limit is the small pre-authentication one
  (:func:`preauth_frame_bytes`, from the one constant :data:`PREAUTH_FRAME_BYTES`) and a call
  to :meth:`~FrameDecoder.feed` decodes one frame at most, keeping the rest: the frames that
  follow a hello in the same read are judged once the hello is, under the limit of a peer
  that proved the token (:meth:`FrameDecoder.authenticated` lifts both);
- after a :class:`~lamploop.errors.FrameError` the stream cannot be resynchronised: every
  later :meth:`~FrameDecoder.feed` raises again.

Each body is gathered into a ``bytearray`` of its own (one copy of the received bytes),
which a protocol's decoded tensors may view.

.. versionadded:: 0.3
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Sequence
from typing import Final, Generic, TypeVar

from lamploop.errors import FrameError

__all__ = [
    "HEADER_BYTES",
    "PREAUTH_FRAME_BYTES",
    "FrameDecoder",
    "SCATTER_BYTES",
    "frame",
    "frame_parts",
    "preauth_frame_bytes",
]

Item = TypeVar("Item")

HEADER_BYTES: Final = 4
"""Size of the big-endian unsigned length prefix of every frame."""

PREAUTH_FRAME_BYTES = 4096
"""The largest frame accepted from a peer that has not proved the token yet (a hello is a few
hundred bytes), on every protocol.  The control channel's hello carries the model spec, so its
limit grows with the spec (:func:`preauth_frame_bytes`).  Read at each connection: a change
here takes effect in all three protocols."""

SCATTER_BYTES: Final = 16 * 1024
"""A part of a frame this large is sent as it is by :func:`frame_parts`' caller (one copy
fewer); smaller neighbouring parts are joined (a part costs the socket a buffer, and joining a
few small ones costs less)."""

_LENGTH = struct.Struct(">I")


def preauth_frame_bytes(max_frame_bytes: int, *, hello_bytes: int = 0, floor_factor: int = 1) -> int:
    """The frame limit before the peer proved the token.

    :data:`PREAUTH_FRAME_BYTES` times ``floor_factor``, or twice ``hello_bytes`` (the size of
    this side's own hello, for a hello whose size varies) if more, never over ``max_frame_bytes``.
    """
    return min(max_frame_bytes, max(PREAUTH_FRAME_BYTES * floor_factor, 2 * hello_bytes))


def _prefix(body_parts: Sequence[bytes], what: str, max_frame_bytes: int) -> bytes:
    """The length prefix of a body made of ``body_parts``; FrameError if over ``max_frame_bytes``."""
    length = sum(len(part) for part in body_parts)
    if length > max_frame_bytes:
        msg = f"a {what} frame of {length} bytes is over the limit of {max_frame_bytes} bytes"
        raise FrameError(msg)
    return _LENGTH.pack(length)


def frame(body_parts: Sequence[bytes], what: str, max_frame_bytes: int) -> bytes:
    """The frame of a body made of ``body_parts`` (joined once, after the length prefix).

    Raises:
        FrameError: the body is longer than ``max_frame_bytes`` (``what`` names the message).
    """
    return b"".join((_prefix(body_parts, what, max_frame_bytes), *body_parts))


def frame_parts(body_parts: Sequence[bytes], what: str, max_frame_bytes: int) -> list[bytes]:
    """The frame of a body made of ``body_parts``, as parts whose concatenation is
    :func:`frame`'s bytes: each part of :data:`SCATTER_BYTES` or more as it is (not copied),
    each stretch of smaller ones between them joined, the length prefix with the first.

    Raises:
        FrameError: as :func:`frame`.
    """
    parts: list[bytes] = []
    small: list[bytes] = [_prefix(body_parts, what, max_frame_bytes)]
    for part in body_parts:
        if len(part) < SCATTER_BYTES:
            if part:
                small.append(part)
            continue
        if small:
            parts.append(small[0] if len(small) == 1 else b"".join(small))
            small = []
        parts.append(part)
    if small:
        parts.append(small[0] if len(small) == 1 else b"".join(small))
    return parts


class FrameDecoder(Generic[Item]):
    """Splits a byte stream into frames and each frame's body into an item; feed it what the socket returned.

    A protocol subclasses it and implements :meth:`decode_body`.  See the module for the rules.

    Args:
        max_frame_bytes: the limit on a frame's body.
        one_at_a_time: decode one frame per :meth:`feed` (before the peer proved the token).
    """

    def __init__(self, *, max_frame_bytes: int, one_at_a_time: bool = False) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.one_at_a_time = one_at_a_time
        self._chunks: deque[memoryview] = deque()
        self._size = 0  # bytes in _chunks
        self._body: int | None = None  # the length of the body awaited, once its prefix is read
        self._error: FrameError | None = None

    @property
    def max_frame_bytes(self) -> int:
        """The current limit on a frame's body."""
        return self._max

    @max_frame_bytes.setter
    def max_frame_bytes(self, value: int) -> None:
        if value < 1:
            msg = f"max_frame_bytes must be positive, got {value}"
            raise ValueError(msg)
        self._max = value

    @property
    def buffered(self) -> int:
        """How many bytes received wait: of an incomplete frame, or whole frames kept for later."""
        return self._size + (HEADER_BYTES if self._body is not None else 0)

    def authenticated(self, max_frame_bytes: int) -> None:
        """The peer proved the token: frames up to ``max_frame_bytes``, as many per feed as there are."""
        self.max_frame_bytes = max_frame_bytes
        self.one_at_a_time = False

    def decode_body(self, body: bytearray) -> Item:
        """The item of one frame's ``body`` (the protocol's); raises FrameError if it does not decode."""
        raise NotImplementedError

    def decode_frame(self, length: int) -> Item:
        """The item of the next frame, whose ``length`` bytes of body are all buffered.

        By default :meth:`decode_body` of the body gathered into one ``bytearray``.  A protocol
        may instead :meth:`take` the body in parts (exactly ``length`` bytes in all, unless it
        raises FrameError), so that each part is copied once into the memory it ends up in.
        """
        return self.decode_body(self.take(length))

    def take(self, count: int) -> bytearray:
        """The next ``count`` buffered bytes (at most :attr:`buffered`), in a bytearray of their
        own (copied once); only from :meth:`decode_frame`."""
        return self._take(count)

    def _take(self, count: int) -> bytearray:
        """The next ``count`` bytes of the chunks, in a bytearray of their own (copied once)."""
        parts: list[memoryview] = []
        needed = count
        chunks = self._chunks
        while needed:
            chunk = chunks[0]
            if len(chunk) <= needed:
                parts.append(chunks.popleft())
                needed -= len(chunk)
            else:
                parts.append(chunk[:needed])
                chunks[0] = chunk[needed:]
                needed = 0
        self._size -= count
        if len(parts) == 1:
            return bytearray(parts[0])
        return bytearray().join(parts)

    def feed(self, data: bytes) -> list[Item]:
        """Add ``data``; return the item of every frame it completes, in order (one at most
        while :attr:`one_at_a_time`: call again with ``b""`` for the next).

        Raises:
            FrameError: a header announces more than :attr:`max_frame_bytes`, or a body does not
                decode; also on any call after one that raised.
        """
        if self._error is not None:
            msg = f"the stream is unusable after an earlier bad frame: {self._error}"
            raise FrameError(msg)
        if data:
            self._chunks.append(memoryview(data))
            self._size += len(data)
        items: list[Item] = []
        try:
            while True:
                if self._body is None:
                    if self._size < HEADER_BYTES:
                        break
                    (length,) = _LENGTH.unpack(self._take(HEADER_BYTES))
                    if length > self._max:
                        msg = f"a frame announces {length} bytes, over the limit of {self._max} bytes"
                        raise FrameError(msg)
                    self._body = length
                if self._size < self._body:
                    break
                length, self._body = self._body, None
                items.append(self.decode_frame(length))
                if self.one_at_a_time:
                    break
        except FrameError as exc:
            self._error = exc
            self._chunks.clear()
            self._size, self._body = 0, None
            raise
        return items
