"""Received bytes read straight into the memory a frame decoder asks for.

asyncio's socket transport reads into a fresh ``bytes`` per read (up to its ``max_size``),
which the decoder then copies into each frame body's own memory: two copies of every byte
after the kernel's, the first into memory allocated for the read.  With a
:class:`asyncio.BufferedProtocol`, the transport asks where to read instead.
:func:`receive_into` swaps the protocol of anyio's TCP stream on asyncio's selector event loop
for one that answers with the awaited body's memory when the decoder has laid it out
(:meth:`~lamploop.transport.frames.FrameDecoder.receive_target`), and otherwise with a buffer of
its own whose bytes it copies out, as anyio's protocol would have queued them.  The stream's
``receive`` is unchanged for its caller: a body read whole into its memory is announced by an
empty chunk (the decoder already holds the bytes; the reader is not woken before the body is
whole, one turn of the event loop per frame rather than per read), so end of stream, errors,
flow control and the reading pauses are anyio's own.

Bytes are never taken out of order: the body's memory is offered only while no received chunk
waits to be read (everything received before is with the decoder), and bytes that reached the
decoder another way fill the body first (:meth:`~lamploop.transport.frames.FrameDecoder.feed`).

.. versionadded:: 0.3
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Final, cast

import anyio.abc

from lamploop.transport.frames import FrameDecoder
from lamploop.transport.scatter import SELECTOR_SOCKET_TRANSPORT

__all__ = ["receive_into"]

_SHARED_STATE: Final = ("read_queue", "read_event", "write_event", "exception", "is_at_eof")
"""What anyio's stream reads of its protocol (anyio 4.7 to 4.16): an anyio whose protocol lacks
one of them is left as it is."""

_SCRATCH_BYTES: Final = 256 * 1024
"""The most read at once into the protocol's own buffer (asyncio's default ``max_size``)."""


def receive_into(stream: anyio.abc.ByteStream, decoder: FrameDecoder[Any]) -> bool:
    """Read ``stream``'s bytes where ``decoder`` asks from now on (see the module); whether it
    could: anyio's plain TCP stream on asyncio's selector event loop, whose protocol is anyio's
    own, nothing being sent or received on it at the moment.  Else (TLS, another event loop or
    backend) nothing changes and the decoder gathers bodies from the reads as before."""
    found = getattr(stream, "_transport", None)
    protocol = getattr(stream, "_protocol", None)
    into_class = _into_decoder_class()
    if (
        into_class is None
        or not isinstance(found, SELECTOR_SOCKET_TRANSPORT)
        or type(protocol) is not into_class.__base__
        or not all(hasattr(protocol, name) for name in _SHARED_STATE)
    ):
        return False
    transport = cast("asyncio.Transport", found)
    if transport.is_closing() or transport.get_protocol() is not protocol:
        return False
    into = into_class(protocol, decoder)
    transport.set_protocol(into)
    stream._protocol = into  # type: ignore[attr-defined]
    decoder.direct = True
    return True


@functools.cache
def _into_decoder_class() -> type[Any] | None:
    """The protocol :func:`receive_into` swaps in: anyio's protocol of its asyncio TCP streams
    (private, hence looked up, not assumed), reading where the decoder asks; ``None`` if this
    anyio has no such protocol (the stream is then left as it is)."""
    try:
        from anyio._backends._asyncio import StreamProtocol
    except ImportError:  # pragma: no cover - another anyio layout
        return None

    class IntoDecoder(StreamProtocol, asyncio.BufferedProtocol):
        """anyio's stream protocol (its events, queue, end of stream and flow control), reading
        where the decoder asks."""

        def __init__(self, protocol: StreamProtocol, decoder: FrameDecoder[Any]) -> None:
            # The state anyio's stream and its transport share with the protocol replaced
            # (_SHARED_STATE).
            self.read_queue = protocol.read_queue
            self.read_event = protocol.read_event
            self.write_event = protocol.write_event
            self.exception = protocol.exception
            self.is_at_eof = protocol.is_at_eof
            self._decoder = decoder
            self._scratch = bytearray(_SCRATCH_BYTES)
            self._into_target = False

        def get_buffer(self, sizehint: int) -> memoryview:
            # A chunk still queued holds earlier bytes: later ones may not overtake it.
            target = None if self.read_queue else self._decoder.receive_target()
            self._into_target = target is not None
            return target if target is not None else memoryview(self._scratch)

        def buffer_updated(self, nbytes: int) -> None:
            if self._into_target:
                self._decoder.landed(nbytes)
                if self._decoder.receive_target() is not None:
                    return  # the body is not whole yet: nothing for the reader to do (its wait goes on)
                if not self.read_queue:
                    self.read_queue.append(b"")  # wakes the reader: the decoder holds the bytes
            else:
                self.read_queue.append(bytes(self._scratch[:nbytes]))
            self.read_event.set()

    return IntoDecoder
