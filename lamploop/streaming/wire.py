"""The streaming transport's wire format: frames, strict decoding, handshake proofs, a framed stream.

A frame is a 4-byte big-endian length (as on the control channel, :mod:`lamploop.control.wire`)
followed by that many bytes of body.  A body is a 2-byte big-endian length, that many bytes
of UTF-8 JSON (the *header*: an object whose ``"type"`` names the message and whose other
fields are its attributes), then the *payload*: empty for every message but a sample, whose
payload is its tensors as :func:`safetensors.torch.save` writes them.  Nothing is ever
unpickled.  ::

    frame  = u32 body length | body
    body   = u16 header length | header (JSON object) | payload
    sample = {"type":"sample","producer":"sim-3","seq":17} + safetensors bytes

The messages (the header's ``"type"`` in brackets):

===========  =================  ==========================================================
message      direction          meaning
===========  =================  ==========================================================
Challenge    receiver→producer  first frame: the receiver's protocol version and nonce
Hello        producer→receiver  its name, protocol version, nonce, proof of the token
Welcome      receiver→producer  accepted; ``acked_seq`` held already; the receiver's proof
Refuse       receiver→producer  not accepted, or a bad frame: why; then the receiver closes
SampleFrame  producer→receiver  ["sample"] one sample: producer, seq; tensors as payload
Ack          receiver→producer  every seq up to ``upto_seq`` is in the sink (cumulative)
Done         producer→receiver  finished: its last seq is ``last_seq``
Done         receiver→producer  the answer: Done recorded, it holds up to ``last_seq``
===========  =================  ==========================================================

Decoding is strict: unknown types, missing or extra fields, a string where an integer
belongs, an integer out of range, a payload on a message that has none, tensors that do not
decode are all :class:`~lamploop.errors.FrameError`; a :class:`FrameDecoder` also refuses a
frame over its size limit at the 4-byte header (before buffering the body), and, on a
producer's connection, a sample of another producer or a seq that does not increase.

The proofs reuse the control channel's HMAC (:func:`lamploop.control.wire.token_proof`) with
labels of their own, so a proof of one kind is never accepted as another.

.. versionadded:: 0.2
"""

from __future__ import annotations

import json
import logging
import struct
from collections import deque
from collections.abc import Mapping
from typing import Any, Final, TypeAlias

import anyio
import anyio.abc
import attrs
import safetensors.torch
import torch

from lamploop.control._connection import GOODBYE_TIMEOUT, explain, remote
from lamploop.control.wire import HEADER_BYTES, is_nonce, token_proof
from lamploop.errors import ConfigurationError, ControlChannelError, FrameError, StreamingError

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "MAX_PRODUCER_NAME_BYTES",
    "MAX_SEQ",
    "PREAUTH_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "Ack",
    "Challenge",
    "Done",
    "FrameDecoder",
    "FramedStream",
    "Hello",
    "Message",
    "Refuse",
    "SampleFrame",
    "Welcome",
    "check_producer_name",
    "check_token",
    "decode_body",
    "decode_tensors",
    "encode_frame",
    "encode_tensors",
    "producer_proof",
    "receiver_proof",
    "sample_frame",
]

logger = logging.getLogger("lamploop.streaming")

PROTOCOL_VERSION: Final = 1
"""The streaming protocol version; producers that speak another one are refused."""

DEFAULT_MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
"""Default limit on a frame's body (a sample's tensors and its header): 64 MiB."""

PREAUTH_FRAME_BYTES: Final = 4096
"""The largest frame accepted before the peer proved the token (a hello is about 300 bytes)."""

MAX_PRODUCER_NAME_BYTES: Final = 200
"""A producer's name is 1 to 200 bytes of UTF-8, without control characters."""

MAX_SEQ: Final = 2**63 - 1
"""The largest sequence number (they are counted from 0)."""

_FRAME_HEADER = struct.Struct(">I")
_JSON_HEADER = struct.Struct(">H")
_PROOF_CHARS = 128


