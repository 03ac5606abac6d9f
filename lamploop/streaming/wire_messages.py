"""The streaming protocol's messages: limits, the message classes and their header fields.

Split from :mod:`lamploop.streaming.wire` (which re-exports every name here), where the frame
layout and the table of messages are described.  Each message validates its fields when built;
:data:`ENVELOPE` names them in a header and ``_FIELDS`` gives the JSON type of each header field,
for the strict decoding in :mod:`lamploop.streaming.wire`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, TypeAlias

import attrs
import torch

from lamploop.checks import check_names
from lamploop.errors import ConfigurationError
from lamploop.streaming.samples_payload import MAX_SAMPLES_PER_FRAME
from lamploop.streaming.tensor_bytes import Signature
from lamploop.transport import frames
from lamploop.transport.envelope import Envelope
from lamploop.transport.handshake import Challenge, Refuse
from lamploop.transport.proofs import MAX_NAME_BYTES, check_name, name_validator, nonce_validator

PROTOCOL_VERSION: Final = 2
"""The streaming protocol version; producers and receivers that speak another one are refused."""

DEFAULT_MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
"""Default limit on a frame's body (a batch of samples' tensors and its header): 64 MiB."""

PREAUTH_FRAME_BYTES: Final = frames.PREAUTH_FRAME_BYTES
"""The transport's limit on a frame before the peer proved the token (a hello is about 300 bytes),
as it was when this module was imported: the least ``max_frame_bytes`` of a Welcome."""

MAX_PRODUCER_NAME_BYTES: Final = MAX_NAME_BYTES
"""A producer's name is 1 to 200 bytes of UTF-8, without control characters."""

MAX_SEQ: Final = 2**63 - 1
"""The largest sequence number (they are counted from 0)."""


_PROOF_CHARS = 128


def check_producer_name(value: object) -> str | None:
    """Why ``value`` cannot name a producer, or ``None`` if it can (the transport's :func:`check_name`)."""
    return check_name(value, "producer")


def checked_producer_name(where: str, name: object) -> str:
    """``name`` if it can name a producer, else ConfigurationError saying why, after ``where``."""
    reason = check_producer_name(name)
    if reason is not None:
        msg = f"{where}: {reason}"
        raise ConfigurationError(msg)
    assert isinstance(name, str)
    return name


def checked_producer_names(where: str, names: object) -> list[str]:
    """A collection of producer names (not one string: :func:`lamploop.checks.check_names`), each checked."""
    return [checked_producer_name(where, name) for name in check_names(where, names)]


_name = name_validator("producer")


def _seq(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= MAX_SEQ:
        msg = f"{attribute.name} must be in [0, 2**63-1], got {value}"
        raise ValueError(msg)


def _seq_or_none(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not -1 <= value <= MAX_SEQ:
        msg = f"{attribute.name} must be in [-1, 2**63-1] (-1: none), got {value}"
        raise ValueError(msg)


def _short(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if len(value) > _PROOF_CHARS:
        msg = f"{attribute.name} is at most {_PROOF_CHARS} characters, got {len(value)}"
        raise ValueError(msg)


def _frame_limit(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not PREAUTH_FRAME_BYTES <= value <= 0xFFFFFFFF:
        msg = f"{attribute.name} must be in [{PREAUTH_FRAME_BYTES}, 2**32-1], got {value}"
        raise ValueError(msg)


def _host(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not 1 <= len(value) <= 255 or not value.isprintable() or " " in value:
        msg = f"{attribute.name} must be a host name or address (1 to 255 characters), got {value!r:.80}"
        raise ValueError(msg)


def _port(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 1 <= value <= 65535:
        msg = f"{attribute.name} must be in [1, 65535], got {value}"
        raise ValueError(msg)


def _samples(instance: SamplesFrame, attribute: attrs.Attribute[Any], value: tuple[Any, ...]) -> None:
    if not 1 <= len(value) <= MAX_SAMPLES_PER_FRAME:
        msg = f"a samples frame holds 1 to {MAX_SAMPLES_PER_FRAME} samples, got {len(value)}"
        raise ValueError(msg)
    if instance.first_seq + len(value) - 1 > MAX_SEQ:
        msg = f"seqs {instance.first_seq}.. of {len(value)} samples go past 2**63-1"
        raise ValueError(msg)


@attrs.frozen
class Hello:
    """Producer → receiver, answering the challenge: who it is, and proof that it knows the token.

    ``proof`` is :func:`producer_proof` of every other field and the receiver's nonce.
    """

    protocol_version: int
    producer: str = attrs.field(validator=_name)
    nonce: str = attrs.field(validator=nonce_validator)
    proof: str = attrs.field(validator=_short)


@attrs.frozen
class Welcome:
    """Receiver → producer: accepted.

    ``acked_seq`` is the highest seq of this producer the receiver holds with every one
    before it (-1: none), so the producer resends from ``acked_seq + 1``;
    ``max_frame_bytes`` is the largest frame the receiver takes (the producer's batches stay
    under it); ``proof`` (:func:`receiver_proof`) shows the receiver knows the token too.
    """

    acked_seq: int = attrs.field(validator=_seq_or_none)
    max_frame_bytes: int = attrs.field(validator=_frame_limit)
    proof: str = attrs.field(validator=_short)


@attrs.frozen
class Redirect:
    """Receiver → producer, instead of a Welcome: this producer is served by the receiver at
    ``host:port``; connect there (same token).  ``proof`` is :func:`redirect_proof`.
    """

    host: str = attrs.field(validator=_host)
    port: int = attrs.field(validator=_port)
    proof: str = attrs.field(validator=_short)


@attrs.frozen
class SamplesFrame:
    """Producer → receiver: samples ``first_seq``, ``first_seq + 1``, ... of ``producer``.

    Each sample's tensors travel as safetensors bytes in the frame's payload.
    """

    producer: str = attrs.field(validator=_name)
    first_seq: int = attrs.field(validator=_seq)
    samples: tuple[Mapping[str, torch.Tensor], ...] = attrs.field(
        converter=tuple, validator=_samples, eq=False, repr=False
    )
    signatures: tuple[Signature, ...] = attrs.field(default=(), converter=tuple, eq=False, repr=False)
    """Each sample's tensors' names, dtypes and shapes when decoded from bytes (one object per
    header); empty when made otherwise (the receiver then finds them from the tensors)."""

    @property
    def last_seq(self) -> int:
        """The seq of the frame's last sample."""
        return self.first_seq + len(self.samples) - 1


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


Message: TypeAlias = Challenge | Hello | Welcome | Redirect | Refuse | SamplesFrame | Ack | Done
"""Every message of the streaming protocol."""

_TAGS: Final[dict[type[Any], str]] = {
    Challenge: "challenge",
    Hello: "hello",
    Welcome: "welcome",
    Redirect: "redirect",
    Refuse: "refuse",
    SamplesFrame: "samples",
    Ack: "ack",
    Done: "done",
}
ENVELOPE: Final = Envelope("streaming", _TAGS, part="header")
"""The streaming messages' headers as the transport's tagged JSON (fields checked here, by hand)."""
# The header fields of each message and their JSON types (a batch's samples are its payload,
# described by the header's "sizes"). Resolved here: the handshake messages are shared with the
# other protocols, whose converters may have resolved their string annotations already.
_FIELDS: Final[dict[type[Any], dict[str, type[Any]]]] = {
    cls: {
        f.name: f.type
        for f in attrs.fields(attrs.resolve_types(cls))
        if f.name not in ("samples", "signatures")
    }
    for cls in _TAGS
}
_FIELDS[SamplesFrame]["sizes"] = list
