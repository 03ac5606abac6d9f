"""The TCP control channel's handshake, both sides: the transport's, and whether a follower fits the run.

The exchange (Challenge, Hello, then Welcome or Refuse) is drawn in :mod:`lamploop.control.tcp`;
the checks and their order are the transport's (:mod:`lamploop.transport.handshake`): the
token's proof, then the protocol version, then this channel's own fields (:func:`mismatch`:
world size, rank, a rank already joined, model spec).  The root runs
:func:`authenticate_follower`, then :func:`mismatch`; the follower runs :func:`greet_root`.
The proofs are computed in :mod:`lamploop.control.wire`.  Timeouts are the callers'.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from lamploop.control.connection import Connection
from lamploop.control.settings import Run
from lamploop.control.wire import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    Welcome,
    follower_proof,
    new_nonce,
    root_proof,
)
from lamploop.errors import ControlChannelError, HandshakeError
from lamploop.modelspec import describe_mismatch
from lamploop.transport.handshake import (
    HelloRules,
    NotAChallenge,
    NotWelcomed,
    judge_challenge,
    judge_welcome,
    receive_hello,
)

__all__ = ["RULES", "HungUpBeforeChallenge", "authenticate_follower", "greet_root", "mismatch"]

RULES: HelloRules[Hello] = HelloRules(
    protocol="control",
    server="the root",
    version=PROTOCOL_VERSION,
    hello_type=Hello,
    expected_proof=lambda token, nonce, hello: follower_proof(token, root_nonce=nonce, hello=hello),
    client=lambda hello: f"rank {hello.rank}",
)
"""How the root judges a follower's hello (the transport's order of checks)."""


async def authenticate_follower(conn: Connection, token: bytes) -> tuple[Hello, Welcome]:
    """The root's side: challenge the peer and check its hello's proof, then its version.

    Returns the hello and the welcome that proves the token back (to send if the follower
    also fits the run: :func:`mismatch`).

    Raises:
        Refusal: the peer failed, hung up, sent something else, a wrong proof or another
            protocol version (then ``proved``: it is a follower of this run that does not fit).
    """
    nonce = new_nonce()
    challenge = conn.encode(Challenge(PROTOCOL_VERSION, nonce))
    hello = await receive_hello(conn, challenge, RULES, token=token, nonce=nonce)
    return hello, Welcome(root_proof(token, root_nonce=nonce, hello=hello))


def mismatch(hello: Hello, run: Run, joined: Mapping[int, Connection]) -> str | None:
    """Why a follower that proved the token and speaks this version cannot take part, or ``None``.

    ``joined`` maps the ranks already admitted to their connections.
    """
    rank, nranks = hello.rank, run.nranks
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


class HungUpBeforeChallenge(ControlChannelError):
    """The root's end of a connection closed before it sent its challenge (or its welcome).

    A root ending its run does that to a connection the kernel had already queued on its
    listener; the next run's root listens on the same port moments later, so a follower tries
    again until its connect timeout (a port with no lamploop root behind it fails the same way,
    at that timeout).
    """


async def greet_root(conn: Connection, run: Run, *, rank: int, protocol_version: int) -> None:
    """The follower's side: answer the root's challenge with a hello, then check the root's proof.

    The follower does not judge the challenge's protocol version: the root does, and names
    the mismatch to both sides (it fails the run for it).  Once the root proved the token, the
    connection takes frames up to the link's limit.

    Raises:
        HandshakeError: the root refused this follower (with the root's reason), or did not
            prove the shared token.
        HungUpBeforeChallenge: the connection ended before the root's challenge.
        ControlChannelError: the root sent something else than the handshake, or the
            connection failed.
    """
    try:
        first = await conn.receive()
    except ControlChannelError as exc:
        raise HungUpBeforeChallenge(
            f"rank {rank}: {conn.peer}: {exc}, before a challenge: is it a lamploop root?"
        ) from exc
    if first is None:
        raise HungUpBeforeChallenge(
            f"rank {rank}: {conn.peer} closed the connection instead of a challenge: is it a lamploop root?"
        )
    try:
        challenge = judge_challenge(first, Challenge)
    except NotAChallenge as exc:
        msg = f"rank {rank}: {conn.peer} {exc.what}: is it a lamploop root?"
        raise ControlChannelError(msg) from None
    hello = Hello(protocol_version, rank, run.nranks, run.model_spec, new_nonce(), proof="")
    hello = attrs.evolve(hello, proof=follower_proof(run.token, root_nonce=challenge.nonce, hello=hello))
    await conn.send(hello)
    expected = root_proof(run.token, root_nonce=challenge.nonce, hello=hello)
    # A root ending its run closes the handshakes in flight: the next run's root comes on the
    # same port moments later, as for a hang-up before the challenge.
    try:
        reply = await conn.receive()
    except ControlChannelError as exc:
        msg = f"rank {rank}: {conn.peer}: {exc}, instead of answering the hello (a root ending its run?)"
        raise HungUpBeforeChallenge(msg) from exc
    if reply is None:
        msg = f"rank {rank}: {conn.peer} closed the connection instead of answering the hello"
        msg += " (a root ending its run?)"
        raise HungUpBeforeChallenge(msg)
    try:
        judge_welcome(reply, Welcome, expected_proof=lambda _welcome: expected)
    except NotWelcomed as exc:
        if exc.case == "refused":
            raise HandshakeError(f"rank {rank} refused by root: {exc.detail}") from None
        if exc.case == "no welcome":  # not a root that speaks this protocol: a channel failure
            msg = f"rank {rank}: {conn.peer} {exc.detail} instead of answering the hello"
            raise ControlChannelError(msg) from None
        msg = f"rank {rank}: {conn.peer} {exc.detail} (another root or token)"
        raise HandshakeError(msg) from None
    conn.joined()
