"""The one handshake of lamploop's TCP protocols: challenge, hello with proof, welcome with proof back.

Every connection of the control channel, the streaming transport and the federated link
starts so; the server (the control root, a sample receiver, the aggregator) speaks first::

    server                                              client
     | -- Challenge(protocol_version, server nonce) --> |
     | <-- Hello(protocol_version, who it is,           |
     |           client nonce, proof) ----------------- |   proof = HMAC(token, server nonce + hello)
     | -- Welcome(..., proof) or Refuse(reason) ------> |   proof = HMAC(token, both nonces + hello ...)

Each protocol has its own message classes, labels and hello fields (a rank and a model spec,
a producer's name, a node's name); the checks and their order are here, once.

**The server checks a hello in this order, in every protocol:**

1. it is a hello with a well-formed nonce, in a frame that decodes and fits the
   pre-authentication limit (:mod:`lamploop.transport.frames`); else the peer is a stranger:
   closed without a reply (garbage, a hang-up, silence cost the server the least);
2. **the proof of the token**; else refused with :data:`WRONG_TOKEN` as the reason (a client of
   the protocol with another token deserves to know);
3. **the protocol version**; the peer proved the token, so it is refused naming both versions;
4. **the protocol's own fields**, by the protocol (the control root: world size, rank, model
   spec; a receiver: the producer's name; the aggregator: none).

So nobody learns anything about the run (not even the version it speaks) before proving the
token, and a peer that proved it is told precisely why it does not fit.  :func:`judge_hello`
is steps 1 to 3, without I/O; :func:`receive_hello` sends the challenge and judges the answer.

**The client** checks that the first frame is a challenge (:func:`judge_challenge`), answers
with its hello, then judges the reply (:func:`judge_welcome`), in this order, in every protocol:

1. a Refuse carries the server's reason;
2. anything but the protocol's welcome (a hang-up included) is a failure naming what came;
3. **the welcome's proof** of the token must match before anything in it (or after it) is
   believed.

Each failure is a :class:`NotWelcomed` saying which case it was; each client words it as its
own error (which of them may be tried again is the protocol's).  Where the client checks the
challenge's version itself, and a protocol's other answers (streaming's ``Redirect``, checked
before the welcome), are each protocol's choice, named in docs/transport.md.

.. versionadded:: 0.3
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Literal, Protocol, TypeAlias, TypeVar

import attrs

from lamploop.errors import TransportError
from lamploop.transport.connection import FramedConnection
from lamploop.transport.proofs import is_nonce, nonce_validator, proof_matches

__all__ = [
    "WRONG_TOKEN",
    "Challenge",
    "HelloRules",
    "NotAChallenge",
    "NotWelcomed",
    "Refusal",
    "Refuse",
    "WelcomeFailure",
    "judge_challenge",
    "judge_hello",
    "judge_welcome",
    "receive_hello",
    "version_mismatch",
]

WRONG_TOKEN = "the proof of the shared token did not match (wrong token?)"
"""Why a hello whose proof does not match is refused, in every protocol."""


@attrs.frozen
class Challenge:
    """Server → client, first frame on every connection: its protocol version and nonce.

    The streaming and federated challenge (each sends it under the tag ``"challenge"``); one
    with a malformed nonce does not decode.  The control channel keeps a challenge of its own
    that decodes any nonce (its follower judges it, :func:`judge_challenge`), as released.
    """

    protocol_version: int
    nonce: str = attrs.field(validator=nonce_validator)


@attrs.frozen
class Refuse:
    """Server → client: not accepted (or a bad frame), and why; the sender closes after it.

    The one refusal message of the three protocols (each sends it under the tag ``"refuse"``);
    the federated aggregator also sends it to a joined node.
    """

    reason: str


class Hello(Protocol):
    """What every protocol's hello has."""

    @property
    def protocol_version(self) -> int: ...

    @property
    def nonce(self) -> str: ...

    @property
    def proof(self) -> str: ...


H = TypeVar("H", bound=Hello)


class _Proving(Protocol):
    """What every protocol's welcome has."""

    @property
    def proof(self) -> str: ...


W = TypeVar("W", bound=_Proving)


class _Receives(Protocol):
    """A connection that receives whole messages (each protocol's :class:`FramedConnection`)."""

    async def receive(self) -> object | None: ...


@attrs.frozen
class HelloRules(Generic[H]):
    """What a server of one protocol needs to judge a hello.

    Attributes:
        protocol: the protocol's name in messages (``"control"``, ``"streaming"``, ``"federated"``).
        server: the server in messages (``"the root"``, ``"the receiver"``, ``"the aggregator"``).
        version: the protocol version the server speaks.
        hello_type: the protocol's hello class.
        expected_proof: ``(token, server nonce, hello) -> proof`` the client must have sent.
        client: names the client of a hello in messages (``"rank 1"``, ``"producer 'sim-3'"``).
    """

    protocol: str
    server: str
    version: int
    hello_type: type[H]
    expected_proof: Callable[[bytes, str, H], str]
    client: Callable[[H], str]


