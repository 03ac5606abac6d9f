"""The TCP control channel's wire format, without any I/O (sans-IO).

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON: the
transport's envelope (:mod:`lamploop.transport.envelope`), an object whose ``"type"`` field
names the message and whose other fields are the message's attributes, made and checked by
a strict cattrs converter.  Nothing is ever unpickled.  Both directions enforce a size
limit: :func:`encode_frame` refuses to make a frame over it and :class:`FrameDecoder` (the
transport's, :mod:`lamploop.transport.frames`) refuses one as soon as the 4-byte header
announces it, before buffering the body.

The handshake proofs live here too, as pure functions: HMAC-SHA256 under the shared
token (:func:`lamploop.transport.proofs.token_proof`) over the peer's nonce and a canonical
transcript of the hello message, with labels of the control channel's own.

.. versionadded:: 0.1
"""

from __future__ import annotations

from typing import Any, Final, TypeAlias

import attrs

from lamploop.control.commands import Rendezvous, Stop, Train, Valid
from lamploop.modelspec import ModelSpec, register_model_spec_json
from lamploop.transport import frames
from lamploop.transport.envelope import Envelope, wire_converter
from lamploop.transport.frames import HEADER_BYTES
from lamploop.transport.handshake import Refuse
from lamploop.transport.proofs import (
    NONCE_HEX_CHARS,
    client_proof,
    is_nonce,
    new_nonce,
    proof_matches,
    server_proof,
    token_proof,
)

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "HEADER_BYTES",
    "NONCE_HEX_CHARS",
    "PREAUTH_FLOOR_FACTOR",
    "PROTOCOL_VERSION",
    "Abort",
    "Challenge",
    "ENVELOPE",
    "EndOfMessages",
    "FrameDecoder",
    "Heartbeat",
    "Hello",
    "Interrupt",
    "Message",
    "Refuse",
    "Welcome",
    "decode_body",
    "encode_frame",
    "follower_proof",
    "is_nonce",
    "new_nonce",
    "preauth_frame_limit",
    "proof_matches",
    "root_proof",
    "token_proof",
]

PROTOCOL_VERSION: Final = 3
"""The control protocol version; peers that speak another one are refused.

2 added :class:`Abort`'s ``lost_rank`` and ``how``; 3 its ``detected_by_every_rank``, and
:class:`Interrupt`."""

DEFAULT_MAX_FRAME_BYTES: Final = 4 * 1024 * 1024
"""Default limit on a frame's body: room for the spec of a model with tens of thousands of tensors."""

PREAUTH_FLOOR_FACTOR: Final = 4
"""The root's limit before the token is proved is at least this many times the transport's
:data:`~lamploop.transport.frames.PREAUTH_FRAME_BYTES` (16 KiB): a hello carries a model spec."""


@attrs.frozen
class Challenge:
    """Root -> follower, first frame on every connection: the root's nonce and protocol version."""

    protocol_version: int
    nonce: str


@attrs.frozen
class Hello:
    """Follower -> root, answering the challenge: who it is, and proof that it knows the token.

    ``proof`` is :func:`follower_proof` of every other field and the root's nonce.
    """

    protocol_version: int
    rank: int
    nranks: int
    model_spec: ModelSpec
    nonce: str
    proof: str


@attrs.frozen
class Welcome:
    """Root -> follower: accepted; ``proof`` (:func:`root_proof`) shows the root knows the token too."""

    proof: str


@attrs.frozen
class Heartbeat:
    """Either way, every heartbeat interval once joined: "I am still here"."""


@attrs.frozen
class Abort:
    """Either way: this side is leaving before ``Stop`` (an error, or closed early), and why.

    When the run failed because a rank was lost, ``lost_rank`` and ``how`` name it, so that
    the receiving side blames that rank and not the messenger (protocol version 2).
    ``detected_by_every_rank`` says that the sender failed with an error that every rank
    detects itself at the same point (a NaN loss...; see :mod:`lamploop.errors`): the
    receiving side gives its own work a moment to fail with that error, which it then raises
    instead of this abort (protocol version 3).
    """

    reason: str
    lost_rank: int | None = None
    how: str | None = None
    detected_by_every_rank: bool = False


@attrs.frozen
class Interrupt:
    """Either way, once joined and before ``Stop``: a rank was asked to stop, and why (``"SIGTERM"``).

    Every rank then stops after the step in progress, also one that waits for data and so
    never reaches the step where the request would travel with the example count; the root
    passes a follower's on to the others (protocol version 3).
    """

    reason: str


