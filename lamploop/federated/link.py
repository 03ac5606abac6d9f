"""One authenticated connection between a node and the aggregator: whole messages in and out.

:class:`Link` is the transport's framed connection (:mod:`lamploop.transport.connection`)
over the codec of :mod:`lamploop.federated.wire`; transport errors become
:class:`~lamploop.errors.TransportError`, bad frames :class:`~lamploop.errors.FrameError`.
:func:`accept_node` and :func:`join_aggregator` are the two ends of the transport's handshake
(:mod:`lamploop.transport.handshake`): the aggregator's challenge, the node's hello with an
HMAC proof of the shared token, the aggregator's own proof in its welcome; the aggregator
checks the proof first, then the protocol version (a node has no other fields to check).
Until the peer proved the token a frame may not exceed the transport's
:data:`~lamploop.transport.frames.PREAUTH_FRAME_BYTES`, one frame at a time.  Callers bound
the time of every call.

.. versionadded:: 0.3
"""

from __future__ import annotations

import logging

import anyio
import anyio.abc

from lamploop.errors import HandshakeError
from lamploop.federated.wire import (
    PROTOCOL_VERSION,
    Challenge,
    FrameDecoder,
    Hello,
    Message,
    Refuse,
    Welcome,
    aggregator_proof,
    encode_frame,
    node_proof,
)
from lamploop.transport import frames
from lamploop.transport.connection import FramedConnection
from lamploop.transport.handshake import (
    HelloRules,
    NotAChallenge,
    NotWelcomed,
    Refusal,
    judge_challenge,
    judge_welcome,
    receive_hello,
    version_mismatch,
)
from lamploop.transport.proofs import new_nonce

__all__ = ["RULES", "Link", "accept_node", "join_aggregator"]

logger = logging.getLogger("lamploop.federated")

RULES: HelloRules[Hello] = HelloRules(
    protocol="federated",
    server="the aggregator",
    version=PROTOCOL_VERSION,
    hello_type=Hello,
    expected_proof=lambda token, nonce, hello: node_proof(token, aggregator_nonce=nonce, hello=hello),
    client=lambda hello: f"node {hello.node!r}",
)
"""How the aggregator judges a node's hello (the transport's order of checks)."""


class Link(FramedConnection[Message]):
    """A byte stream that sends and receives whole federated messages."""

    def __init__(
        self, stream: anyio.abc.ByteStream, *, max_frame_bytes: int, peer: str | None = None
    ) -> None:
        preauth = frames.preauth_frame_bytes(max_frame_bytes)
        decoder = FrameDecoder(max_frame_bytes=preauth, one_at_a_time=True)
        super().__init__(stream, decoder, peer=peer)
        self.max_frame_bytes = max_frame_bytes

    async def send(self, message: Message) -> None:
        """Send one message.

        Raises:
            FrameError: it cannot be encoded within the limit.
            TransportError: the connection failed.
        """
        await self.send_frame(encode_frame(message, max_frame_bytes=self.max_frame_bytes))

    async def send_frame(self, data: bytes) -> None:
        """Send a frame encoded already (one round's task, encoded once for every node).

        Raises:
            TransportError: the connection failed.
        """
        await self.send_bytes(data)

    async def receive(self) -> Message | None:
        """The next message, or ``None`` at a clean end of stream.

        Raises:
            FrameError: a bad frame.
            TransportError: the connection failed or ended inside a frame.
        """
        return await self.receive_item()

    async def send_best_effort(self, message: Message) -> None:
        """Try to send last words within a short bound, even in a cancelled scope."""
        await self.last_words(lambda: self.send(message), message)


async def accept_node(link: Link, token: bytes) -> str:
    """The aggregator's end of the handshake; returns the node's name.

    Raises:
        HandshakeError: not a hello, a wrong proof, another protocol version, a bad frame or a
            broken connection (the peer was told why when it proved it speaks the protocol).
    """
    nonce = new_nonce()
    challenge = encode_frame(Challenge(PROTOCOL_VERSION, nonce), max_frame_bytes=link.max_frame_bytes)
    try:
        hello = await receive_hello(link, challenge, RULES, token=token, nonce=nonce)
    except Refusal as exc:
        if exc.reply:
            await link.send_best_effort(Refuse(exc.reason))
        raise HandshakeError(exc.reason) from exc
    await link.send(Welcome(aggregator_proof(token, aggregator_nonce=nonce, hello=hello)))
    link.authenticated(link.max_frame_bytes, name=hello.node)
    return hello.node


async def join_aggregator(link: Link, token: bytes, name: str) -> None:
    """The node's end of the handshake.

    The node checks the challenge's protocol version itself before it answers (the aggregator
    would refuse it, naming both versions, once the node proved the token).

    Raises:
        HandshakeError: refused (the aggregator's reason), another protocol version, or the
            aggregator did not prove the token (it is not the aggregator this node trusts).
        FrameError, TransportError: a bad frame or a broken connection.
    """
    try:
        challenge = judge_challenge(await link.receive(), Challenge)
    except NotAChallenge as exc:
        msg = f"the aggregator at {link.peer} {exc.what}"
        raise HandshakeError(msg) from None
    mismatch = version_mismatch(
        challenge.protocol_version,
        PROTOCOL_VERSION,
        protocol="federated",
        them="the aggregator",
        us="this node",
    )
    if mismatch is not None:
        raise HandshakeError(mismatch)
    unsigned = Hello(PROTOCOL_VERSION, name, new_nonce(), "")
    hello = Hello(
        PROTOCOL_VERSION,
        name,
        unsigned.nonce,
        node_proof(token, aggregator_nonce=challenge.nonce, hello=unsigned),
    )
    await link.send(hello)
    expected = aggregator_proof(token, aggregator_nonce=challenge.nonce, hello=hello)
    try:
        judge_welcome(await link.receive(), Welcome, expected_proof=lambda _welcome: expected)
    except NotWelcomed as exc:
        aggregator = f"the aggregator at {link.peer}"
        if exc.case == "refused":
            msg = f"{aggregator} refused node {name!r}: {exc.detail}"
        elif exc.case == "no welcome":
            msg = f"{aggregator} {exc.detail} instead of a welcome"
        else:
            msg = f"{aggregator} {exc.detail}: not the aggregator this node trusts"
        raise HandshakeError(msg) from None
    link.authenticated(link.max_frame_bytes, name="the aggregator")