class Refusal(Exception):
    """A server refuses a connection during the handshake; the message says why.

    ``reply``: tell the client why (a Refuse), else only close.  ``hello``: the hello of a
    client that proved the token, so it is one of the run's that does not fit (the control
    root fails the run for it), not a stranger; ``None`` for a stranger.
    """

    def __init__(self, reason: str, *, reply: bool = False, hello: object = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.reply = reply
        self.hello = hello

    @property
    def proved(self) -> bool:
        """Whether the client proved the token (its :attr:`hello` is kept)."""
        return self.hello is not None


class NotAChallenge(Exception):
    """A client's first frame was no challenge with a well-formed nonce; ``what`` completes a
    message "the server ..." ("sent Heartbeat instead of a challenge")."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def version_mismatch(theirs: int, ours: int, *, protocol: str, them: str, us: str) -> str | None:
    """Why peers of these versions do not fit (naming both), or ``None`` when they speak one version.

    >>> version_mismatch(1, 2, protocol="streaming", them="producer 'old'", us="the receiver")
    "producer 'old' speaks streaming protocol version 1, the receiver speaks version 2"
    """
    if theirs == ours:
        return None
    return f"{them} speaks {protocol} protocol version {theirs}, {us} speaks version {ours}"


def judge_hello(message: object, rules: HelloRules[H], *, token: bytes, nonce: str) -> H:
    """Steps 1 to 3 of the module's order: ``message`` if it is a hello that proves the token
    and speaks the server's version, answering the challenge of ``nonce``.

    Raises:
        Refusal: with the reason, and whether to reply and whether the token was proved.
    """
    if message is None:
        msg = "closed the connection without a hello"
        raise Refusal(msg)
    if not isinstance(message, rules.hello_type):
        msg = f"sent a {type(message).__name__} message instead of a hello"
        raise Refusal(msg)
    if not is_nonce(message.nonce):
        msg = "sent a malformed nonce"
        raise Refusal(msg)
    if not proof_matches(rules.expected_proof(token, nonce, message), message.proof):
        raise Refusal(WRONG_TOKEN, reply=True)
    mismatch = version_mismatch(
        message.protocol_version,
        rules.version,
        protocol=rules.protocol,
        them=rules.client(message),
        us=rules.server,
    )
    if mismatch is not None:
        raise Refusal(mismatch, reply=True, hello=message)
    return message


async def receive_hello(
    conn: FramedConnection[Any], challenge: bytes, rules: HelloRules[H], *, token: bytes, nonce: str
) -> H:
    """Send the ``challenge`` frame (of ``nonce``), receive the answer and :func:`judge_hello` it.

    ``conn`` is the protocol's connection (its ``receive()`` gives whole messages).  The
    caller bounds the time.

    Raises:
        Refusal: the peer failed, hung up, sent a bad frame or something else than a proving
            hello of this version (see the module for which are told why).
    """
    receiver: _Receives = conn  # type: ignore[assignment]
    try:
        await conn.send_bytes(challenge)
        message = await receiver.receive()
    except TransportError as exc:  # a bad frame included: garbage gets no reply
        raise Refusal(str(exc)) from exc
    return judge_hello(message, rules, token=token, nonce=nonce)


def judge_challenge(message: object, challenge_type: type[Any]) -> Any:
    """``message`` if it is a challenge with a well-formed nonce (the client's first check).

    Raises:
        NotAChallenge: it is not (``what`` says what came instead).
    """
    if not isinstance(message, challenge_type):
        raise NotAChallenge(f"{_what_came(message)} instead of a challenge")
    nonce = getattr(message, "nonce", None)
    if not is_nonce(nonce):
        raise NotAChallenge(f"sent a challenge whose nonce is not 64 lowercase hex digits: {nonce!r:.80}")
    return message


WelcomeFailure: TypeAlias = Literal["refused", "no welcome", "unproven"]
"""How a server's reply to a hello failed the client (:class:`NotWelcomed`)."""


class NotWelcomed(Exception):
    """The server's reply to a client's hello was no proven welcome (:func:`judge_welcome`).

    ``case`` says which check failed and ``detail`` completes a message "the server ...":

    - ``"refused"``: a Refuse; ``detail`` is the server's reason;
    - ``"no welcome"``: something else came; ``detail`` says what ("closed the connection",
      "sent Heartbeat"), to be followed by "instead of ...";
    - ``"unproven"``: a welcome whose proof does not match; ``detail`` is "did not prove the
      shared token".
    """

    def __init__(self, case: WelcomeFailure, detail: str) -> None:
        super().__init__(f"{case}: {detail}")
        self.case: WelcomeFailure = case
        self.detail = detail


def judge_welcome(reply: object, welcome_type: type[W], *, expected_proof: Callable[[W], str]) -> W:
    """``reply`` if it is a welcome that proves the token (the client's check of the server's answer).

    The checks, in the module's order: a Refuse, then anything but a ``welcome_type`` (``None``:
    the server hung up), then the welcome's proof against ``expected_proof(reply)`` (a welcome's
    own fields may be part of what it proves: streaming's acknowledged seq).  A protocol's other
    answers are its own to check before (streaming's ``Redirect``).

    Raises:
        NotWelcomed: which check failed, and the detail.
    """
    if isinstance(reply, Refuse):
        raise NotWelcomed("refused", reply.reason)
    if not isinstance(reply, welcome_type):
        raise NotWelcomed("no welcome", _what_came(reply))
    if not proof_matches(expected_proof(reply), reply.proof):
        raise NotWelcomed("unproven", "did not prove the shared token")
    return reply


def _what_came(message: object) -> str:
    """What a peer did instead of sending the expected message (a received ``None``: it hung up)."""
    return "closed the connection" if message is None else f"sent {type(message).__name__}"
