"""The streaming handshake's proofs: the transport's HMAC with labels of their own.

Split from :mod:`lamploop.streaming.wire` (which re-exports them); a proof of one kind is never
accepted as another.
"""

from __future__ import annotations

import json

import attrs

from lamploop.streaming.wire_messages import ENVELOPE, Hello
from lamploop.transport.proofs import token_proof


def _transcript(hello: Hello) -> bytes:
    """The canonical JSON of every field of ``hello`` but its proof."""
    fields = attrs.asdict(hello)
    del fields["proof"]
    return ENVELOPE.dump(fields)


def producer_proof(token: bytes, *, receiver_nonce: str, hello: Hello) -> str:
    """HMAC-SHA256 under ``token`` of the receiver's nonce and ``hello`` (whose own proof is ignored)."""
    return token_proof(token, b"lamploop-stream producer proof", receiver_nonce.encode(), _transcript(hello))


def receiver_proof(
    token: bytes, *, receiver_nonce: str, hello: Hello, acked_seq: int, max_frame_bytes: int
) -> str:
    """HMAC-SHA256 under ``token`` of the producer's nonce, the receiver's, ``hello`` and the
    Welcome's ``acked_seq`` and ``max_frame_bytes``."""
    return token_proof(
        token,
        b"lamploop-stream receiver proof",
        hello.nonce.encode(),
        receiver_nonce.encode(),
        _transcript(hello),
        f"{acked_seq} {max_frame_bytes}".encode(),
    )


def redirect_proof(token: bytes, *, receiver_nonce: str, hello: Hello, host: str, port: int) -> str:
    """HMAC-SHA256 under ``token`` of the producer's nonce, the receiver's, ``hello`` and the
    address a :class:`Redirect` names (so nobody but a receiver knowing the token redirects)."""
    return token_proof(
        token,
        b"lamploop-stream redirect proof",
        hello.nonce.encode(),
        receiver_nonce.encode(),
        _transcript(hello),
        json.dumps([host, port]).encode(),
    )
