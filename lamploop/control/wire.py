"""The TCP control channel's wire format, without any I/O (sans-IO).

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON: an
object whose ``"type"`` field names the message and whose other fields are the
message's attributes, made and checked by a strict cattrs converter.  Nothing is ever
unpickled.  Both directions enforce a size limit: :func:`encode_frame` refuses to make
a frame over it and :class:`FrameDecoder` refuses one as soon as the 4-byte header
announces it, before buffering the body.

The handshake proofs live here too, as pure functions: HMAC-SHA256 under the shared
token over the peer's nonce and a canonical transcript of the hello message.

.. versionadded:: 0.1
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import struct
from collections.abc import Callable
from typing import Any, Final, TypeAlias

import attrs
import cattrs

from lamploop.control.commands import Rendezvous, Stop, Train, Valid
from lamploop.errors import FrameError
from lamploop.modelspec import ModelSpec, register_model_spec_json

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "HEADER_BYTES",
    "NONCE_HEX_CHARS",
    "PROTOCOL_VERSION",
    "Abort",
    "Challenge",
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

HEADER_BYTES: Final = 4
"""Size of the big-endian unsigned length prefix of every frame."""

DEFAULT_MAX_FRAME_BYTES: Final = 4 * 1024 * 1024
"""Default limit on a frame's body: room for the spec of a model with tens of thousands of tensors."""

NONCE_HEX_CHARS: Final = 64
"""A nonce is 32 random bytes, written as 64 lowercase hex digits."""

_HEADER = struct.Struct(">I")


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
class Refuse:
    """Root -> follower: not accepted, and why; the root closes the connection after it."""

    reason: str


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
_TYPES: Final[dict[str, type[Any]]] = {tag: cls for cls, tag in _TAGS.items()}


def _strict(expected: type[Any] | tuple[type[Any], ...], name: str) -> Callable[[Any, Any], Any]:
    """A structure hook that accepts only JSON values of the exact type (no ``"1"`` -> 1, no bools)."""

    def hook(value: Any, _type: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, expected):
            msg = f"expected {name}, got {type(value).__name__} {value!r:.40}"
            raise TypeError(msg)
        return value

    return hook


def _strict_bool(value: Any, _type: Any) -> bool:
    """A structure hook that accepts only JSON ``true`` and ``false``."""
    if not isinstance(value, bool):
        msg = f"expected a boolean, got {type(value).__name__} {value!r:.40}"
        raise TypeError(msg)
    return value


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(bool, _strict_bool)
    converter.register_structure_hook(int, _strict(int, "an integer"))
    converter.register_structure_hook(float, _strict((int, float), "a number"))
    converter.register_structure_hook(str, _strict(str, "a string"))
    register_model_spec_json(converter)
    return converter


_converter: Final = _make_converter()


def _reject_constant(name: str) -> Any:
    msg = f"{name} is not valid JSON"
    raise ValueError(msg)


def _unstructure(message: Message) -> dict[str, Any]:
    tag = _TAGS.get(type(message))
    if tag is None:
        msg = f"cannot encode {type(message).__name__!r}: not a control message"
        raise FrameError(msg)
    body: dict[str, Any] = _converter.unstructure(message)
    return {"type": tag, **body}


def _dump(obj: dict[str, Any]) -> bytes:
    try:
        return json.dumps(obj, allow_nan=False, sort_keys=True, separators=(",", ":")).encode()
    except ValueError as exc:
        msg = f"cannot encode {obj.get('type')!r} message: {exc}"
        raise FrameError(msg) from exc


def encode_frame(message: Message, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """The frame (length prefix + JSON body) of ``message``.

    Raises:
        FrameError: ``message`` is not a control message, holds a non-finite number, or
            its body is longer than ``max_frame_bytes``.
    """
    body = _dump(_unstructure(message))
    if len(body) > max_frame_bytes:
        name = type(message).__name__
        msg = f"a {name} frame of {len(body)} bytes is over the limit of {max_frame_bytes} bytes"
        raise FrameError(msg)
    return _HEADER.pack(len(body)) + body


def _describe_one(exc: BaseException, _type: Any = None) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc}"
    return str(exc) or type(exc).__name__


def _describe_structure_error(exc: Exception) -> str:
    if isinstance(exc, cattrs.BaseValidationError):
        return "; ".join(cattrs.transform_error(exc, format_exception=_describe_one))
    return _describe_one(exc)


def decode_body(body: bytes) -> Message:
    """The message in one frame's body (without the length prefix).

    Raises:
        FrameError: the body is not UTF-8 JSON, not an object, has no known ``"type"``,
            or its fields are missing, extra or of the wrong type.
    """
    try:
        obj = json.loads(body.decode(), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        msg = f"the frame body is not UTF-8 JSON: {exc}"
        raise FrameError(msg) from exc
    if not isinstance(obj, dict):
        msg = f"the frame body is a JSON {type(obj).__name__}, not an object"
        raise FrameError(msg)
    tag = obj.pop("type", None)
    cls = _TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        msg = f"unknown message type {tag!r:.60}"
        raise FrameError(msg)
    try:
        message: Message = _converter.structure(obj, cls)
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError) as exc:
        detail = _describe_structure_error(exc)
        msg = f"malformed {tag!r} message: {detail}"
        raise FrameError(msg) from exc
    return message


