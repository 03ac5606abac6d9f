"""The streaming handshake's proofs: the transport's HMAC with labels of their own.

Split from :mod:`lamploop.streaming.wire` (which re-exports them); a proof of one kind is never
accepted as another.
"""

from __future__ import annotations

import json

from lamploop.streaming.wire_messages import ENVELOPE, Hello
from lamploop.transport.proofs import client_proof, server_proof


def producer_proof(token: bytes, *, receiver_nonce: str, hello: Hello) -> str:
    """HMAC-SHA256 under ``token`` of the receiver's nonce and ``hello`` (whose own proof is ignored)."""
    transcript = ENVELOPE.transcript(hello, tagged=False)
    return client_proof(
        token, b"lamploop-stream producer proof", server_nonce=receiver_nonce, transcript=transcript
    )


def receiver_proof(
    token: bytes, *, receiver_nonce: str, hello: Hello, acked_seq: int, max_frame_bytes: int
) -> str:
    """HMAC-SHA256 under ``token`` of the producer's nonce, the receiver's, ``hello`` and the
    Welcome's ``acked_seq`` and ``max_frame_bytes``."""
    return _receiver_answer(
        token, b"lamploop-stream receiver proof", receiver_nonce, hello, f"{acked_seq} {max_frame_bytes}"
    )


def redirect_proof(token: bytes, *, receiver_nonce: str, hello: Hello, host: str, port: int) -> str:
    """HMAC-SHA256 under ``token`` of the producer's nonce, the receiver's, ``hello`` and the
    address a :class:`Redirect` names (so nobody but a receiver knowing the token redirects)."""
    return _receiver_answer(
        token, b"lamploop-stream redirect proof", receiver_nonce, hello, json.dumps([host, port])
    )


def _receiver_answer(token: bytes, label: bytes, receiver_nonce: str, hello: Hello, answer: str) -> str:
    transcript = ENVELOPE.transcript(hello, tagged=False)
    return server_proof(
        token,
        label,
        answer.encode(),
        client_nonce=hello.nonce,
        server_nonce=receiver_nonce,
        transcript=transcript,
    )
