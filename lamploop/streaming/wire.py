"""The streaming transport's wire format: frames, strict decoding, handshake proofs, a framed stream.

A frame is a 4-byte big-endian length (the transport's frame, :mod:`lamploop.transport.frames`)
followed by that many bytes of body.  A body is a 2-byte big-endian length, that many bytes
of UTF-8 JSON (the *header*: the transport's envelope, :mod:`lamploop.transport.envelope`, an
object whose ``"type"`` names the message and whose other fields are its attributes), then
the *payload*: empty for every message but a batch of
samples, whose payload is each sample's tensors as safetensors bytes
(:mod:`lamploop.streaming.tensor_bytes`), one after the other, each starting 8-aligned
(zero bytes pad the previous one; the header is padded with spaces so that the payload
starts 8-aligned in the body).  Nothing is ever unpickled.  ::

    frame   = u32 body length | body
    body    = u16 header length | header (JSON object) | payload
    samples = {"type":"samples","producer":"sim-3","first_seq":17,"sizes":[65672,65672]}
              + safetensors bytes of seq 17 | pad to 8 | safetensors bytes of seq 18 | pad to 8

The messages (the header's ``"type"`` in brackets):

============  =================  ==========================================================
message       direction          meaning
============  =================  ==========================================================
Challenge     receiver→producer  first frame: the receiver's protocol version and nonce
Hello         producer→receiver  its name, protocol version, nonce, proof of the token
Welcome       receiver→producer  accepted; ``acked_seq`` held already, the largest frame
                                 it takes; the receiver's proof
Redirect      receiver→producer  go to the receiver at ``host:port`` (same token); with proof
Refuse        receiver→producer  not accepted, or a bad frame: why; then the receiver closes
SamplesFrame  producer→receiver  ["samples"] consecutive samples ``first_seq``, ``first_seq``
                                 + 1, ... of one producer; their tensors as payload
Ack           receiver→producer  every seq up to ``upto_seq`` is in the sink (cumulative)
Done          producer→receiver  finished: its last seq is ``last_seq``
Done          receiver→producer  the answer: Done recorded, it holds up to ``last_seq``
============  =================  ==========================================================

Version 2 (this one) replaced version 1's one-sample ``"sample"`` frames by ``"samples"``
batches, and added ``max_frame_bytes`` to the Welcome and the Redirect message; a producer
or receiver of another version is refused with both versions named.

Decoding is strict: unknown types, missing or extra fields, a string where an integer
belongs, an integer out of range, a payload on a message that has none, sizes that do not
match the payload, tensors that do not decode are all :class:`~lamploop.errors.FrameError`;
a :class:`FrameDecoder` (the transport's) also refuses a frame over its size limit at the
4-byte header (before buffering the body), takes one frame at a time until the peer proved
the token, and, on a producer's connection, refuses a sample of another producer or a seq
that does not increase.  The header's fields are checked here, by hand, not by a converter:
a batch's header is decoded for every frame, and this is the hot path of a stream.

A batch's payload is decoded by :mod:`lamploop.streaming.samples_payload`: the samples that
share one safetensors header together, as views of the received bytes or of one copy of each
run of 8 samples or 64 KiB (so that a sample kept long holds its run, not a whole frame).

The proofs are the transport's HMAC (:func:`lamploop.transport.proofs.token_proof`) with
labels of their own, so a proof of one kind is never accepted as another; the handshake and
its order of checks are the transport's (:mod:`lamploop.transport.handshake`).

.. versionadded:: 0.2
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.abc
import attrs

from lamploop.errors import FrameError, StreamingError
from lamploop.streaming.samples_payload import (
    MAX_SAMPLES_PER_FRAME,
    RUN_TAKEN_BYTES,
    decode_samples,
    payload_offsets,
    run_lengths,
    take_samples,
)
from lamploop.streaming.tensor_bytes import decode_tensors, encode_rows, encode_tensors
from lamploop.streaming.wire_messages import (
    _FIELDS,
    DEFAULT_MAX_FRAME_BYTES,
    ENVELOPE,
    MAX_PRODUCER_NAME_BYTES,
    MAX_SEQ,
    PREAUTH_FRAME_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Done,
    Hello,
    Message,
    Redirect,
    SamplesFrame,
    Welcome,
    _seq,
    check_producer_name,
)
from lamploop.streaming.wire_proofs import producer_proof, receiver_proof, redirect_proof
from lamploop.transport import frames
from lamploop.transport.connection import FramedConnection
from lamploop.transport.frames import HEADER_BYTES
from lamploop.transport.handshake import Challenge, Refuse
from lamploop.transport.proofs import check_token

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "MAX_PRODUCER_NAME_BYTES",
    "MAX_SAMPLES_PER_FRAME",
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
    "Redirect",
    "Refuse",
    "SamplesFrame",
    "Welcome",
    "check_producer_name",
    "check_token",
    "decode_body",
    "decode_tensors",
    "encode_frame",
    "encode_rows",
    "encode_tensors",
    "producer_proof",
    "receiver_proof",
    "redirect_proof",
    "sample_frame",
    "samples_frame",
    "samples_frame_bytes",
    "samples_frame_parts",
]

logger = logging.getLogger("lamploop.streaming")

_JSON_HEADER = struct.Struct(">H")
_ALIGN = 8
_PADDING = bytes(_ALIGN)


# -- frames --


def _header(tag: str, fields: dict[str, Any], *, align: bool = False) -> bytes:
    header = ENVELOPE.dump({"type": tag, **fields})
    if align:  # JSON may end with spaces: they put the payload at an 8-aligned offset in the body
        header += b" " * (-(_JSON_HEADER.size + len(header)) % _ALIGN)
    if len(header) > 0xFFFF:
        msg = f"a {tag!r} header of {len(header)} bytes is over the limit of 65535 bytes"
        raise FrameError(msg)
    return _JSON_HEADER.pack(len(header)) + header


def _frame(body_parts: Sequence[bytes], what: str, max_frame_bytes: int) -> bytes:
    return frames.frame(body_parts, what, max_frame_bytes)


def samples_frame_bytes(producer: str, first_seq: int, sizes: Sequence[int]) -> int:
    """The size of the frame :func:`samples_frame` makes of payloads of these ``sizes``
    (length prefix included), without making it."""
    header = _header(
        "samples", {"first_seq": first_seq, "producer": producer, "sizes": list(sizes)}, align=True
    )
    return HEADER_BYTES + len(header) + sum(size + (-size % _ALIGN) for size in sizes)


def samples_frame(
    producer: str,
    first_seq: int,
    payloads: Sequence[bytes],
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> bytes:
    """The frame of consecutive samples whose tensors are already encoded (:func:`encode_tensors`).

    Raises:
        FrameError: no payload or more than :data:`MAX_SAMPLES_PER_FRAME`, or the frame would
            be over ``max_frame_bytes``.
    """
    return _frame(_samples_body(producer, first_seq, payloads), "samples", max_frame_bytes)


def samples_frame_parts(
    producer: str,
    first_seq: int,
    payloads: Sequence[bytes],
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> list[bytes]:
    """:func:`samples_frame` as parts whose concatenation is its bytes, large payloads not
    copied (:func:`~lamploop.transport.frames.frame_parts`), for
    :meth:`~lamploop.transport.connection.FramedConnection.send_parts`.

    Raises:
        FrameError: as :func:`samples_frame`.
    """
    return frames.frame_parts(_samples_body(producer, first_seq, payloads), "samples", max_frame_bytes)


def _samples_body(producer: str, first_seq: int, payloads: Sequence[bytes]) -> list[bytes]:
    if not 1 <= len(payloads) <= MAX_SAMPLES_PER_FRAME:
        msg = f"a samples frame holds 1 to {MAX_SAMPLES_PER_FRAME} samples, got {len(payloads)}"
        raise FrameError(msg)
    sizes = [len(payload) for payload in payloads]
    parts = [_header("samples", {"first_seq": first_seq, "producer": producer, "sizes": sizes}, align=True)]
    for payload in payloads:
        parts.append(payload)
        if len(payload) % _ALIGN:
            parts.append(_PADDING[: -len(payload) % _ALIGN])
    return parts


def sample_frame(
    producer: str, seq: int, payload: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> bytes:
    """The frame of one sample whose tensors are already encoded: :func:`samples_frame` of one.

    Raises:
        FrameError: the frame would be over ``max_frame_bytes``.
    """
    return samples_frame(producer, seq, [payload], max_frame_bytes=max_frame_bytes)


def encode_frame(message: Message, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """The frame (length prefix, header, payload) of ``message``.

    Raises:
        FrameError: ``message`` is not a streaming message, or its frame is over ``max_frame_bytes``.
    """
    if isinstance(message, SamplesFrame):
        payloads = [encode_tensors(tensors) for tensors in message.samples]
        return samples_frame(message.producer, message.first_seq, payloads, max_frame_bytes=max_frame_bytes)
    header = _header(ENVELOPE.tag_of(message), attrs.asdict(message))
    return _frame((header,), type(message).__name__, max_frame_bytes)


def decode_body(body: bytes | bytearray) -> Message:
    """The message in one frame's body (without the length prefix).

    A batch's tensors are views of ``body`` when it is a ``bytearray`` (they keep it alive),
    except in a batch of more than 8 samples and 64 KiB of one kind, whose runs of that many
    are copied first (one copy per run), and for samples under 1/8 of a body of samples of
    several kinds, which are copied out; from ``bytes``, copies.  (A :class:`FrameDecoder`
    copies such runs straight from the received bytes instead, without gathering the body.)

    Raises:
        FrameError: the header is not a JSON object of a known type with exactly its fields
            of the right types and ranges, a message other than a batch of samples has a
            payload, or a batch's sizes do not match its payload or a sample does not decode.
    """
    if len(body) < _JSON_HEADER.size:
        msg = f"a frame body of {len(body)} bytes is too short for its header"
        raise FrameError(msg)
    (length,) = _JSON_HEADER.unpack_from(body)
    end = _header_end(length, len(body))
    cls, tag, obj = _parse_header(body[_JSON_HEADER.size : end])
    if cls is not SamplesFrame:
        return _message(cls, tag, obj, len(body) - end)
    _check_first_seq(tag, obj)
    obj["samples"], obj["signatures"] = decode_samples(body, end, obj.pop("sizes"))
    return _message(cls, tag, obj, 0)


def _header_end(length: int, body_length: int) -> int:
    end = _JSON_HEADER.size + length
    if end > body_length:
        msg = f"a frame's header announces {length} bytes, but the body has only {body_length - 2}"
        raise FrameError(msg)
    return end


def _parse_header(raw: bytes | bytearray) -> tuple[type[Any], str, dict[str, Any]]:
    """The class, tag and fields of a header, each field present and of its JSON type."""
    cls, tag, obj = ENVELOPE.parse(raw)
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
    return cls, tag, obj


def _check_first_seq(tag: str, obj: dict[str, Any]) -> None:
    """A batch's first seq in range, checked before its payload is decoded."""
    try:
        _seq(None, attrs.fields(SamplesFrame).first_seq, obj["first_seq"])
    except ValueError as exc:
        msg = f"malformed {tag!r} message: {exc}"
        raise FrameError(msg) from exc