class FrameDecoder:
    """Splits a byte stream into messages; feed it whatever the socket returned.

    The decoder checks each frame's announced length against ``max_frame_bytes`` as soon
    as the 4-byte header is complete, so an oversized frame is refused before its body
    is buffered.  After a :class:`FrameError` the stream cannot be resynchronised: every
    later :meth:`feed` raises again.
    """

    def __init__(self, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if max_frame_bytes < 1:
            msg = f"max_frame_bytes must be positive, got {max_frame_bytes}"
            raise ValueError(msg)
        self._max = max_frame_bytes
        self._buffer = bytearray()
        self._body_length: int | None = None
        self._error: FrameError | None = None

    @property
    def max_frame_bytes(self) -> int:
        """The current limit on a frame's body."""
        return self._max

    @max_frame_bytes.setter
    def max_frame_bytes(self, value: int) -> None:
        """Change the limit (the root raises it once a peer has proved the token)."""
        if value < 1:
            msg = f"max_frame_bytes must be positive, got {value}"
            raise ValueError(msg)
        self._max = value

    @property
    def buffered(self) -> int:
        """How many bytes of an incomplete frame are waiting for the rest."""
        return len(self._buffer) + (HEADER_BYTES if self._body_length is not None else 0)

    def feed(self, data: bytes) -> list[Message]:
        """Add ``data``; return the messages of every frame it completes, in order.

        Raises:
            FrameError: a header announces more than ``max_frame_bytes``, or a body does
                not decode (see :func:`decode_body`); also on any call after one that raised.
        """
        if self._error is not None:
            msg = f"the stream is unusable after an earlier bad frame: {self._error}"
            raise FrameError(msg)
        self._buffer += data
        messages: list[Message] = []
        try:
            while True:
                if self._body_length is None:
                    if len(self._buffer) < HEADER_BYTES:
                        break
                    (length,) = _HEADER.unpack_from(self._buffer)
                    if length > self._max:
                        msg = f"a frame announces {length} bytes, over the limit of {self._max} bytes"
                        raise FrameError(msg)
                    del self._buffer[:HEADER_BYTES]
                    self._body_length = length
                if len(self._buffer) < self._body_length:
                    break
                body = bytes(self._buffer[: self._body_length])
                del self._buffer[: self._body_length]
                self._body_length = None
                messages.append(decode_body(body))
        except FrameError as exc:
            self._error = exc
            self._buffer.clear()
            raise
        return messages


def preauth_frame_limit(nranks: int, model_spec: ModelSpec, max_frame_bytes: int) -> int:
    """The largest frame a root accepts before the peer has proved the token.

    A follower's hello is the only frame it sends then, and it carries the model spec, so the
    limit is twice the size of a hello with the root's own spec (at least 16 KiB, at most
    ``max_frame_bytes``): a stranger cannot make the root buffer megabytes.
    """
    proof = "0" * NONCE_HEX_CHARS
    own = len(_dump(_unstructure(Hello(PROTOCOL_VERSION, 0, nranks, model_spec, proof, proof))))
    return min(max_frame_bytes, max(16 * 1024, 2 * own))


def new_nonce() -> str:
    """A fresh random nonce (32 bytes from :mod:`secrets`, as hex)."""
    return secrets.token_hex(NONCE_HEX_CHARS // 2)


def is_nonce(value: str) -> bool:
    """Whether ``value`` looks like a :func:`new_nonce` (64 lowercase hex digits)."""
    return len(value) == NONCE_HEX_CHARS and all(c in "0123456789abcdef" for c in value)


def _transcript(hello: Hello) -> bytes:
    """The canonical JSON of every field of ``hello`` but its proof."""
    fields = _unstructure(hello)
    del fields["proof"]
    return _dump(fields)


def _mac(token: bytes, *parts: bytes) -> str:
    mac = hmac.new(token, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(_HEADER.pack(len(part)) + part)
    return mac.hexdigest()


def token_proof(token: bytes, label: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 under ``token`` of ``label`` and ``parts``, each length-prefixed, as hex.

    The generic form of :func:`follower_proof` and :func:`root_proof`, for other handshakes
    that prove the same kind of shared token (the streaming transport's).  Give every kind of
    proof its own ``label``, so that one cannot be replayed or reflected as another.
    """
    return _mac(token, label, *parts)


def follower_proof(token: bytes, *, root_nonce: str, hello: Hello) -> str:
    """HMAC-SHA256 under ``token`` of the root's nonce and ``hello`` (whose own proof is ignored)."""
    return _mac(token, b"lamploop-control follower proof", root_nonce.encode(), _transcript(hello))


def root_proof(token: bytes, *, root_nonce: str, hello: Hello) -> str:
    """HMAC-SHA256 under ``token`` of the follower's nonce, the root's nonce and ``hello``.

    A label distinct from :func:`follower_proof`'s keeps a follower's proof from being
    reflected back to it as the root's.
    """
    return _mac(
        token, b"lamploop-control root proof", hello.nonce.encode(), root_nonce.encode(), _transcript(hello)
    )


def proof_matches(expected: str, received: str) -> bool:
    """Constant-time comparison of two proofs (any string is accepted as ``received``)."""
    return hmac.compare_digest(expected.encode(), received.encode())
