"""The shared token, nonces and HMAC proofs of every handshake, as pure functions.

A proof is HMAC-SHA256 under the shared token of a label and some parts, each part
length-prefixed so that no two lists of parts read alike.  Every kind of proof has a label of
its own (the control follower's, the root's, a producer's, a redirect's...), so that a proof
of one kind is never accepted as another, nor reflected back to the peer that made it.

>>> proof = token_proof(b"secret", b"example proof", b"part")
>>> proof_matches(proof, token_proof(b"secret", b"example proof", b"part"))
True
>>> proof_matches(proof, token_proof(b"secreT", b"example proof", b"part"))
False

.. versionadded:: 0.3
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Callable
from typing import Final

import attrs

from lamploop.errors import ConfigurationError

__all__ = [
    "MAX_NAME_BYTES",
    "NONCE_HEX_CHARS",
    "check_name",
    "check_token",
    "client_proof",
    "is_nonce",
    "name_validator",
    "new_nonce",
    "nonce_validator",
    "proof_matches",
    "server_proof",
    "token_proof",
]

NONCE_HEX_CHARS: Final = 64
"""A nonce is 32 random bytes, written as 64 lowercase hex digits."""

MAX_NAME_BYTES: Final = 200
"""A peer's name in a hello (a producer's, a node's): 1 to 200 bytes of UTF-8, no control characters."""

_LENGTH = struct.Struct(">I")


def check_token(token: object) -> bytes:
    """The shared token as bytes; raises ConfigurationError unless a non-empty str or bytes."""
    raw = token.encode() if isinstance(token, str) else token
    if not isinstance(raw, bytes) or not raw:
        msg = f"token must be a non-empty str or bytes, got {type(token).__name__}"
        raise ConfigurationError(msg)
    return raw


def new_nonce() -> str:
    """A fresh random nonce (32 bytes from :mod:`secrets`, as hex)."""
    return secrets.token_hex(NONCE_HEX_CHARS // 2)


def is_nonce(value: object) -> bool:
    """Whether ``value`` looks like a :func:`new_nonce` (64 lowercase hex digits)."""
    return (
        isinstance(value, str)
        and len(value) == NONCE_HEX_CHARS
        and all(c in "0123456789abcdef" for c in value)
    )


def nonce_validator(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    """An attrs validator: the field is a nonce (:func:`is_nonce`); a message failing it does not decode."""
    if not is_nonce(value):
        msg = f"{attribute.name} must be 64 lowercase hex digits, got {value!r:.80}"
        raise ValueError(msg)


def check_name(value: object, what: str) -> str | None:
    """Why ``value`` cannot name a peer (``what``: ``"producer"``, ``"node"``), or ``None`` if it can."""
    if not isinstance(value, str):
        return f"a {what}'s name is a str, got {type(value).__name__}"
    size = len(value.encode())
    if not 1 <= size <= MAX_NAME_BYTES:
        return f"a {what}'s name is 1 to {MAX_NAME_BYTES} bytes of UTF-8, got {size} bytes"
    if not value.isprintable():
        return f"a {what}'s name has no control characters, got {value!r:.80}"
    return None


def name_validator(what: str) -> Callable[[object, object, str], None]:
    """An attrs validator: the field names a peer (:func:`check_name`)."""

    def validate(_instance: object, _attribute: object, value: str) -> None:
        reason = check_name(value, what)
        if reason is not None:
            raise ValueError(reason)

    return validate


def token_proof(token: bytes, label: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 under ``token`` of ``label`` and ``parts``, each length-prefixed, as hex.

    Give every kind of proof its own ``label``, so that one cannot be replayed or reflected
    as another.
    """
    mac = hmac.new(token, digestmod=hashlib.sha256)
    for part in (label, *parts):
        mac.update(_LENGTH.pack(len(part)) + part)
    return mac.hexdigest()


def client_proof(token: bytes, label: bytes, *, server_nonce: str, transcript: bytes) -> str:
    """A client's proof in the handshake: :func:`token_proof` of the server's nonce and the
    ``transcript`` of the client's hello (:meth:`~lamploop.transport.envelope.Envelope.transcript`)."""
    return token_proof(token, label, server_nonce.encode(), transcript)


def server_proof(
    token: bytes, label: bytes, *answer: bytes, client_nonce: str, server_nonce: str, transcript: bytes
) -> str:
    """A server's proof in its answer to a hello: :func:`token_proof` of the client's nonce, the
    server's, the hello's ``transcript`` and what the ``answer`` itself carries (parts of it the
    client acts on: streaming's acknowledged seq, a redirect's address)."""
    return token_proof(token, label, client_nonce.encode(), server_nonce.encode(), transcript, *answer)


def proof_matches(expected: str, received: str) -> bool:
    """Constant-time comparison of two proofs (any string is accepted as ``received``)."""
    return hmac.compare_digest(expected.encode(), received.encode())
