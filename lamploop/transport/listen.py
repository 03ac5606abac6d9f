"""The accept loop of an authenticated TCP server: the control root's, a receiver's, the aggregator's.

All three speak first (a challenge with a nonce), so they share how a connection is taken in:
:func:`serve_tcp` listens on every address family of the host and accepts on the raw
sockets, which costs microseconds; a peer whose bytes (or hang-up) are already there when
its connection is accepted is no client of ours (:func:`~lamploop.transport.strangers.spoke_first`)
and is closed and counted at once, without a stream or a task.  Under TLS the client speaks
first, so that check is skipped.  Every other connection becomes a socket stream (with
``TCP_NODELAY``: the small control frames and acknowledgements go at once) handed to
``on_connection``, which starts the server's own handshake.

.. versionadded:: 0.3
   moved here from the control channel's private modules.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import anyio
import anyio.abc
from anyio.abc import SocketAttribute, TaskStatus

from lamploop.transport.connection import address_text
from lamploop.transport.strangers import RefusalLog, spoke_first

__all__ = ["serve_tcp"]

logger = logging.getLogger("lamploop.control")


async def serve_tcp(
    host: str,
    port: int,
    *,
    on_connection: Callable[[anyio.abc.SocketStream], object],
    refusals: RefusalLog,
    who: str,
    checks_first_bytes: bool,
    task_status: TaskStatus[tuple[str, int]],
) -> None:
    """Listen on ``host:port`` and hand each plausible connection to ``on_connection`` until cancelled.

    Start it with ``await task_group.start(serve_tcp, ...)``: the listening ``(host, port)``
    (the real port when ``port=0``) is what it starts with.

    Args:
        host, port: where to listen.
        on_connection: called (synchronously) with each accepted connection's stream; it owns
            the stream from then on (typically it starts a task to handshake).
        refusals: where connections that spoke first are counted.
        who: the server's name in messages (``"control root"``, ``"sample receiver"``).
        checks_first_bytes: refuse connections whose peer spoke first (not under TLS).

    Raises:
        OSError: the address cannot be listened on (before starting).
    """
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    # One socket listener per address family of the host (create_tcp_listener makes only those).
    sockets = [one for one in listener.listeners if isinstance(one, anyio.abc.SocketListener)]
    async with listener, anyio.create_task_group() as tg:
        for one in sockets:
            tg.start_soon(_accept_forever, one, on_connection, refusals, who, checks_first_bytes)
        address = listener.extra(SocketAttribute.local_address)
        task_status.started((str(address[0]), int(address[1])))


async def _accept_forever(
    listener: anyio.abc.SocketListener,
    on_connection: Callable[[anyio.abc.SocketStream], object],
    refusals: RefusalLog,
    who: str,
    checks_first_bytes: bool,
) -> None:
    raw = listener.extra(SocketAttribute.raw_socket)
    while True:
        try:
            await anyio.wait_readable(raw)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            return
        while True:
            try:
                sock, address = raw.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # e.g. out of file descriptors: keep serving the connected peers
                logger.warning("%s: accepting a connection failed: %s", who, exc)
                await anyio.sleep(0.1)
                break
            if checks_first_bytes and spoke_first(sock):
                refusals.refused(address_text(address), f"it spoke before the {who}'s challenge")
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                stream = await anyio.abc.SocketStream.from_socket(sock)
            except OSError:  # gone meanwhile
                sock.close()
                continue
            on_connection(stream)