def _message(cls: type[Any], tag: str, obj: dict[str, Any], payload: int) -> Message:
    """The message of ``cls`` with the fields ``obj`` (``payload``: bytes after a header that has none)."""
    if cls is not SamplesFrame and payload:
        msg = f"a {tag!r} message has no payload, got {payload} bytes after its header"
        raise FrameError(msg)
    try:
        message: Message = cls(**obj)
    except ValueError as exc:
        msg = f"malformed {tag!r} message: {exc}"
        raise FrameError(msg) from exc
    return message


class FrameDecoder(frames.FrameDecoder[tuple[Message, int]]):
    """Splits a byte stream into messages, each with its frame's size: the transport's decoder
    (:mod:`lamploop.transport.frames`) of streaming frames; feed it whatever the socket returned.

    Each body is gathered into a ``bytearray`` of its own (one copy of the received bytes),
    which the samples' tensors then view.  Once :attr:`producer` is set (after the
    handshake), every batch must name it, and seqs must increase along the connection.
    """

    def __init__(
        self, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, one_at_a_time: bool = False
    ) -> None:
        super().__init__(max_frame_bytes=max_frame_bytes, one_at_a_time=one_at_a_time)
        self.producer: str | None = None
        self.last_seq: int | None = None

    def decode_body(self, body: bytearray) -> tuple[Message, int]:
        message = decode_body(body)
        if isinstance(message, SamplesFrame):
            self._check_order(message)
        return message, HEADER_BYTES + len(body)

    def plan_body(self, length: int) -> tuple[int, list[int]] | None:
        """A large batch read straight into its memory: its header gathered, then each run of
        samples that :func:`~lamploop.streaming.samples_payload.take_samples` takes apart in
        memory of its own (the payload whole, if it takes no runs); ``None`` until the header is
        here.  Any other frame, or a header that does not decode (:meth:`decode_frame` says
        why), is one part."""
        if length <= RUN_TAKEN_BYTES:
            return 0, [length]
        head = self.peek(_JSON_HEADER.size)
        if head is None:
            return None
        (size,) = _JSON_HEADER.unpack(head)
        end = _JSON_HEADER.size + size
        if end >= length:
            return 0, [length]
        raw = self.peek(end)
        if raw is None:
            return None
        try:
            cls, _tag, obj = _parse_header(raw[_JSON_HEADER.size :])
            if cls is not SamplesFrame:
                return 0, [length]
            payload_offsets(end, length - end, obj["sizes"])
        except FrameError:
            return 0, [length]
        runs = run_lengths(obj["sizes"])
        return end, runs if runs is not None else [length - end]

    def decode_frame(self, length: int) -> tuple[Message, int]:
        """:meth:`decode_body` of the next frame, taking its header and payload apart from the
        received chunks (so that a batch's runs are copied once, straight into their memory)."""
        if length <= RUN_TAKEN_BYTES:  # no run to copy apart: one take costs less than three
            return self.decode_body(self.take(length))
        (size,) = _JSON_HEADER.unpack(self.take(_JSON_HEADER.size))
        end = _header_end(size, length)
        cls, tag, obj = _parse_header(self.take(size))
        if cls is not SamplesFrame:
            return _message(cls, tag, obj, length - end), HEADER_BYTES + length
        _check_first_seq(tag, obj)
        obj["samples"], obj["signatures"] = take_samples(self.take, end, length - end, obj.pop("sizes"))
        message = _message(cls, tag, obj, 0)
        assert isinstance(message, SamplesFrame)
        self._check_order(message)
        return message, HEADER_BYTES + length

    def _check_order(self, batch: SamplesFrame) -> None:
        if self.producer is not None and batch.producer != self.producer:
            msg = f"a sample of producer {batch.producer!r:.80} on the connection of {self.producer!r}"
            raise FrameError(msg)
        if self.last_seq is not None and batch.first_seq <= self.last_seq:
            msg = f"seq {batch.first_seq} after seq {self.last_seq}: seqs must increase along a connection"
            raise FrameError(msg)
        self.last_seq = batch.last_seq


