"""The producer's side of the streaming handshake, and the connection it is made on.

:func:`connect` opens a connection to a receiver (with the transport's pre-authentication
limit, one frame at a time); :func:`greet` runs the client's side of the transport's handshake
(:mod:`lamploop.transport.handshake`): the challenge (its version checked here, before
answering), the hello with the proof of the token, then the receiver's
:class:`~lamploop.streaming.wire.Redirect` (with a proof of its own), or the transport's checks
of a Refuse or a Welcome, whose proof must match
(:func:`~lamploop.transport.handshake.judge_welcome`).  What can be tried again raises
:class:`ConnectionLost`; what cannot, :class:`~lamploop.errors.HandshakeError`.

.. versionadded:: 0.3
   split from :mod:`lamploop.streaming.producer`.
"""

from __future__ import annotations

import ssl

import anyio
import anyio.abc
import attrs

from lamploop.errors import HandshakeError, TransportError
from lamploop.streaming.wire import (
    PROTOCOL_VERSION,
    Challenge,
    FramedStream,
    Hello,
    Redirect,
    Welcome,
    encode_frame,
    producer_proof,
    receiver_proof,
    redirect_proof,
)
from lamploop.transport import frames, tls
from lamploop.transport.handshake import (
    NotAChallenge,
    NotWelcomed,
    judge_challenge,
    judge_welcome,
    version_mismatch,
)
from lamploop.transport.proofs import new_nonce, proof_matches

__all__ = ["ConnectionLost", "Redirected", "connect", "greet"]


class ConnectionLost(Exception):
    """The connection was lost or could not be made; try again (the message says why)."""


class Redirected(Exception):
    """The receiver sent this producer to another one, at :attr:`address`."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(f"{host}:{port}")
        self.address = (host, port)


async def connect(
    address: tuple[str, int], *, receiver: str, handshake_timeout: float, max_frame_bytes: int
) -> FramedStream:
    """A connection to the receiver at ``address`` (``receiver`` names it in messages).

    Raises:
        ConnectionLost: it cannot be reached within ``handshake_timeout`` seconds.
    """
    try:
        with anyio.fail_after(handshake_timeout):
            stream: anyio.abc.ByteStream = await anyio.connect_tcp(*address)
    except OSError as exc:  # TimeoutError included
        raise ConnectionLost(f"{receiver} is not reachable: {type(exc).__name__}: {exc}") from exc
    limit = frames.preauth_frame_bytes(max_frame_bytes)
    return FramedStream(stream, max_frame_bytes=limit, peer=receiver, one_at_a_time=True)


async def greet(
    conn: FramedStream,
    *,
    name: str,
    token: bytes,
    ssl_context: ssl.SSLContext | None,
    host: str,
    receiver: str,
    handshake_timeout: float,
) -> Welcome:
    """The producer ``name``'s side of the handshake, within ``handshake_timeout`` s; the receiver's welcome.

    Raises:
        HandshakeError: the receiver refused this producer, did not prove the token, or
            speaks another protocol version; or TLS failed for good.
        Redirected: the receiver sent this producer to another receiver.
        ConnectionLost: the connection failed, or the receiver did not answer in time.
    """
    try:
        with anyio.fail_after(handshake_timeout):
            if ssl_context is not None:
                conn.stream = await _secure(conn.stream, ssl_context, name=name, host=host, receiver=receiver)
            try:
                challenge = judge_challenge(await conn.receive(), Challenge)
            except NotAChallenge as exc:
                raise ConnectionLost(f"{receiver} {exc.what}") from None
            mismatch = version_mismatch(
                challenge.protocol_version,
                PROTOCOL_VERSION,
                protocol="streaming",
                them=receiver,
                us="this producer",
            )
            if mismatch is not None:
                raise HandshakeError(f"producer {name!r}: {mismatch}")
            hello = Hello(PROTOCOL_VERSION, name, new_nonce(), proof="")
            hello = attrs.evolve(
                hello, proof=producer_proof(token, receiver_nonce=challenge.nonce, hello=hello)
            )
            await conn.send(encode_frame(hello))
            reply = await conn.receive()
    except TimeoutError as exc:
        msg = f"{receiver} did not finish the handshake in {handshake_timeout:g} s"
        raise ConnectionLost(msg) from exc
    except HandshakeError:
        raise
    except TransportError as exc:  # transport errors and bad frames
        raise ConnectionLost(str(exc)) from exc
    if isinstance(reply, Redirect):  # streaming's own answer, with a proof of its own
        expected = redirect_proof(
            token, receiver_nonce=challenge.nonce, hello=hello, host=reply.host, port=reply.port
        )
        if not proof_matches(expected, reply.proof):
            msg = f"producer {name!r}: {receiver} redirected it without proving the shared token"
            raise HandshakeError(msg)
        raise Redirected(reply.host, reply.port)

    def welcome_proof(welcome: Welcome) -> str:  # the welcome's own fields are proved too
        return receiver_proof(
            token,
            receiver_nonce=challenge.nonce,
            hello=hello,
            acked_seq=welcome.acked_seq,
            max_frame_bytes=welcome.max_frame_bytes,
        )

    try:
        return judge_welcome(reply, Welcome, expected_proof=welcome_proof)
    except NotWelcomed as exc:
        if exc.case == "refused":
            raise HandshakeError(f"producer {name!r} refused by {receiver}: {exc.detail}") from None
        if exc.case == "no welcome":  # a hang-up or a confused receiver: try again
            raise ConnectionLost(f"{receiver} {exc.detail} instead of answering the hello") from None
        msg = f"producer {name!r}: {receiver} {exc.detail} (another token?)"
        raise HandshakeError(msg) from None


async def _secure(
    stream: anyio.abc.ByteStream, context: ssl.SSLContext, *, name: str, host: str, receiver: str
) -> anyio.abc.ByteStream:
    try:
        return await tls.wrap(stream, context, server_side=False, hostname=host)
    except TransportError as exc:
        if isinstance(exc.__cause__, ssl.SSLError):  # a certificate not trusted, no TLS there: for good
            question = f"is {receiver} a sample receiver with TLS, and is its certificate trusted?"
            msg = f"producer {name!r}: {exc} ({question})"
            raise HandshakeError(msg) from exc
        raise  # a reset or a hang-up: try again
