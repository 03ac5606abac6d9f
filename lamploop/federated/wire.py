"""The federated transport's wire format, without I/O: messages, frames, strict decoding, proofs.

The frame layout is the streaming transport's (:mod:`lamploop.streaming.wire`): a 4-byte
big-endian body length (the transport's frame, :mod:`lamploop.transport.frames`), then the
body: a 2-byte big-endian length, that many bytes of UTF-8 JSON (the *header*: the
transport's envelope, :mod:`lamploop.transport.envelope`, whose ``"type"`` names the
message), then the *payload*: tensors in
the safetensors format (:func:`encode_tensors`; a round's global model, a node's
parameters), read by safetensors' own parser, empty for every other message.  Nothing is
ever unpickled.

===============  ==================  ====================================================
message          direction           meaning
===============  ==================  ====================================================
Challenge        aggregator → node   first frame: protocol version and the aggregator's nonce
Hello            node → aggregator   the node's name, nonce and proof of the shared token
Welcome          aggregator → node   accepted; the aggregator's proof of the token
Refuse           either way          not accepted, or a bad frame: why; then the sender closes
RoundTask        aggregator → node   round number, the plan (JSON); the global model as payload
RoundReply       node → aggregator   sample count, timings, validation; parameters as payload
RoundRefused     node → aggregator   the node will not train this round, and why
Finish           aggregator → node   the run is over (or failed): why
===============  ==================  ====================================================

Decoding is strict: an unknown type, a missing or extra field, a string where a number
belongs, a payload where none belongs, tensors that do not decode: :class:`FrameError`.  A
:class:`FrameDecoder` (the transport's) refuses a frame over its size limit at the 4-byte
header, before buffering the body; the limit is small, and frames are decoded one at a time,
until the peer has proved the token.

.. versionadded:: 0.3
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from typing import Any, Final, TypeAlias

import attrs
import cattrs
import safetensors.torch
import torch

from lamploop.errors import FrameError
from lamploop.safetensors_layout import safetensors_parts
from lamploop.transport import frames
from lamploop.transport.envelope import Envelope, exact_type, wire_converter
from lamploop.transport.handshake import Challenge, Refuse
from lamploop.transport.proofs import (
    MAX_NAME_BYTES,
    check_name,
    client_proof,
    name_validator,
    nonce_validator,
    server_proof,
)

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "PREAUTH_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "Challenge",
    "Evaluation",
    "Finish",
    "FrameDecoder",
    "Hello",
    "Message",
    "Refuse",
    "RoundRefused",
    "RoundReply",
    "RoundTask",
    "Welcome",
    "aggregator_proof",
    "check_node_name",
    "decode_body",
    "decode_tensors",
    "encode_frame",
    "encode_tensors",
    "in_order",
    "node_proof",
]

PROTOCOL_VERSION: Final = 1
"""The federated protocol version; peers that speak another one are refused."""

DEFAULT_MAX_FRAME_BYTES: Final = 256 * 1024 * 1024
"""Default limit on a frame's body once the peer proved the token (a model's tensors): 256 MiB."""

PREAUTH_FRAME_BYTES: Final = frames.PREAUTH_FRAME_BYTES
"""The transport's limit on a frame before the peer proved the token (a hello is about 300
bytes), as it was when this module was imported; a link reads the transport's at each connection."""

MAX_NODE_NAME_BYTES: Final = MAX_NAME_BYTES
"""A node's name is 1 to 200 bytes of UTF-8 without control characters."""

_JSON_HEADER = struct.Struct(">H")