# -- I/O --


class FramedStream(FramedConnection[tuple[Message, int]]):
    """The transport's framed connection over streaming frames: frames out, whole messages in.

    ``max_frame_bytes`` is the limit on received frames to begin with; with ``one_at_a_time``
    (until the peer proved the token) one frame is decoded per read, and
    :meth:`~lamploop.transport.connection.FramedConnection.authenticated` lifts both.
    Transport errors become :class:`~lamploop.errors.StreamingError`; a bad frame raises
    :class:`~lamploop.errors.FrameError`.  The callers bound the time of every call.
    """

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        *,
        max_frame_bytes: int,
        peer: str | None = None,
        one_at_a_time: bool = False,
    ):
        decoder = FrameDecoder(max_frame_bytes=max_frame_bytes, one_at_a_time=one_at_a_time)
        super().__init__(stream, decoder, peer=peer, error=StreamingError)
        self.decoder: FrameDecoder = decoder
        self.last_frame_bytes = 0

    async def send(self, data: bytes) -> None:
        """Send encoded frames; raises StreamingError."""
        await self.send_bytes(data)

    async def receive(self) -> Message | None:
        """The next message, or ``None`` at a clean end of stream; raises StreamingError / FrameError."""
        item = await self.receive_item()
        if item is None:
            return None
        message, self.last_frame_bytes = item
        return message

    async def send_best_effort(self, message: Message) -> None:
        """Try to send last words (a Refuse) within a short bound, even in a cancelled scope."""
        await self.last_words(lambda: self.send(encode_frame(message)), message)
