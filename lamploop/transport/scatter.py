"""A frame given in parts, written to a socket without joining the parts first.

A batch of large samples is a few large parts (each sample's encoded tensors) and small ones
(headers, padding): joining them into one ``bytes`` copies every sample once more before the
socket copies it again.  :func:`write_parts` hands the parts to the socket itself, in one
``sendmsg`` (scatter/gather I/O) where the event loop's transport lets it, and what the socket
does not take at once to the transport's own buffer, so that the transport's flow control and
errors hold as for a plain write.  Python 3.12's socket transports do this in ``writelines``
already; on 3.11 (whose ``writelines`` joins) it is done here, through the transport's socket.

.. versionadded:: 0.3
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Sequence
from typing import Final

import anyio.abc

__all__ = ["scatter_transport", "write_parts"]

_MAX_BUFFERS: Final = 512
"""The most parts given to one ``sendmsg`` (the system's limit, IOV_MAX, is 1024 on Linux)."""


def scatter_transport(stream: anyio.abc.ByteStream) -> asyncio.WriteTransport | None:
    """The asyncio transport of ``stream``, anyio's plain TCP stream on asyncio, when
    :func:`write_parts` can write to it; ``None`` otherwise (TLS, another backend): join the
    parts and send them."""
    transport = getattr(stream, "_transport", None)
    if not isinstance(transport, asyncio.WriteTransport) or transport.is_closing():
        return None
    if sys.version_info < (3, 12) and not isinstance(getattr(transport, "_sock", None), socket.socket):
        return None  # not a selector socket transport: no socket to scatter to
    return transport


def write_parts(transport: asyncio.WriteTransport, parts: Sequence[bytes]) -> None:
    """Hand ``parts`` to ``transport``, in order, as one write of their concatenation would,
    without joining them where the socket takes them at once (see the module)."""
    if sys.version_info >= (3, 12):  # pragma: no cover (this project's CI runs 3.11)
        transport.writelines(parts)  # sendmsg, keeping views of the parts
        return
    sock: socket.socket = transport._sock  # type: ignore[attr-defined]
    rest = list(parts)
    if transport.get_write_buffer_size() == 0:  # else the parts queue behind what waits
        while rest:
            buffers = rest[:_MAX_BUFFERS]
            try:
                sent = sock.sendmsg(buffers)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break  # the transport's own write below meets the error and reports it
            if sent == sum(len(part) for part in buffers):
                del rest[: len(buffers)]
                continue
            taken = 0
            while sent >= len(rest[taken]):
                sent -= len(rest[taken])
                taken += 1
            rest = [memoryview(rest[taken])[sent:], *rest[taken + 1 :]]  # type: ignore[list-item]
            break
    for part in rest:
        transport.write(part)
