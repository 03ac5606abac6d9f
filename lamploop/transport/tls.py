"""Optional TLS on the control channel, with the standard library's :mod:`ssl`.

The token's mutual proof already authenticates both ends and keeps strangers out; TLS
adds confidentiality of the commands and, with certificates the user manages, a second
authentication.  The connection is wrapped before lamploop's own handshake; TLS cannot
close one direction of a stream, so there an ``EndOfMessages`` frame stands in for the
half-close that ends a run (see :meth:`Connection.send_eof`).  Peers need not send
TLS's ``close_notify`` (``standard_compatible=False``): the protocol's own messages say
when a run ends.
"""

from __future__ import annotations

import ssl

import anyio
import anyio.abc
from anyio.streams.tls import TLSStream

from lamploop.errors import ConfigurationError, TransportError
from lamploop.transport.connection import explain, remote

__all__ = ["check_context", "wrap"]


def check_context(name: str, context: object, *, server_side: bool) -> ssl.SSLContext | None:
    """``context`` if it is ``None`` or an :class:`ssl.SSLContext` for the right side, else a clear error."""
    if context is None:
        return None
    if not isinstance(context, ssl.SSLContext):
        msg = f"{name} must be an ssl.SSLContext or None, not {type(context).__name__}"
        raise ConfigurationError(msg)
    wanted = ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT
    if context.protocol not in (wanted, ssl.PROTOCOL_TLS):
        side = "a server" if server_side else "a client"
        msg = f"{name} must be {side} context (ssl.{wanted.name}), not ssl.{context.protocol.name}"
        raise ConfigurationError(msg)
    return context


async def wrap(
    stream: anyio.abc.ByteStream, context: ssl.SSLContext, *, server_side: bool, hostname: str | None = None
) -> TLSStream:
    """The TLS stream over ``stream`` once the TLS handshake is done; the caller bounds the time.

    Raises:
        TransportError: the TLS handshake failed (a certificate not trusted, a peer that
            does not speak TLS, a hang-up); the message says why.
    """
    peer = remote(stream)  # before the handshake: a failed one may close the socket
    try:
        return await TLSStream.wrap(
            stream,
            server_side=server_side,
            hostname=hostname,
            ssl_context=context,
            standard_compatible=False,
        )
    except (OSError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:  # ssl.SSLError is an OSError
        msg = f"the TLS handshake with {peer} failed: {explain(exc)}"
        raise TransportError(msg) from exc
