"""The TCP control channel's handshake, both sides: mutual proof of the token, and whether a follower fits.

The exchange (Challenge, Hello, then Welcome or Refuse) is drawn in :mod:`lamploop.control.tcp`.
The root runs :func:`authenticate_follower`, then :func:`mismatch`; the follower runs
:func:`greet_root`.  The proofs are computed in :mod:`lamploop.control.wire`; this module
only decides what to send and what to accept.  Timeouts are the callers'.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from lamploop.control._connection import Connection
from lamploop.control._settings import Run
from lamploop.control.wire import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    Refuse,
    Welcome,
    follower_proof,
    is_nonce,
    new_nonce,
    proof_matches,
    root_proof,
)
from lamploop.errors import ControlChannelError, HandshakeError
from lamploop.modelspec import describe_mismatch

__all__ = ["Unauthenticated", "authenticate_follower", "greet_root", "mismatch"]


class Unauthenticated(Exception):
    """A peer did not prove the token; the message says how (internal).

    ``speaks_protocol`` is true when the peer sent a well-formed hello (a follower with
    another token, say), which deserves a ``Refuse`` with the reason; a stranger that sent
    garbage is only disconnected, which costs the root the least.
    """

    def __init__(self, reason: str, *, speaks_protocol: bool = False) -> None:
        super().__init__(reason)
        self.speaks_protocol = speaks_protocol


async def authenticate_follower(conn: Connection, token: bytes) -> tuple[Hello, Welcome]:
    """The root's side: challenge the peer and check its hello's proof.

    Returns the hello and the welcome that proves the token back (to send if the follower
    also fits the run).

    Raises:
        Unauthenticated: the peer failed, hung up, sent something else or a wrong proof.
    """
    root_nonce = new_nonce()
    try:
        await conn.send_first(Challenge(PROTOCOL_VERSION, root_nonce))
        hello = await conn.receive()
    except ControlChannelError as exc:
        raise Unauthenticated(str(exc)) from exc
    if hello is None:
        msg = "closed the connection without a hello"
        raise Unauthenticated(msg)
    if not isinstance(hello, Hello):
        msg = f"sent a {type(hello).__name__} message instead of a hello"
        raise Unauthenticated(msg)
    if not is_nonce(hello.nonce):
        msg = "sent a malformed nonce"
        raise Unauthenticated(msg)
    if not proof_matches(follower_proof(token, root_nonce=root_nonce, hello=hello), hello.proof):
        msg = "the proof of the shared token did not match (wrong token?)"
        raise Unauthenticated(msg, speaks_protocol=True)
    return hello, Welcome(root_proof(token, root_nonce=root_nonce, hello=hello))


def mismatch(hello: Hello, run: Run, joined: Mapping[int, Connection]) -> str | None:
    """Why a follower that proved the token cannot take part, or ``None``.

    ``joined`` maps the ranks already admitted to their connections.
    """
    rank, nranks = hello.rank, run.nranks
    if hello.protocol_version != PROTOCOL_VERSION:
        return (
            f"rank {rank} speaks control protocol version {hello.protocol_version}, "
            f"the root speaks version {PROTOCOL_VERSION}"
        )
    if hello.nranks != nranks:
        return f"rank {rank} was started with nranks={hello.nranks}, the root with nranks={nranks}"
    if not 1 <= rank < nranks:
        return f"rank {rank} is out of range: with nranks={nranks} the followers are ranks 1..{nranks - 1}"
    if rank in joined:
        return f"rank {rank} has already joined from {joined[rank].peer}: is rank {rank} started twice?"
    detail = describe_mismatch(
        run.model_spec, hello.model_spec, expected_label="root", actual_label=f"rank {rank}"
    )
    if detail is not None:
        return f"rank {rank}'s model differs: {detail}"
    return None


async def greet_root(conn: Connection, run: Run, *, rank: int, protocol_version: int) -> None:
    """The follower's side: answer the root's challenge with a hello, then check the root's proof.

    Raises:
        HandshakeError: the root refused this follower (with the root's reason), or did not
            prove the shared token.
        ControlChannelError: the root sent something else than the handshake, or the
            connection failed.
    """
    challenge = await conn.receive()
    if not isinstance(challenge, Challenge) or not is_nonce(challenge.nonce):
        what = "closed the connection" if challenge is None else f"sent {type(challenge).__name__}"
        msg = f"rank {rank}: {conn.peer} {what} instead of a challenge: is it a lamploop root?"
        raise ControlChannelError(msg)
    hello = Hello(protocol_version, rank, run.nranks, run.model_spec, new_nonce(), proof="")
    hello = attrs.evolve(hello, proof=follower_proof(run.token, root_nonce=challenge.nonce, hello=hello))
    await conn.send(hello)
    reply = await conn.receive()
    if isinstance(reply, Refuse):
        msg = f"rank {rank} refused by root: {reply.reason}"
        raise HandshakeError(msg)
    if not isinstance(reply, Welcome):
        what = "closed the connection" if reply is None else f"sent {type(reply).__name__}"
        msg = f"rank {rank}: {conn.peer} {what} instead of answering the hello"
        raise ControlChannelError(msg)
    if not proof_matches(root_proof(run.token, root_nonce=challenge.nonce, hello=hello), reply.proof):
        msg = f"rank {rank}: {conn.peer} did not prove the shared token (another root or token)"
        raise HandshakeError(msg)
