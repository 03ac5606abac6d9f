"""A frame given in parts, written to a socket without joining the parts first.

A batch of large samples is a few large parts (each sample's encoded tensors) and small ones
(headers, padding): joining them into one ``bytes`` copies every sample once more before the
socket copies it again.  :func:`write_parts` hands the parts to the socket itself, in one
``sendmsg`` (scatter/gather I/O) where the event loop's transport lets it (asyncio's selector
transport, on a platform with ``sendmsg``), and what the socket does not take at once to the
transport's own buffer, so that the transport's flow control and errors hold as for a plain
write.  (Python 3.11's ``writelines`` joins the parts; 3.12's uses ``sendmsg`` but, before a fix
in later patch releases, skipped the transport's flow control: neither is used.)

.. versionadded:: 0.3
"""

from __future__ import annotations

import asyncio
import socket
from asyncio import selector_events
from collections.abc import Sequence
from typing import Final, cast

import anyio.abc

__all__ = ["SELECTOR_SOCKET_TRANSPORT", "scatter_transport", "write_parts"]

_MAX_BUFFERS: Final = 512
"""The most parts given to one ``sendmsg`` (the system's limit, IOV_MAX, is 1024 on Linux)."""
_HAS_SENDMSG: Final = hasattr(socket.socket, "sendmsg")  # not on Windows
SELECTOR_SOCKET_TRANSPORT: Final[type] = selector_events._SelectorSocketTransport  # type: ignore[attr-defined]
"""asyncio's socket transport of its selector event loops (private; its ``_sock`` is the socket)."""


def scatter_transport(stream: anyio.abc.ByteStream) -> asyncio.WriteTransport | None:
    """The asyncio transport of ``stream``, anyio's plain TCP stream on asyncio's selector event
    loop, when :func:`write_parts` can write to its socket; ``None`` otherwise (TLS, a proactor
    or uvloop transport, a platform without ``sendmsg``, another backend): join the parts and
    send them."""
    transport = getattr(stream, "_transport", None)
    if not _HAS_SENDMSG or not isinstance(transport, SELECTOR_SOCKET_TRANSPORT):
        return None
    selector_transport = cast("asyncio.WriteTransport", transport)
    if selector_transport.is_closing() or not isinstance(getattr(transport, "_sock", None), socket.socket):
        return None
    return selector_transport


def write_parts(transport: asyncio.WriteTransport, parts: Sequence[bytes]) -> None:
    """Hand ``parts`` to ``transport`` (from :func:`scatter_transport`), in order, as one write of
    their concatenation would, without joining them where the socket takes them at once (see
    the module).

    Raises:
        OSError: the socket failed (nothing more is written; the caller drops the connection).
    """
    sock: socket.socket = transport._sock  # type: ignore[attr-defined]
    rest: list[bytes | memoryview] = list(parts)
    if transport.get_write_buffer_size() == 0:  # else the parts queue behind what waits
        while rest:
            buffers = rest[:_MAX_BUFFERS]
            try:
                sent = sock.sendmsg(buffers)
            except (BlockingIOError, InterruptedError):
                break
            if sent == sum(len(part) for part in buffers):
                del rest[: len(buffers)]
                continue
            taken = 0
            while sent >= len(rest[taken]):
                sent -= len(rest[taken])
                taken += 1
            rest = [memoryview(rest[taken])[sent:], *rest[taken + 1 :]]
            break
    for part in rest:
        if transport.is_closing():  # a write failed: the stream's send raises its error
            break
        transport.write(part)