def check_producer_name(value: object) -> str | None:
    """Why ``value`` cannot name a producer, or ``None`` if it can."""
    if not isinstance(value, str):
        return f"a producer's name is a str, got {type(value).__name__}"
    size = len(value.encode())
    if not 1 <= size <= MAX_PRODUCER_NAME_BYTES:
        return f"a producer's name is 1 to {MAX_PRODUCER_NAME_BYTES} bytes of UTF-8, got {size} bytes"
    if not value.isprintable():
        return f"a producer's name has no control characters, got {value!r:.80}"
    return None


def check_token(token: object) -> bytes:
    """The shared token as bytes; raises ConfigurationError unless a non-empty str or bytes."""
    raw = token.encode() if isinstance(token, str) else token
    if not isinstance(raw, bytes) or not raw:
        msg = f"token must be a non-empty str or bytes, got {type(token).__name__}"
        raise ConfigurationError(msg)
    return raw


def _name(_instance: object, _attribute: object, value: str) -> None:
    reason = check_producer_name(value)
    if reason is not None:
        raise ValueError(reason)


def _seq(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= MAX_SEQ:
        msg = f"{attribute.name} must be in [0, 2**63-1], got {value}"
        raise ValueError(msg)


def _seq_or_none(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not -1 <= value <= MAX_SEQ:
        msg = f"{attribute.name} must be in [-1, 2**63-1] (-1: none), got {value}"
        raise ValueError(msg)


def _nonce(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not is_nonce(value):
        msg = f"{attribute.name} must be 64 lowercase hex digits, got {value!r:.80}"
        raise ValueError(msg)


def _short(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if len(value) > _PROOF_CHARS:
        msg = f"{attribute.name} is at most {_PROOF_CHARS} characters, got {len(value)}"
        raise ValueError(msg)


@attrs.frozen
class Challenge:
    """Receiver → producer, first frame on every connection: its protocol version and nonce."""

    protocol_version: int
    nonce: str = attrs.field(validator=_nonce)


@attrs.frozen
class Hello:
    """Producer → receiver, answering the challenge: who it is, and proof that it knows the token.

    ``proof`` is :func:`producer_proof` of every other field and the receiver's nonce.
    """

    protocol_version: int
    producer: str = attrs.field(validator=_name)
    nonce: str = attrs.field(validator=_nonce)
    proof: str = attrs.field(validator=_short)


@attrs.frozen
class Welcome:
    """Receiver → producer: accepted.

    ``acked_seq`` is the highest seq of this producer the receiver holds with every one
    before it (-1: none), so the producer resends from ``acked_seq + 1``; ``proof``
    (:func:`receiver_proof`) shows the receiver knows the token too.
    """

    acked_seq: int = attrs.field(validator=_seq_or_none)
    proof: str = attrs.field(validator=_short)


@attrs.frozen
class Refuse:
    """Receiver → producer: not accepted, or a bad frame, and why; the receiver closes after it."""

    reason: str


@attrs.frozen
class SampleFrame:
    """Producer → receiver: one sample (its tensors travel as the frame's safetensors payload)."""

    producer: str = attrs.field(validator=_name)
    seq: int = attrs.field(validator=_seq)
    tensors: Mapping[str, torch.Tensor] = attrs.field(eq=False, repr=False)


@attrs.frozen
class Ack:
    """Receiver → producer: every seq up to ``upto_seq`` is in the sink (cumulative)."""

    upto_seq: int = attrs.field(validator=_seq_or_none)


@attrs.frozen
class Done:
    """Either way: the end of a producer's stream.

    Producer → receiver: nothing more comes; ``last_seq`` is its last sample's seq (-1: none).
    Receiver → producer, the answer: the Done is recorded, and the receiver holds every seq up
    to ``last_seq`` (the producer may close: nothing it sent is still unread).
    """

    last_seq: int = attrs.field(validator=_seq_or_none)


Message: TypeAlias = Challenge | Hello | Welcome | Refuse | SampleFrame | Ack | Done
"""Every message of the streaming protocol."""

_SEQ_FIELD: Final = attrs.fields(SampleFrame).seq
_TAGS: Final[dict[type[Any], str]] = {
    Challenge: "challenge",
    Hello: "hello",
    Welcome: "welcome",
    Refuse: "refuse",
    SampleFrame: "sample",
    Ack: "ack",
    Done: "done",
}
_TYPES: Final[dict[str, type[Any]]] = {tag: cls for cls, tag in _TAGS.items()}
_JSON_TYPES: Final = {"int": int, "str": str}
# The header fields of each message and their JSON types (a sample's tensors are its payload).
_FIELDS: Final[dict[type[Any], dict[str, type[Any]]]] = {
    cls: {f.name: _JSON_TYPES[str(f.type)] for f in attrs.fields(cls) if f.name != "tensors"} for cls in _TAGS
}


# -- tensors --


def encode_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The safetensors bytes of a sample's named tensors (moved to the CPU, made contiguous).

    Raises:
        TypeError: ``tensors`` is not a mapping of str to tensors.
        ValueError: it is empty.
    """
    if not isinstance(tensors, Mapping):
        msg = f"a sample's tensors are a mapping of names to tensors, got {type(tensors).__name__}"
        raise TypeError(msg)
    if not tensors:
        msg = "a sample has at least one tensor"
        raise ValueError(msg)
    ready: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            what = f"{type(name).__name__}: {type(tensor).__name__}"
            msg = f"a sample's tensors map str to torch.Tensor, got {what}"
            raise TypeError(msg)
        ready[name] = tensor.detach().to("cpu").contiguous()
    try:
        return safetensors.torch.save(ready)
    except RuntimeError:  # tensors sharing memory (views of one another): safetensors wants copies
        return safetensors.torch.save({name: tensor.clone() for name, tensor in ready.items()})


def decode_tensors(payload: bytes) -> dict[str, torch.Tensor]:
    """The named tensors in ``payload`` (safetensors bytes).

    Raises:
        FrameError: ``payload`` is not safetensors bytes, or holds no tensor.
    """
    try:
        tensors = safetensors.torch.load(payload)
    except Exception as exc:  # hostile bytes: whatever the parser raises, the frame is bad
        msg = f"the sample's tensors do not decode: {type(exc).__name__}: {str(exc).strip():.200}"
        raise FrameError(msg) from exc
    if not tensors:
        msg = "a sample frame holds no tensor"
        raise FrameError(msg)
    return tensors


# -- frames --


def _header(tag: str, fields: dict[str, Any]) -> bytes:
    header = json.dumps({"type": tag, **fields}, sort_keys=True, separators=(",", ":")).encode()
    if len(header) > 0xFFFF:
        msg = f"a {tag!r} header of {len(header)} bytes is over the limit of 65535 bytes"
        raise FrameError(msg)
    return _JSON_HEADER.pack(len(header)) + header


def _frame(body_parts: tuple[bytes, ...], what: str, max_frame_bytes: int) -> bytes:
    length = sum(len(part) for part in body_parts)
    if length > max_frame_bytes:
        msg = f"a {what} frame of {length} bytes is over the limit of {max_frame_bytes} bytes"
        raise FrameError(msg)
    return b"".join((_FRAME_HEADER.pack(length), *body_parts))


def sample_frame(
    producer: str, seq: int, payload: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> bytes:
    """The frame of a sample whose tensors are already encoded (:func:`encode_tensors`).

    Raises:
        FrameError: the frame would be over ``max_frame_bytes``.
    """
    header = _header("sample", {"producer": producer, "seq": seq})
    return _frame((header, payload), "sample", max_frame_bytes)


def encode_frame(message: Message, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """The frame (length prefix, header, payload) of ``message``.

    Raises:
        FrameError: ``message`` is not a streaming message, or its frame is over ``max_frame_bytes``.
    """
    if isinstance(message, SampleFrame):
        payload = encode_tensors(message.tensors)
        return sample_frame(message.producer, message.seq, payload, max_frame_bytes=max_frame_bytes)
    tag = _TAGS.get(type(message))
    if tag is None:
        msg = f"cannot encode {type(message).__name__!r}: not a streaming message"
        raise FrameError(msg)
    header = _header(tag, attrs.asdict(message))
    return _frame((header,), type(message).__name__, max_frame_bytes)


def _reject_constant(name: str) -> Any:
    msg = f"{name} is not valid JSON"
    raise ValueError(msg)


def decode_body(body: bytes) -> Message:
    """The message in one frame's body (without the length prefix).

    Raises:
        FrameError: the header is not a JSON object of a known type with exactly its fields
            of the right types and ranges, a message other than a sample has a payload, or a
            sample's payload does not decode.
    """
    if len(body) < _JSON_HEADER.size:
        msg = f"a frame body of {len(body)} bytes is too short for its header"
        raise FrameError(msg)
    (length,) = _JSON_HEADER.unpack_from(body)
    end = _JSON_HEADER.size + length
    if end > len(body):
        msg = f"a frame's header announces {length} bytes, but the body has only {len(body) - 2}"
        raise FrameError(msg)
    try:
        obj = json.loads(body[_JSON_HEADER.size : end].decode(), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        msg = f"the frame header is not UTF-8 JSON: {exc}"
        raise FrameError(msg) from exc
    if not isinstance(obj, dict):
        msg = f"the frame header is a JSON {type(obj).__name__}, not an object"
        raise FrameError(msg)
    tag = obj.pop("type", None)
    cls = _TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        msg = f"unknown message type {tag!r:.60}"
        raise FrameError(msg)
    fields = _FIELDS[cls]
    if set(obj) != set(fields):
        missing, extra = sorted(set(fields) - set(obj)), sorted(set(obj) - set(fields))
        msg = f"malformed {tag!r} message: missing fields {missing}, extra fields {extra}"[:300]
        raise FrameError(msg)
    for name, expected in fields.items():
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, expected):
            msg = f"malformed {tag!r} message: {name} must be {expected.__name__}, got {value!r:.40}"
            raise FrameError(msg)
    payload = body[end:]
    if cls is not SampleFrame and payload:
        msg = f"a {tag!r} message has no payload, got {len(payload)} bytes after its header"
        raise FrameError(msg)
    try:
        if cls is SampleFrame:
            _seq(None, _SEQ_FIELD, obj["seq"])  # the header is sound before the payload is parsed
            obj["tensors"] = decode_tensors(payload)
        message: Message = cls(**obj)
    except ValueError as exc:
        msg = f"malformed {tag!r} message: {exc}"
        raise FrameError(msg) from exc
    return message


class FrameDecoder:
    """Splits a byte stream into messages; feed it whatever the socket returned.

    The frame's announced length is checked against ``max_frame_bytes`` as soon as the
    4-byte header is complete, so an oversized frame is refused before its body is
    buffered.  Once :attr:`producer` is set (after the handshake), every sample must name
    it, and seqs must increase along the connection.  After a :class:`FrameError` every
    later :meth:`feed` raises again: the stream cannot be resynchronised.
    """

    def __init__(self, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if max_frame_bytes < 1:
            msg = f"max_frame_bytes must be positive, got {max_frame_bytes}"
            raise ValueError(msg)
        self.max_frame_bytes = max_frame_bytes
        self.producer: str | None = None
        self.last_seq: int | None = None
        self._buffer = bytearray()
        self._error: FrameError | None = None

    @property
    def buffered(self) -> int:
        """How many bytes of an incomplete frame wait for the rest."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[tuple[Message, int]]:
        """Add ``data``; return each message it completes with its frame's size, in order.

        Raises:
            FrameError: a header announces more than ``max_frame_bytes``, a body does not
                decode (see :func:`decode_body`), a sample names another producer, or its seq
                does not exceed the previous one; also on any call after one that raised.
        """
        if self._error is not None:
            msg = f"the stream is unusable after an earlier bad frame: {self._error}"
            raise FrameError(msg)
        buffer = self._buffer
        buffer += data
        messages: list[tuple[Message, int]] = []
        offset = 0
        try:
            while len(buffer) - offset >= HEADER_BYTES:
                (length,) = _FRAME_HEADER.unpack_from(buffer, offset)
                if length > self.max_frame_bytes:
                    msg = f"a frame announces {length} bytes, over the limit of {self.max_frame_bytes} bytes"
                    raise FrameError(msg)
                end = offset + HEADER_BYTES + length
                if end > len(buffer):
                    break
                message = decode_body(bytes(buffer[offset + HEADER_BYTES : end]))
                offset = end
                if isinstance(message, SampleFrame):
                    self._check_order(message)
                messages.append((message, HEADER_BYTES + length))
        except FrameError as exc:
            self._error = exc
            buffer.clear()
            raise
        del buffer[:offset]
        return messages

    def _check_order(self, sample: SampleFrame) -> None:
        if self.producer is not None and sample.producer != self.producer:
            msg = f"a sample of producer {sample.producer!r:.80} on the connection of {self.producer!r}"
            raise FrameError(msg)
        if self.last_seq is not None and sample.seq <= self.last_seq:
            msg = f"seq {sample.seq} after seq {self.last_seq}: seqs must increase along a connection"
            raise FrameError(msg)
        self.last_seq = sample.seq


# -- proofs --


def _transcript(hello: Hello) -> bytes:
    """The canonical JSON of every field of ``hello`` but its proof."""
    fields = attrs.asdict(hello)
    del fields["proof"]
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def producer_proof(token: bytes, *, receiver_nonce: str, hello: Hello) -> str:
    """HMAC-SHA256 under ``token`` of the receiver's nonce and ``hello`` (whose own proof is ignored)."""
    return token_proof(token, b"lamploop-stream producer proof", receiver_nonce.encode(), _transcript(hello))


def receiver_proof(token: bytes, *, receiver_nonce: str, hello: Hello, acked_seq: int) -> str:
    """HMAC-SHA256 under ``token`` of the producer's nonce, the receiver's, ``hello`` and ``acked_seq``."""
    return token_proof(
        token,
        b"lamploop-stream receiver proof",
        hello.nonce.encode(),
        receiver_nonce.encode(),
        _transcript(hello),
        str(acked_seq).encode(),
    )


# -- I/O --

_RECEIVE_BYTES = 256 * 1024


class FramedStream:
    """A byte stream that sends frames and receives whole messages.

    Transport errors (``OSError``, anyio's broken or closed resources) become
    :class:`~lamploop.errors.ControlChannelError`; a bad frame raises
    :class:`~lamploop.errors.FrameError`.  The callers bound the time of every call.
    """

    def __init__(self, stream: anyio.abc.ByteStream, *, max_frame_bytes: int, peer: str | None = None):
        self.stream = stream
        self.decoder = FrameDecoder(max_frame_bytes=max_frame_bytes)
        self.last_frame_bytes = 0
        self._peer = peer
        self._pending: deque[tuple[Message, int]] = deque()
        self._ended = False

    @property
    def peer(self) -> str:
        """Who is at the other end, for messages (``host:port`` unless given)."""
        if self._peer is None:
            self._peer = remote(self.stream)
        return self._peer

    @property
    def has_pending(self) -> bool:
        """Whether a message already received waits to be read (the peer's stream is not idle)."""
        return bool(self._pending)

    async def send(self, data: bytes) -> None:
        """Send encoded frames; raises ControlChannelError."""
        try:
            await self.stream.send(data)
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            msg = f"sending to {self.peer} failed: {explain(exc)}"
            raise StreamingError(msg) from exc

    async def receive(self) -> Message | None:
        """The next message, or ``None`` at a clean end of stream; raises ControlChannelError / FrameError."""
        while not self._pending:
            if self._ended:
                return None
            try:
                data = await self.stream.receive(_RECEIVE_BYTES)
            except anyio.EndOfStream:
                self._ended = True
                if self.decoder.buffered:
                    msg = f"{self.peer} closed the connection in the middle of a frame"
                    raise StreamingError(msg) from None
                return None
            except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
                msg = f"receiving from {self.peer} failed: {explain(exc)}"
                raise StreamingError(msg) from exc
            self._pending.extend(self.decoder.feed(data))
        message, self.last_frame_bytes = self._pending.popleft()
        return message

    async def send_best_effort(self, message: Message) -> None:
        """Try to send last words (a Refuse) within :data:`GOODBYE_TIMEOUT`, even in a cancelled scope."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(GOODBYE_TIMEOUT):
            try:
                await self.send(encode_frame(message))
            except ControlChannelError as exc:
                logger.debug("could not tell %s %r: %s", self.peer, message, exc)

    async def aclose(self) -> None:
        """Close at once, also in a cancelled scope."""
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(self.stream)