def in_order(tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """``tensors`` in the order of ``names`` (safetensors sorts them by name), others after them."""
    ordered = {name: tensors[name] for name in names if name in tensors}
    ordered.update((name, tensor) for name, tensor in tensors.items() if name not in ordered)
    return ordered


def check_node_name(value: object) -> str | None:
    """Why ``value`` cannot name a node, or ``None`` if it can (the transport's :func:`check_name`)."""
    return check_name(value, "node")


_name = name_validator("node")


def _non_negative(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
        msg = f"{attribute.name} must be finite and >= 0, got {value!r}"
        raise ValueError(msg)


@attrs.frozen
class Hello:
    """Node → aggregator: who it is, and :func:`node_proof` that it knows the token."""

    protocol_version: int
    node: str = attrs.field(validator=_name)
    nonce: str = attrs.field(validator=nonce_validator)
    proof: str


@attrs.frozen
class Welcome:
    """Aggregator → node: accepted; ``proof`` (:func:`aggregator_proof`) shows it knows the token too."""

    proof: str


@attrs.frozen
class RoundTask:
    """Aggregator → node: train round ``round`` of ``plan`` from ``tensors`` (the global model)."""

    round: int = attrs.field(validator=_non_negative)
    plan: dict[str, Any]
    tensors: Mapping[str, torch.Tensor] = attrs.field(eq=False, repr=False)


@attrs.frozen
class Evaluation:
    """A validation pass on a node's own data: mean loss, metric means, and how many examples."""

    loss: float
    metrics: dict[str, float]
    examples: int


@attrs.frozen
class RoundReply:
    """Node → aggregator: the parameters after local training (payload) and aggregate statistics.

    Attributes:
        round: the round answered.
        plan_hash: the hash of the plan trained (the aggregator checks it is the round's).
        sample_count: the examples trained on in this round (FedAvg's weight).
        train_wall_s: wall-clock seconds of local training.
        train_cpu_s: CPU seconds of this process during local training.
        before: validation of the received global model (``None``: the node has no validation data).
        after: validation after local training.
        training_loss: mean training loss of the round's local training.
    """

    round: int = attrs.field(validator=_non_negative)
    plan_hash: str
    sample_count: int = attrs.field(validator=_non_negative)
    train_wall_s: float = attrs.field(validator=_non_negative)
    train_cpu_s: float = attrs.field(validator=_non_negative)
    training_loss: float
    before: Evaluation | None
    after: Evaluation | None
    tensors: Mapping[str, torch.Tensor] = attrs.field(eq=False, repr=False)


@attrs.frozen
class RoundRefused:
    """Node → aggregator: the node does not train round ``round``, and why.

    ``not_approved`` is true when the plan's hash is not on the node's allow-list (else the
    node could not read the plan, build its model, or train it).
    """

    round: int
    plan_hash: str
    reason: str
    not_approved: bool = False


@attrs.frozen
class Finish:
    """Aggregator → node: the run is over; ``failed`` when it ended in an error (``reason`` says which)."""

    reason: str
    failed: bool = False


Message: TypeAlias = Challenge | Hello | Welcome | Refuse | RoundTask | RoundReply | RoundRefused | Finish
"""Every message of the federated protocol."""

_TAGS: Final[dict[type[Any], str]] = {
    Challenge: "challenge",
    Hello: "hello",
    Welcome: "welcome",
    Refuse: "refuse",
    RoundTask: "round_task",
    RoundReply: "round_reply",
    RoundRefused: "round_refused",
    Finish: "finish",
}
_WITH_TENSORS: Final = (RoundTask, RoundReply)


def _is_tensors(t: Any) -> bool:
    return bool(t == Mapping[str, torch.Tensor])


def _make_converter() -> cattrs.Converter:
    converter = wire_converter()
    converter.register_structure_hook_func(lambda t: t == dict[str, Any], exact_type(dict, "an object"))
    # Tensors travel as the payload, not in the JSON header: the codec handles them itself.
    converter.register_structure_hook_func(_is_tensors, lambda value, _type: value)
    converter.register_unstructure_hook_func(_is_tensors, lambda _value: {})
    return converter


ENVELOPE: Final = Envelope("federated", _TAGS, _make_converter(), part="header")
"""The federated messages' headers as the transport's tagged JSON."""


# -- tensors --


def encode_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The safetensors bytes of named tensors (detached, on the CPU, contiguous, unshared).

    The common dtypes are written here, in the format's layout (an 8-byte little-endian
    header length, the JSON header padded with spaces to 8 bytes, then each tensor's
    little-endian bytes, back to back in the header's order): under half of
    ``safetensors.torch.save``'s time on a small model, which a round pays once per frame.
    Other dtypes, or a big-endian machine, go through ``safetensors.torch.save``.  Either
    way :func:`decode_tensors` (safetensors' own parser) reads them.

    Raises:
        FrameError: a name is not a str or a value is not a tensor.
    """
    ready: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            msg = f"tensors map str to torch.Tensor, got {type(name).__name__}: {type(tensor).__name__}"
            raise FrameError(msg)
        ready[name] = tensor.detach().to("cpu").contiguous()
    parts = safetensors_parts(ready)
    if parts is not None:
        return b"".join(parts)
    try:
        return safetensors.torch.save(ready)
    except RuntimeError:  # tensors sharing memory (tied weights): safetensors wants copies
        return safetensors.torch.save({name: tensor.clone() for name, tensor in ready.items()})


def decode_tensors(payload: bytes) -> dict[str, torch.Tensor]:
    """The named tensors in ``payload`` (safetensors bytes).

    Raises:
        FrameError: ``payload`` is not safetensors bytes.
    """
    try:
        return safetensors.torch.load(payload)
    except Exception as exc:  # hostile bytes: whatever the parser raises, the frame is bad
        msg = f"the tensors do not decode: {type(exc).__name__}: {str(exc).strip():.200}"
        raise FrameError(msg) from exc


# -- frames --


def encode_frame(message: Message, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """The frame (length prefix, header, payload) of ``message``.

    Raises:
        FrameError: not a federated message, a non-finite number in it, or a frame over
            ``max_frame_bytes``.
    """
    fields = ENVELOPE.fields(message)
    payload = b""
    if isinstance(message, _WITH_TENSORS):
        del fields["tensors"]
        payload = encode_tensors(message.tensors)
    raw = ENVELOPE.dump(fields)
    if len(raw) > 0xFFFF:
        msg = f"a {type(message).__name__} header of {len(raw)} bytes is over the limit of 65535 bytes"
        raise FrameError(msg)
    return frames.frame((_JSON_HEADER.pack(len(raw)), raw, payload), type(message).__name__, max_frame_bytes)


def decode_body(body: bytes) -> Message:
    """The message in one frame's body (without the length prefix).

    Raises:
        FrameError: see the module doc.
    """
    if len(body) < _JSON_HEADER.size:
        msg = f"a frame body of {len(body)} bytes is too short for its header"
        raise FrameError(msg)
    (length,) = _JSON_HEADER.unpack_from(body)
    end = _JSON_HEADER.size + length
    if end > len(body):
        msg = f"a frame's header announces {length} bytes, but the body has only {len(body) - 2}"
        raise FrameError(msg)
    cls, tag, obj = ENVELOPE.parse(body[_JSON_HEADER.size : end])
    payload = body[end:]
    if cls in _WITH_TENSORS:
        if "tensors" in obj:
            msg = f"malformed {tag!r} message: tensors travel as the payload, not in the header"
            raise FrameError(msg)
        obj["tensors"] = {}
    elif payload:
        msg = f"a {tag!r} message has no payload, got {len(payload)} bytes after its header"
        raise FrameError(msg)
    message: Message = ENVELOPE.structure(obj, cls, tag)
    if isinstance(message, _WITH_TENSORS):
        message = attrs.evolve(message, tensors=decode_tensors(payload))
    return message


class FrameDecoder(frames.FrameDecoder[Message]):
    """Splits a byte stream into messages: the transport's decoder (:mod:`lamploop.transport.frames`)
    of federated frames; feed it whatever the socket returned.

    With :attr:`one_at_a_time` (before the peer proved the token) a call decodes one frame
    at most and keeps the rest: the limit may be lifted before the next frame is looked at
    (an aggregator's welcome and its first round's task can arrive in one read).
    """

    def decode_body(self, body: bytearray) -> Message:
        return decode_body(bytes(body))


# -- proofs --


def node_proof(token: bytes, *, aggregator_nonce: str, hello: Hello) -> str:
    """HMAC-SHA256 under ``token`` of the aggregator's nonce and ``hello`` (its own proof ignored)."""
    transcript = ENVELOPE.transcript(hello, tagged=False)
    return client_proof(
        token, b"lamploop-federated node proof", server_nonce=aggregator_nonce, transcript=transcript
    )


def aggregator_proof(token: bytes, *, aggregator_nonce: str, hello: Hello) -> str:
    """HMAC-SHA256 under ``token`` of the node's nonce, the aggregator's nonce and ``hello``."""
    transcript = ENVELOPE.transcript(hello, tagged=False)
    label = b"lamploop-federated aggregator proof"
    return server_proof(
        token, label, client_nonce=hello.nonce, server_nonce=aggregator_nonce, transcript=transcript
    )
