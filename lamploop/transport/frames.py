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
which a protocol's decoded tensors may view.  A connection that lands received bytes where the
decoder wants them (:mod:`lamploop.transport.receive_into`) lets a large body, or the parts of it
that the protocol plans (:meth:`FrameDecoder.plan_body`: a batch's runs of samples), be read
from the socket straight into that memory (:meth:`FrameDecoder.receive_target`,
:meth:`FrameDecoder.landed`): no copy at all after the kernel's.

.. versionadded:: 0.3
"""

from __future__ import annotations

import ctypes
import struct
from collections import deque
from collections.abc import Sequence
from typing import Final, Generic, TypeVar

from lamploop.errors import FrameError

__all__ = [
    "DIRECT_BODY_BYTES",
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

DIRECT_BODY_BYTES: Final = 64 * 1024
"""A body this large is read straight into its own memory when the connection lands bytes
where the decoder asks (:meth:`FrameDecoder.receive_target`); a smaller one is gathered from
the reads (a plan and its targets cost more than copying a few KiB)."""

_LENGTH = struct.Struct(">I")

_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.restype = ctypes.py_object
_new_bytearray.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def _unfilled_bytearray(count: int) -> bytearray:
    """A ``bytearray`` of ``count`` bytes not zeroed first (``bytearray(count)`` writes every
    byte, a pass over the memory as costly as the socket's own): only for memory the socket
    fills whole before anything reads it."""
    buffer: bytearray = _new_bytearray(None, count)
    return buffer


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
        self.direct = False  # whether received bytes may land in receive_target()
        # The awaited body's memory, once planned: its parts (the planned prefix, then each
        # planned part) and the parts' unfilled ends, in order; take() then reads the parts.
        self._parts: deque[bytearray] | None = None
        self._part_at = 0  # bytes of _parts[0] already taken
        self._targets: deque[memoryview] = deque()
        self._unfilled = 0  # bytes of the targets still to come

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
        planned = 0
        if self._parts is not None:
            planned = sum(len(part) for part in self._parts) - self._part_at - self._unfilled
        return self._size + planned + (HEADER_BYTES if self._body is not None else 0)

    def plan_body(self, length: int) -> tuple[int, list[int]] | None:
        """How the awaited body of ``length`` bytes is laid out in memory when it is read
        straight into it: ``(prefix, parts)``, the first ``prefix`` bytes (already received: see
        :meth:`peek`) gathered into one ``bytearray``, then each of ``parts`` (lengths that add
        up to the rest) read into a ``bytearray`` of its own, which :meth:`take` then hands out
        whole when asked for exactly that many bytes; ``None``: not yet (the prefix is still to
        come).  By default the whole body in one part."""
        return 0, [length]

    def peek(self, count: int) -> bytes | None:
        """The next ``count`` received bytes, left in place; ``None`` if fewer are here."""
        if self._size < count:
            return None
        out = bytearray()
        for chunk in self._chunks:
            out += chunk[: count - len(out)]
            if len(out) == count:
                break
        return bytes(out)

    def receive_target(self) -> memoryview | None:
        """Memory the next received bytes belong in (the awaited body's planned parts), or
        ``None``: hand them to :meth:`feed`.  After the socket wrote ``n`` bytes at its start,
        call :meth:`landed` with ``n``, then :meth:`feed` (``b""`` will do) for the items."""
        return self._targets[0] if self._targets else None

    def landed(self, count: int) -> None:
        """``count`` bytes were written at the start of :meth:`receive_target`'s memory."""
        target = self._targets[0]
        if count > len(target) or count < 0:
            msg = f"{count} bytes landed in a target of {len(target)}"
            raise ValueError(msg)
        self._unfilled -= count
        if count == len(target):
            self._targets.popleft()
        else:
            self._targets[0] = target[count:]

    def _plan(self, length: int) -> None:
        """Lay the awaited body out as :meth:`plan_body` says, if it says yet, and move the
        body's bytes already received into it."""
        plan = self.plan_body(length)
        if plan is None:
            return
        prefix, lengths = plan
        if prefix > self._size or prefix + sum(lengths) != length or any(n < 1 for n in lengths):
            msg = f"a frame's planned layout {prefix} + {lengths} does not fit its body of {length} bytes"
            raise FrameError(msg)
        parts = [self._take(prefix)] if prefix else []
        targets = []
        for n in lengths:
            part = _unfilled_bytearray(n)
            parts.append(part)
            targets.append(memoryview(part))
        self._parts, self._part_at = deque(parts), 0
        self._targets, self._unfilled = deque(targets), length - prefix
        self._fill_targets()

    def _fill_targets(self) -> None:
        """Move received bytes (from :meth:`feed`) into the planned parts, in order."""
        while self._targets and self._size:
            target = self._targets[0]
            chunk = self._chunks[0]
            n = min(len(target), len(chunk))
            target[:n] = chunk[:n]
            if n == len(chunk):
                self._chunks.popleft()
            else:
                self._chunks[0] = chunk[n:]
            self._size -= n
            self.landed(n)

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
        own (copied once; a planned part asked for whole is handed out as it is, not copied);
        only from :meth:`decode_frame`."""
        parts = self._parts
        if parts is None:
            return self._take(count)
        if self._part_at == 0 and parts and len(parts[0]) == count:
            return parts.popleft()
        out = bytearray()
        while len(out) < count and parts:
            part = parts[0]
            piece = memoryview(part)[self._part_at : self._part_at + count - len(out)]
            out += piece
            self._part_at += len(piece)
            if self._part_at == len(part):
                parts.popleft()
                self._part_at = 0
        return out

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
                if self._parts is not None:  # the awaited body is planned: whole once its parts are
                    self._fill_targets()
                    if self._unfilled:
                        break
                else:
                    if self._body is None:
                        if self._size < HEADER_BYTES:
                            break
                        (length,) = _LENGTH.unpack(self._take(HEADER_BYTES))
                        if length > self._max:
                            msg = f"a frame announces {length} bytes, over the limit of {self._max} bytes"
                            raise FrameError(msg)
                        self._body = length
                    if self._size < self._body:
                        if self.direct and self._body >= DIRECT_BODY_BYTES:
                            self._plan(self._body)
                            if self._parts is not None:
                                continue
                        break
                length, self._body = self._body, None
                assert length is not None
                try:
                    items.append(self.decode_frame(length))
                finally:
                    self._parts = None
                if self.one_at_a_time:
                    break
        except FrameError as exc:
            self._error = exc
            self._chunks.clear()
            self._size, self._body = 0, None
            self._parts, self._unfilled = None, 0
            self._targets.clear()
            raise
        return items