@attrs.frozen
class EndOfMessages:
    """Either way: nothing more comes from this side, as a TCP half-close would say.

    Sent only on a stream that cannot close one direction (TLS); the receiver reads it as
    the end of the stream.
    """


Message: TypeAlias = (
    Train
    | Valid
    | Stop
    | Rendezvous
    | Challenge
    | Hello
    | Welcome
    | Refuse
    | Heartbeat
    | Abort
    | Interrupt
    | EndOfMessages
)
"""Every message that travels in a frame."""

_TAGS: Final[dict[type[Any], str]] = {
    Train: "train",
    Valid: "valid",
    Stop: "stop",
    Rendezvous: "rendezvous",
    Challenge: "challenge",
    Hello: "hello",
    Welcome: "welcome",
    Refuse: "refuse",
    Heartbeat: "heartbeat",
    Abort: "abort",
    Interrupt: "interrupt",
    EndOfMessages: "end_of_messages",
}


def _converter() -> Any:
    converter = wire_converter()
    register_model_spec_json(converter)
    return converter


ENVELOPE: Final = Envelope("control", _TAGS, _converter())
"""The control channel's messages as the transport's tagged JSON."""


def encode_frame(message: Message, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """The frame (length prefix + JSON body) of ``message``.

    Raises:
        FrameError: ``message`` is not a control message, holds a non-finite number, or
            its body is longer than ``max_frame_bytes``.
    """
    return frames.frame((ENVELOPE.encode(message),), type(message).__name__, max_frame_bytes)


def decode_body(body: bytes | bytearray) -> Message:
    """The message in one frame's body (without the length prefix).

    Raises:
        FrameError: the body is not UTF-8 JSON, not an object, has no known ``"type"``,
            or its fields are missing, extra or of the wrong type.
    """
    message: Message = ENVELOPE.decode(body)
    return message


class FrameDecoder(frames.FrameDecoder[Message]):
    """Splits a byte stream into messages: the transport's decoder (:mod:`lamploop.transport.frames`)
    of control frames; feed it whatever the socket returned."""

    def __init__(
        self, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, one_at_a_time: bool = False
    ) -> None:
        super().__init__(max_frame_bytes=max_frame_bytes, one_at_a_time=one_at_a_time)

    def decode_body(self, body: bytearray) -> Message:
        return decode_body(body)


def preauth_frame_limit(nranks: int, model_spec: ModelSpec, max_frame_bytes: int) -> int:
    """The largest frame a root accepts before the peer has proved the token.

    A follower's hello is the only frame it sends then, and it carries the model spec, so the
    limit is twice the size of a hello with the root's own spec, and at least
    :data:`PREAUTH_FLOOR_FACTOR` times the transport's
    :data:`~lamploop.transport.frames.PREAUTH_FRAME_BYTES` (16 KiB), at most
    ``max_frame_bytes``: a stranger cannot make the root buffer megabytes.  A follower takes
    the root's challenge and welcome under the limit of its own spec.
    """
    proof = "0" * NONCE_HEX_CHARS
    own = len(ENVELOPE.encode(Hello(PROTOCOL_VERSION, 0, nranks, model_spec, proof, proof)))
    return frames.preauth_frame_bytes(max_frame_bytes, hello_bytes=own, floor_factor=PREAUTH_FLOOR_FACTOR)


def follower_proof(token: bytes, *, root_nonce: str, hello: Hello) -> str:
    """HMAC-SHA256 under ``token`` of the root's nonce and ``hello`` (whose own proof is ignored)."""
    transcript = ENVELOPE.transcript(hello, tagged=True)
    return client_proof(
        token, b"lamploop-control follower proof", server_nonce=root_nonce, transcript=transcript
    )


def root_proof(token: bytes, *, root_nonce: str, hello: Hello) -> str:
    """HMAC-SHA256 under ``token`` of the follower's nonce, the root's nonce and ``hello``.

    A label distinct from :func:`follower_proof`'s keeps a follower's proof from being
    reflected back to it as the root's.
    """
    transcript = ENVELOPE.transcript(hello, tagged=True)
    return server_proof(
        token,
        b"lamploop-control root proof",
        client_nonce=hello.nonce,
        server_nonce=root_nonce,
        transcript=transcript,
    )
