"""The federated transport's wire format, without I/O: messages, frames, strict decoding, proofs.

The frame layout is the streaming transport's (:mod:`lamploop.streaming.wire`): a 4-byte
big-endian body length, then the body: a 2-byte big-endian length, that many bytes of UTF-8
JSON (the *header*, whose ``"type"`` names the message), then the *payload*: tensors in
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
:class:`FrameDecoder` refuses a frame over its size limit at the 4-byte header, before
buffering the body; the limit is small until the peer has proved the token.

.. versionadded:: 0.3
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from typing import Any, Final, TypeAlias

import attrs
import cattrs
import safetensors.torch
import torch

from lamploop.control.wire import HEADER_BYTES, is_nonce, token_proof
from lamploop.errors import FrameError
from lamploop.safetensors_layout import safetensors_parts

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

PREAUTH_FRAME_BYTES: Final = 4096
"""The largest frame accepted before the peer proved the token (a hello is about 300 bytes)."""

MAX_NODE_NAME_BYTES: Final = 200
"""A node's name is 1 to 200 bytes of UTF-8 without control characters."""

_FRAME_HEADER = struct.Struct(">I")
_JSON_HEADER = struct.Struct(">H")


def in_order(tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """``tensors`` in the order of ``names`` (safetensors sorts them by name), others after them."""
    ordered = {name: tensors[name] for name in names if name in tensors}
    ordered.update((name, tensor) for name, tensor in tensors.items() if name not in ordered)
    return ordered


def check_node_name(value: object) -> str | None:
    """Why ``value`` cannot name a node, or ``None`` if it can."""
    if not isinstance(value, str):
        return f"a node's name is a str, got {type(value).__name__}"
    size = len(value.encode())
    if not 1 <= size <= MAX_NODE_NAME_BYTES:
        return f"a node's name is 1 to {MAX_NODE_NAME_BYTES} bytes of UTF-8, got {size} bytes"
    if not value.isprintable():
        return f"a node's name has no control characters, got {value!r:.80}"
    return None


def _name(_: object, __: object, value: str) -> None:
    reason = check_node_name(value)
    if reason is not None:
        raise ValueError(reason)


def _nonce(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not is_nonce(value):
        msg = f"{attribute.name} must be 64 lowercase hex digits, got {value!r:.80}"
        raise ValueError(msg)


def _non_negative(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
        msg = f"{attribute.name} must be finite and >= 0, got {value!r}"
        raise ValueError(msg)


@attrs.frozen
class Challenge:
    """Aggregator → node, first frame on every connection: its protocol version and nonce."""

    protocol_version: int
    nonce: str = attrs.field(validator=_nonce)


@attrs.frozen
class Hello:
    """Node → aggregator: who it is, and :func:`node_proof` that it knows the token."""

    protocol_version: int
    node: str = attrs.field(validator=_name)
    nonce: str = attrs.field(validator=_nonce)
    proof: str


@attrs.frozen
class Welcome:
    """Aggregator → node: accepted; ``proof`` (:func:`aggregator_proof`) shows it knows the token too."""

    proof: str


@attrs.frozen
class Refuse:
    """Either way: not accepted, or a bad frame, and why; the sender closes after it."""

    reason: str


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
_TYPES: Final[dict[str, type[Any]]] = {tag: cls for cls, tag in _TAGS.items()}
_WITH_TENSORS: Final = (RoundTask, RoundReply)


def _strict(expected: type[Any] | tuple[type[Any], ...], name: str) -> Any:
    def hook(value: Any, _type: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, expected):
            msg = f"expected {name}, got {type(value).__name__} {value!r:.40}"
            raise TypeError(msg)
        return value

    return hook


def _float(value: Any, _type: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        msg = f"expected a number, got {type(value).__name__} {value!r:.40}"
        raise TypeError(msg)
    return float(value)


def _bool(value: Any, _type: Any) -> bool:
    if not isinstance(value, bool):
        msg = f"expected true or false, got {type(value).__name__} {value!r:.40}"
        raise TypeError(msg)
    return value


def _is_tensors(t: Any) -> bool:
    return bool(t == Mapping[str, torch.Tensor])


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _strict(int, "an integer"))
    converter.register_structure_hook(float, _float)
    converter.register_structure_hook(str, _strict(str, "a string"))
    converter.register_structure_hook(bool, _bool)
    converter.register_structure_hook_func(lambda t: t == dict[str, Any], _strict(dict, "an object"))
    # Tensors travel as the payload, not in the JSON header: the codec handles them itself.
    converter.register_structure_hook_func(_is_tensors, lambda value, _type: value)
    converter.register_unstructure_hook_func(_is_tensors, lambda _value: {})
    return converter


_CONVERTER: Final = _make_converter()


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
    tag = _TAGS.get(type(message))
    if tag is None:
        msg = f"cannot encode {type(message).__name__!r}: not a federated message"
        raise FrameError(msg)
    fields: dict[str, Any] = _CONVERTER.unstructure(message)
    payload = b""
    if isinstance(message, _WITH_TENSORS):
        del fields["tensors"]
        payload = encode_tensors(message.tensors)
    try:
        header = json.dumps({"type": tag, **fields}, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError as exc:
        msg = f"cannot encode a {type(message).__name__}: {exc}"
        raise FrameError(msg) from exc
    raw = header.encode()
    if len(raw) > 0xFFFF:
        msg = f"a {type(message).__name__} header of {len(raw)} bytes is over the limit of 65535 bytes"
        raise FrameError(msg)
    length = _JSON_HEADER.size + len(raw) + len(payload)
    if length > max_frame_bytes:
        msg = (
            f"a {type(message).__name__} frame of {length} bytes is over the limit of {max_frame_bytes} bytes"
        )
        raise FrameError(msg)
    return b"".join((_FRAME_HEADER.pack(length), _JSON_HEADER.pack(len(raw)), raw, payload))


def _reject_constant(name: str) -> Any:
    msg = f"{name} is not valid JSON"
    raise ValueError(msg)


def _describe(exc: BaseException, _type: Any = None) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc}"
    return str(exc) or type(exc).__name__


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
    payload = body[end:]
    if cls in _WITH_TENSORS:
        if "tensors" in obj:
            msg = f"malformed {tag!r} message: tensors travel as the payload, not in the header"
            raise FrameError(msg)
        obj["tensors"] = {}
    elif payload:
        msg = f"a {tag!r} message has no payload, got {len(payload)} bytes after its header"
        raise FrameError(msg)
    try:
        message: Message = _CONVERTER.structure(obj, cls)
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError) as exc:
        if isinstance(exc, cattrs.BaseValidationError):
            detail = "; ".join(cattrs.transform_error(exc, format_exception=_describe))
        else:
            detail = _describe(exc)
        msg = f"malformed {tag!r} message: {detail}"[:400]
        raise FrameError(msg) from exc
    if isinstance(message, _WITH_TENSORS):
        message = attrs.evolve(message, tensors=decode_tensors(payload))
    return message


class FrameDecoder:
    """Splits a byte stream into messages; feed it whatever the socket returned.

    The announced length is checked against :attr:`max_frame_bytes` as soon as the 4-byte
    header is complete.  After a :class:`FrameError` every later :meth:`feed` raises again.
    With :attr:`one_at_a_time` (before the peer proved the token) a call decodes one frame
    at most and keeps the rest: the limit may be lifted before the next frame is looked at
    (an aggregator's welcome and its first round's task can arrive in one read).
    """

    def __init__(self, *, max_frame_bytes: int, one_at_a_time: bool = False) -> None:
        if max_frame_bytes < 1:
            msg = f"max_frame_bytes must be positive, got {max_frame_bytes}"
            raise ValueError(msg)
        self.max_frame_bytes = max_frame_bytes
        self.one_at_a_time = one_at_a_time
        self._buffer = bytearray()
        self._error: FrameError | None = None

    @property
    def buffered(self) -> int:
        """How many bytes of an incomplete frame wait for the rest."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Message]:
        """Add ``data``; return the messages of every frame it completes, in order.

        Raises:
            FrameError: a frame over the limit or one that does not decode; also on any
                call after one that raised.
        """
        if self._error is not None:
            msg = f"the stream is unusable after an earlier bad frame: {self._error}"
            raise FrameError(msg)
        buffer = self._buffer
        buffer += data
        messages: list[Message] = []
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
                messages.append(decode_body(bytes(buffer[offset + HEADER_BYTES : end])))
                offset = end
                if self.one_at_a_time:
                    break
        except FrameError as exc:
            self._error = exc
            buffer.clear()
            raise
        del buffer[:offset]
        return messages


# -- proofs --


def _transcript(hello: Hello) -> bytes:
    fields = attrs.asdict(hello)
    del fields["proof"]
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def node_proof(token: bytes, *, aggregator_nonce: str, hello: Hello) -> str:
    """HMAC-SHA256 under ``token`` of the aggregator's nonce and ``hello`` (its own proof ignored)."""
    return token_proof(token, b"lamploop-federated node proof", aggregator_nonce.encode(), _transcript(hello))


def aggregator_proof(token: bytes, *, aggregator_nonce: str, hello: Hello) -> str:
    """HMAC-SHA256 under ``token`` of the node's nonce, the aggregator's nonce and ``hello``."""
    return token_proof(
        token,
        b"lamploop-federated aggregator proof",
        hello.nonce.encode(),
        aggregator_nonce.encode(),
        _transcript(hello),
    )
