"""The one message envelope of lamploop's TCP protocols: a JSON object tagged with its message type.

A message travels as the canonical JSON (sorted keys, no spaces, no NaN) of an object whose
``"type"`` field names the message and whose other fields are the message's attributes.  The
control channel's frame body is that object; the streaming and federated bodies start with it
(their *header*) and carry tensors after it.  :class:`Envelope` makes and reads it for one
protocol's table of message classes: the JSON, the tag, and (with a converter) the fields
through a strict cattrs converter built on :func:`lamploop.strict_json.strict_converter`, whose
hooks here take JSON values of the exact type only (no ``"1"`` for 1, no ``true`` for 1, no
``1.5`` for an integer).  Whatever does not decode is a :class:`~lamploop.errors.FrameError`
that says what and where.  Nothing is ever unpickled.

.. versionadded:: 0.3
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import cattrs

from lamploop.errors import FrameError
from lamploop.strict_json import strict_converter

__all__ = ["Envelope", "canonical_json", "exact_type", "wire_converter"]


def exact_type(expected: type[Any] | tuple[type[Any], ...], name: str) -> Callable[[Any, Any], Any]:
    """A structure hook that accepts only JSON values of the exact type (no ``"1"`` -> 1, no bools).

    ``name`` says what was expected in the error (``"an integer"``, ``"an object"``).
    """

    def hook(value: Any, _type: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, expected):
            msg = f"expected {name}, got {type(value).__name__} {value!r:.40}"
            raise TypeError(msg)
        return value

    return hook


def _number(value: Any, _type: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        msg = f"expected a number, got {type(value).__name__} {value!r:.40}"
        raise TypeError(msg)
    return float(value)


def _boolean(value: Any, _type: Any) -> bool:
    if not isinstance(value, bool):
        msg = f"expected a boolean, got {type(value).__name__} {value!r:.40}"
        raise TypeError(msg)
    return value


def wire_converter() -> cattrs.Converter:
    """A new strict converter for messages (extra keys refused; lists only for sequences); add a
    protocol's own hooks to it (a model spec, tensors carried apart)."""
    converter = strict_converter()
    converter.register_structure_hook(bool, _boolean)
    converter.register_structure_hook(int, exact_type(int, "an integer"))
    converter.register_structure_hook(float, _number)
    converter.register_structure_hook(str, exact_type(str, "a string"))
    return converter


def canonical_json(obj: object) -> bytes:
    """The canonical JSON of ``obj``: sorted keys, no spaces, no NaN or infinity.

    Raises:
        ValueError: ``obj`` holds a non-finite number.
    """
    return json.dumps(obj, allow_nan=False, sort_keys=True, separators=(",", ":")).encode()


def _reject_constant(name: str) -> Any:
    msg = f"{name} is not valid JSON"
    raise ValueError(msg)


def _describe_one(exc: BaseException, _type: Any = None) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc}"
    return str(exc) or type(exc).__name__


class Envelope:
    """Tagged JSON objects for one protocol's messages.

    Args:
        protocol: the protocol's name in messages (``"control"``: "not a control message").
        tags: each message class and the ``"type"`` it travels as.
        converter: structures and unstructures the fields (:func:`wire_converter` with the
            protocol's hooks); ``None`` for a protocol that checks the fields itself
            (:meth:`parse` then, not :meth:`decode`).
        part: what the JSON is in a frame's body (``"body"``, ``"header"``), for messages.
    """

    def __init__(
        self,
        protocol: str,
        tags: Mapping[type[Any], str],
        converter: cattrs.Converter | None = None,
        *,
        part: str = "body",
    ) -> None:
        self.protocol = protocol
        self.tags = dict(tags)
        self.types = {tag: cls for cls, tag in self.tags.items()}
        self.converter = converter
        self.part = part

    def tag_of(self, message: object) -> str:
        """The ``"type"`` of ``message``; raises FrameError if it is none of the protocol's."""
        tag = self.tags.get(type(message))
        if tag is None:
            msg = f"cannot encode {type(message).__name__!r}: not a {self.protocol} message"
            raise FrameError(msg)
        return tag

    def fields(self, message: object) -> dict[str, Any]:
        """The tagged JSON object of ``message`` (its fields through the converter)."""
        tag = self.tag_of(message)
        if self.converter is None:
            msg = f"the {self.protocol} envelope has no converter"
            raise TypeError(msg)
        body: dict[str, Any] = self.converter.unstructure(message)
        return {"type": tag, **body}

    def encode(self, message: object) -> bytes:
        """The canonical JSON of ``message``'s tagged object.

        Raises:
            FrameError: not a message of the protocol, or a non-finite number in it.
        """
        return self.dump(self.fields(message))

    def transcript(self, hello: Any, *, tagged: bool) -> bytes:
        """What a handshake proof signs of ``hello``: the canonical JSON of its fields but ``proof``.

        ``tagged``: the tagged object through the converter (:meth:`fields`, the control
        channel's choice); else the bare attrs fields without the tag (streaming's and
        federated's).  The choice is part of each protocol's wire: another one changes every
        proof, and a peer of the previous release would be refused for a wrong token instead of
        being told it speaks another version.
        """
        fields = self.fields(hello) if tagged else attrs.asdict(hello)
        del fields["proof"]
        return self.dump(fields)

    def dump(self, obj: Mapping[str, Any]) -> bytes:
        """The canonical JSON of a tagged object (or of part of one); FrameError on a non-finite number."""
        try:
            return canonical_json(obj)
        except ValueError as exc:
            msg = f"cannot encode {obj.get('type')!r} message: {exc}"
            raise FrameError(msg) from exc

    def parse(self, raw: bytes | bytearray) -> tuple[type[Any], str, dict[str, Any]]:
        """The class, tag and other fields of the tagged JSON object in ``raw``.

        Raises:
            FrameError: ``raw`` is not UTF-8 JSON, not an object, or has no known ``"type"``.
        """
        try:
            obj = json.loads(raw.decode(), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            msg = f"the frame {self.part} is not UTF-8 JSON: {exc}"
            raise FrameError(msg) from exc
        if not isinstance(obj, dict):
            msg = f"the frame {self.part} is a JSON {type(obj).__name__}, not an object"
            raise FrameError(msg)
        tag = obj.pop("type", None)
        cls = self.types.get(tag) if isinstance(tag, str) else None
        if cls is None:
            msg = f"unknown message type {tag!r:.60}"
            raise FrameError(msg)
        return cls, tag, obj

    def structure(self, obj: dict[str, Any], cls: type[Any], tag: str) -> Any:
        """The message of class ``cls`` with the fields ``obj``; raises FrameError naming what is wrong."""
        if self.converter is None:
            msg = f"the {self.protocol} envelope has no converter"
            raise TypeError(msg)
        try:
            return self.converter.structure(obj, cls)
        except (cattrs.BaseValidationError, ValueError, TypeError, KeyError) as exc:
            if isinstance(exc, cattrs.BaseValidationError):
                detail = "; ".join(cattrs.transform_error(exc, format_exception=_describe_one))
            else:
                detail = _describe_one(exc)
            msg = f"malformed {tag!r} message: {detail}"[:400]
            raise FrameError(msg) from exc

    def decode(self, raw: bytes | bytearray) -> Any:
        """The message in ``raw`` (:meth:`parse`, then :meth:`structure`)."""
        cls, tag, obj = self.parse(raw)
        return self.structure(obj, cls, tag)
