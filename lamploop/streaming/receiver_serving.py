"""A :class:`~lamploop.streaming.receiver.SampleReceiver`'s serving: each connection, handshake to session.

Split from :mod:`lamploop.streaming.receiver`: :class:`ReceiverServing` is the part of the
receiver that listens, challenges each connection and judges its hello (the transport's
:mod:`~lamploop.transport.handshake`), redirects a producer assigned to another receiver,
serves one connection per producer (an older one is cancelled) and hands it to a
:class:`~lamploop.streaming.receiver_session.ProducerSession`.
:class:`~lamploop.streaming.receiver.SampleReceiver` inherits it and sets every attribute
it declares.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import AsyncIterator

import anyio
import anyio.abc
import attrs
from anyio.abc import TaskStatus

from lamploop.errors import TransportError
from lamploop.streaming.directory import ProducerDirectory
from lamploop.streaming.receiver_session import Intake, ProducerSession
from lamploop.streaming.wire import (
    PROTOCOL_VERSION,
    Challenge,
    FramedStream,
    Hello,
    Redirect,
    Refuse,
    Welcome,
    encode_frame,
    producer_proof,
    receiver_proof,
    redirect_proof,
)
from lamploop.transport import frames, tls
from lamploop.transport.handshake import HelloRules, Refusal, receive_hello
from lamploop.transport.listen import serve_tcp
from lamploop.transport.proofs import new_nonce
from lamploop.transport.strangers import PendingHandshakes, RefusalLog
from lamploop.transport.supervisor import Supervisor

__all__ = ["RULES", "ReceiverServing"]

logger = logging.getLogger("lamploop.streaming")

_REFUSAL_MARGIN = 96
"""A Refuse frame stays this far under what a producer's decoder takes before the receiver
proved the token (the transport's pre-authentication limit): its reason is cut to fit."""
_LISTED_NAMES = 8
_REPLACE_TIMEOUT = 5.0


RULES: HelloRules[Hello] = HelloRules(
    protocol="streaming",
    server="the receiver",
    version=PROTOCOL_VERSION,
    hello_type=Hello,
    expected_proof=lambda token, nonce, hello: producer_proof(token, receiver_nonce=nonce, hello=hello),
    client=lambda hello: f"producer {hello.producer!r}",
)
"""How a receiver judges a producer's hello (the transport's order of checks)."""


@attrs.define
class _Active:
    """A producer's connection being served: cancelled when the producer connects again."""

    scope: anyio.CancelScope
    ended: anyio.Event = attrs.field(factory=anyio.Event)


class ReceiverServing:
    """The receiver's connections: accept, authenticate, redirect or claim, then serve a producer.

    A base of :class:`~lamploop.streaming.receiver.SampleReceiver`, which sets the attributes
    below in its ``__init__`` and starts :meth:`_serve` in its supervisor.
    """

    _token: bytes
    _host: str
    _port: int
    _max_frame_bytes: int
    _handshake_timeout: float
    _idle_timeout: float
    _ack_every: int
    _handshakes: PendingHandshakes
    _tls: ssl.SSLContext | None
    _refusals: RefusalLog
    _active: dict[str, _Active]
    _sup: Supervisor
    _allowed: frozenset[str] | None
    _directory: ProducerDirectory
    _directory_set: anyio.Event
    _intake: Intake

    async def _serve(self, *, task_status: TaskStatus[tuple[str, int]]) -> None:
        await serve_tcp(
            self._host,
            self._port,
            on_connection=lambda stream: self._sup.tg.start_soon(self._handle, stream),
            refusals=self._refusals,
            who="receiver",
            checks_first_bytes=self._tls is None,  # under TLS the client speaks first
            task_status=task_status,
        )

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        conn = FramedStream(
            stream, max_frame_bytes=frames.preauth_frame_bytes(self._max_frame_bytes), one_at_a_time=True
        )
        try:
            try:
                hello, nonce = await self._authenticate(conn)
            except Refusal as exc:
                self._refusals.refused(conn.peer, exc.reason)
                if exc.reply:
                    await conn.send_best_effort(_refuse(exc.reason))
                return
            if await self._redirected(conn, hello, nonce):
                return
            try:
                async with self._claim(hello.producer):
                    await self._serve_producer(conn, hello, nonce)
            except Refusal as exc:
                self._refusals.refused(conn.peer, exc.reason)
                await conn.send_best_effort(_refuse(exc.reason))
        finally:
            await conn.aclose()

    async def _authenticate(self, conn: FramedStream) -> tuple[Hello, str]:
        """Challenge the peer and judge its hello: the transport's order of checks (the token's
        proof, the protocol version), then this receiver's own (the producer's name).

        Raises:
            Refusal: it is none of ours, or a producer this receiver does not take.
        """
        nonce = new_nonce()
        try:
            with anyio.fail_after(self._handshake_timeout), self._handshakes.slot() as slot:
                if self._tls is not None:
                    try:
                        conn.stream = await tls.wrap(conn.stream, self._tls, server_side=True)
                    except TransportError as exc:
                        raise Refusal(str(exc)) from exc
                challenge = encode_frame(Challenge(PROTOCOL_VERSION, nonce))
                hello = await receive_hello(conn, challenge, RULES, token=self._token, nonce=nonce)
        except TimeoutError:
            msg = f"no valid hello within {self._handshake_timeout:g} s"
            raise Refusal(msg, reply=True) from None
        if slot.cancelled_caught:
            msg = "dropped: the oldest of too many connections handshaking"
            raise Refusal(msg, reply=True)
        if self._allowed is not None and hello.producer not in self._allowed:
            msg = f"producer {hello.producer!r} is not one of this run's producers ({_listed(self._allowed)})"
            raise Refusal(msg, reply=True, hello=hello)
        refused = self._intake.refused.get(hello.producer)
        if refused is not None:  # it may not have read why, the first time
            msg = f"producer {hello.producer!r} was refused for good: {refused}"
            raise Refusal(msg, reply=True, hello=hello)
        return hello, nonce

    async def _redirected(self, conn: FramedStream, hello: Hello, nonce: str) -> bool:
        """Send the producer to its assigned receiver if that is another one; whether it was sent
        (or, restored assignments waiting for the directory, dropped to retry)."""
        if self._directory.must_wait(hello.producer):
            with anyio.move_on_after(self._handshake_timeout):
                await self._directory_set.wait()
            if not self._directory.ready:
                logger.warning(
                    "producer %r is assigned to another rank's receiver, and set_directory() was not "
                    "called yet on this one (the root's?); it will retry",
                    hello.producer,
                )
                return True
        target = self._directory.assign(hello.producer)
        if target is None:
            return False
        host, port = target
        proof = redirect_proof(self._token, receiver_nonce=nonce, hello=hello, host=host, port=port)
        try:
            with anyio.fail_after(self._handshake_timeout):
                await conn.send(encode_frame(Redirect(host, port, proof)))
        except (TimeoutError, TransportError) as exc:
            logger.info("producer %r (%s) is gone before its redirect: %s", hello.producer, conn.peer, exc)
            return True
        logger.info("producer %r (%s) redirected to %s:%d", hello.producer, conn.peer, host, port)
        return True

    @contextlib.asynccontextmanager
    async def _claim(self, name: str) -> AsyncIterator[None]:
        """Serve ``name`` on this connection alone: an older one of the same producer is cancelled.

        A producer connects again when it believes its connection is lost; the receiver may
        not have noticed yet, so the older connection goes (its unacknowledged sample, if a
        put was under way, is resent on the new one).
        """
        while (old := self._active.get(name)) is not None:
            old.scope.cancel()
            with anyio.move_on_after(_REPLACE_TIMEOUT):
                await old.ended.wait()
            if not old.ended.is_set():
                msg = f"producer {name!r}: its previous connection did not end within {_REPLACE_TIMEOUT:g} s"
                raise Refusal(msg, reply=True)
        active = self._active[name] = _Active(anyio.CancelScope())
        try:
            with active.scope:
                yield
        finally:
            if self._active.get(name) is active:
                del self._active[name]
            active.ended.set()

    async def _serve_producer(self, conn: FramedStream, hello: Hello, nonce: str) -> None:
        name = hello.producer
        acked = self._intake.acked.get(name, -1)
        limit = self._max_frame_bytes
        proof = receiver_proof(
            self._token, receiver_nonce=nonce, hello=hello, acked_seq=acked, max_frame_bytes=limit
        )
        conn.authenticated(limit)
        conn.decoder.producer = name
        try:
            with anyio.fail_after(self._idle_timeout):
                await conn.send(encode_frame(Welcome(acked, limit, proof)))
        except (TimeoutError, TransportError) as exc:
            logger.info("producer %r (%s) is gone before its welcome: %s", name, conn.peer, exc)
            return
        logger.info("producer %r connected from %s; it resends from seq %d", name, conn.peer, acked + 1)
        session = ProducerSession(
            conn, name, self._intake, idle_timeout=self._idle_timeout, ack_every=self._ack_every
        )
        reason = await session.run()
        if reason is not None:
            self._refusals.refused(conn.peer, f"producer {name!r}: {reason}")
            await conn.send_best_effort(_refuse(reason))


def _refuse(reason: str) -> Refuse:
    """A Refuse whose frame a producer's decoder takes (the reason cut if need be)."""
    while len(encode_frame(Refuse(reason))) > frames.PREAUTH_FRAME_BYTES - _REFUSAL_MARGIN:
        reason = reason[: len(reason) * 3 // 4] + "..."
    return Refuse(reason)


def _listed(names: frozenset[str]) -> str:
    """The first few of ``names``, sorted, for a message."""
    ordered = sorted(names)
    shown = ", ".join(repr(name[:60]) for name in ordered[:_LISTED_NAMES])
    more = f" and {len(ordered) - _LISTED_NAMES} more" if len(ordered) > _LISTED_NAMES else ""
    return f"[{shown}]{more}"
