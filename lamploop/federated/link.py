"""One authenticated connection between a node and the aggregator: whole messages in and out.

:class:`Link` wraps an anyio byte stream (TCP, or TLS over it) with the sans-IO codec of
:mod:`lamploop.federated.wire`; transport errors become
:class:`~lamploop.errors.ControlChannelError`, bad frames :class:`~lamploop.errors.FrameError`.
:func:`accept_node` and :func:`join_aggregator` are the two ends of the handshake, the
control channel's (:mod:`lamploop.control.wire`): the aggregator's challenge, the node's
hello with an HMAC proof of the shared token, the aggregator's own proof in its welcome.
Until the proof checks out a frame may not exceed
:data:`~lamploop.federated.wire.PREAUTH_FRAME_BYTES`.  Callers bound the time of every call.

.. versionadded:: 0.3
"""

from __future__ import annotations

import logging

import anyio
import anyio.abc

from lamploop.control._framed import FramedBytes
from lamploop.control.wire import new_nonce, proof_matches
from lamploop.errors import HandshakeError
from lamploop.federated.wire import (
    PREAUTH_FRAME_BYTES,
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

__all__ = ["Link", "accept_node", "join_aggregator"]

logger = logging.getLogger("lamploop.federated")


class Link(FramedBytes[Message]):
    """A byte stream that sends and receives whole federated messages."""

    def __init__(
        self, stream: anyio.abc.ByteStream, *, max_frame_bytes: int, peer: str | None = None
    ) -> None:
        decoder = FrameDecoder(max_frame_bytes=min(max_frame_bytes, PREAUTH_FRAME_BYTES), one_at_a_time=True)
        super().__init__(stream, decoder, peer=peer)
        self.decoder: FrameDecoder = decoder
        self.max_frame_bytes = max_frame_bytes

    def authenticated(self, name: str) -> None:
        """The peer proved the token: name it and lift the frame limit to ``max_frame_bytes``."""
        self._peer = name
        self.decoder.max_frame_bytes = self.max_frame_bytes
        self.decoder.one_at_a_time = False

    async def send(self, message: Message) -> None:
        """Send one message.

        Raises:
            FrameError: it cannot be encoded within the limit.
            ControlChannelError: the connection failed.
        """
        await self.send_frame(encode_frame(message, max_frame_bytes=self.max_frame_bytes))

    async def send_frame(self, data: bytes) -> None:
        """Send a frame encoded already (one round's task, encoded once for every node).

        Raises:
            ControlChannelError: the connection failed.
        """
        await self.send_bytes(data)

    async def receive(self) -> Message | None:
        """The next message, or ``None`` at a clean end of stream.

        Raises:
            FrameError: a bad frame.
            ControlChannelError: the connection failed or ended inside a frame.
        """
        return await self.receive_item()

    async def send_best_effort(self, message: Message) -> None:
        """Try to send last words within a short bound, even in a cancelled scope."""
        await self.last_words(lambda: self.send(message), message)


async def accept_node(link: Link, token: bytes) -> str:
    """The aggregator's end of the handshake; returns the node's name.

    Raises:
        HandshakeError: a wrong protocol version, a wrong proof, or not a hello (the peer was
            told why, as far as it listens).
        FrameError, ControlChannelError: garbage, an oversized frame, a broken connection.
    """
    nonce = new_nonce()
    await link.send(Challenge(PROTOCOL_VERSION, nonce))
    hello = await link.receive()
    if hello is None:
        msg = f"{link.peer} closed the connection before its hello"
        raise HandshakeError(msg)
    if not isinstance(hello, Hello):
        msg = f"{link.peer} sent a {type(hello).__name__} instead of a hello"
        await link.send_best_effort(Refuse(msg))
        raise HandshakeError(msg)
    if hello.protocol_version != PROTOCOL_VERSION:
        version = hello.protocol_version
        msg = f"{link.peer} speaks protocol version {version}, this aggregator {PROTOCOL_VERSION}"
        await link.send_best_effort(Refuse(msg))
        raise HandshakeError(msg)
    if not proof_matches(node_proof(token, aggregator_nonce=nonce, hello=hello), hello.proof):
        msg = f"{link.peer} (calling itself {hello.node!r}) did not prove the token: wrong token"
        await link.send_best_effort(Refuse("wrong token"))
        raise HandshakeError(msg)
    await link.send(Welcome(aggregator_proof(token, aggregator_nonce=nonce, hello=hello)))
    link.authenticated(hello.node)
    return hello.node


async def join_aggregator(link: Link, token: bytes, name: str) -> None:
    """The node's end of the handshake.

    Raises:
        HandshakeError: refused (the aggregator's reason), or the aggregator did not prove the
            token (it is not the aggregator this node trusts).
        FrameError, ControlChannelError: a bad frame or a broken connection.
    """
    challenge = await link.receive()
    if not isinstance(challenge, Challenge):
        what = "closed the connection" if challenge is None else f"sent a {type(challenge).__name__}"
        msg = f"the aggregator at {link.peer} {what} instead of a challenge"
        raise HandshakeError(msg)
    if challenge.protocol_version != PROTOCOL_VERSION:
        version = challenge.protocol_version
        msg = f"the aggregator speaks protocol version {version}, this node {PROTOCOL_VERSION}"
        raise HandshakeError(msg)
    unsigned = Hello(PROTOCOL_VERSION, name, new_nonce(), "")
    hello = Hello(
        PROTOCOL_VERSION,
        name,
        unsigned.nonce,
        node_proof(token, aggregator_nonce=challenge.nonce, hello=unsigned),
    )
    await link.send(hello)
    answer = await link.receive()
    if isinstance(answer, Refuse):
        msg = f"the aggregator at {link.peer} refused node {name!r}: {answer.reason}"
        raise HandshakeError(msg)
    if not isinstance(answer, Welcome):
        what = "closed the connection" if answer is None else f"sent a {type(answer).__name__}"
        msg = f"the aggregator at {link.peer} {what} instead of a welcome"
        raise HandshakeError(msg)
    if not proof_matches(
        aggregator_proof(token, aggregator_nonce=challenge.nonce, hello=hello), answer.proof
    ):
        msg = f"the aggregator at {link.peer} did not prove the token: not the aggregator this node trusts"
        raise HandshakeError(msg)
    link.authenticated("the aggregator")
