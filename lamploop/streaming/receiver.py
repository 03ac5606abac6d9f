"""The trainer's end of the streaming transport: take producers' samples over TCP into a sink.

:class:`SampleReceiver` listens, proves the shared token with each producer (both ways),
tells it what it already holds, then puts every new sample into the sink *before*
acknowledging it: an acknowledged sample is in the sink, so nothing acknowledged is ever
lost, and a producer that reconnects resends exactly what was not acknowledged.  The wire
format is :mod:`lamploop.streaming.wire`'s; the producers are in
:mod:`lamploop.streaming.producer`.  This module is the server (listening, the handshake of
:mod:`lamploop.transport.handshake`, the directory, one connection per producer); a welcomed
producer's samples are taken by its session (:mod:`lamploop.streaming.receiver_session`).

Per producer the receiver remembers the highest seq it holds with every one before it
(:attr:`SampleReceiver.acknowledged`).  Save that with the trainer's state (along with the
buffer it describes) and give it back as ``acknowledged=`` after a restart: producers then
resend only what the restored state lacks.  A sample at or below it is a duplicate and is
dropped (counted); one beyond the next seq would leave a gap and is refused.

Samples come in batches (one ``"samples"`` frame holds several consecutive samples of one
producer); their tensors are views of the received bytes, not copies.  A buffer's
``try_put_many`` takes a batch in one step when it has room (any other sink gets one ``put``
per sample), and one cumulative acknowledgement answers a frame, or several when more are
already waiting, and at the latest ``ack_every`` samples or 5 ms after a put.

With several ranks (one receiver each), the root rank's receiver hands out the producers:
:meth:`SampleReceiver.set_directory` gives it every rank's receiver address, and from then on
it answers each producer's hello with a redirect to the receiver assigned to it
(:mod:`lamploop.streaming.directory`: round-robin by first arrival, sticky), unless it is its
own.  :attr:`SampleReceiver.directory_assignments` goes into the checkpoint, and
``directory_assignments=`` gives it back on resume.

Strangers (bytes before the challenge, garbage, frames over the limit, a wrong token,
silence past ``handshake_timeout``, a name not in ``allowed_producers``) and producers that
break the protocol are refused: closed, counted in :attr:`SampleReceiver.refusals`, logged (a
few lines per window), and none of it touches the other producers' connections.  So are a
producer whose sample does not match the stream's first sample (other tensor names, dtypes
or shapes: it could never be stacked into a batch with the others), for good (it counts as
ended for :meth:`SampleReceiver.wait_all_done`), and one whose sample finds the buffer closed:
neither ends the run.

.. versionadded:: 0.2
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from types import TracebackType

import anyio
import anyio.abc
import attrs
from anyio.abc import TaskStatus

from lamploop.errors import (
    ConfigurationError,
    StreamingError,
    TransportError,
)
from lamploop.streaming.directory import ProducerDirectory
from lamploop.streaming.receiver_session import IngestStats, Intake, ProducerSession
from lamploop.streaming.sample import SampleSink
from lamploop.streaming.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_SEQ,
    PREAUTH_FRAME_BYTES,
    PROTOCOL_VERSION,
    Challenge,
    FramedStream,
    Hello,
    Redirect,
    Refuse,
    Welcome,
    check_producer_name,
    encode_frame,
    producer_proof,
    receiver_proof,
    redirect_proof,
)
from lamploop.transport import frames, tls
from lamploop.transport.handshake import HelloRules, Refusal, receive_hello
from lamploop.transport.listen import serve_tcp
from lamploop.transport.proofs import check_token, new_nonce
from lamploop.transport.settings import check_int_in, check_seconds_each
from lamploop.transport.strangers import PendingHandshakes, RefusalLog
from lamploop.transport.supervisor import Supervisor

__all__ = ["IngestStats", "SampleReceiver"]

logger = logging.getLogger("lamploop.streaming")

_RECENT_REFUSALS = 16
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


class SampleReceiver:
    """Takes samples from producers over TCP into ``sink``; an async context manager.

    ``async with SampleReceiver(sink, token=...) as receiver:`` listens on ``host:port``
    (``port=0`` picks a free port: read :attr:`address`) and serves producers until the block
    ends.  If the sink's ``put`` raises, the receiver fails: the block's body is cancelled
    and leaving it raises :class:`~lamploop.errors.ControlChannelError` (from the sink's
    error).  A cancelled ``put`` must not have taken the sample (anyio's memory streams
    behave so): it is not acknowledged, and will be resent.

    Args:
        sink: where the samples go (:class:`~lamploop.streaming.sample.SampleSink`); its
            ``put`` may wait, which holds the producer back.
        host, port: where to listen (``"0.0.0.0"`` only on trusted networks: see the security
            notes of ``docs/control-channel.md``, which hold here too).
        token: the secret shared with the producers; both sides prove they know it.
        acknowledged: per producer, the highest seq already held with every one before it,
            from a checkpoint (default: none).
        producers_done: the producers that had already finished, from a checkpoint.
        expected_producers: the producers to wait for in :meth:`wait_all_done`.
        allowed_producers: the run's producers: a hello from any other name (with the right
            token) is refused at the handshake, naming it and the list, and counted in
            :attr:`refusals`; ``None`` (the default): any producer that proves the token.
            :meth:`~lamploop.streaming.state.StreamState.open_receiver` gives its ``producers``.
        uniform_samples: every sample must have the tensor names, dtypes and shapes of the
            first sample this receiver took (they are stacked into batches); a producer whose
            sample differs is refused for good (see :attr:`producers_refused`).  ``False``: samples
            of varying shapes are taken (for a collate function of your own).
        max_frame_bytes: the largest frame accepted once a producer proved the token.
        handshake_timeout: a connection must finish the handshake within this many seconds.
        idle_timeout: a producer's connection silent this long is closed (the producer
            reconnects when it has something to send); also bounds each acknowledgement sent.
        ack_every: acknowledge at least every this many samples (keep it under the
            producers' ``resend_window``); also when the producer's stream pauses (at most every
            5 ms), and within 5 ms of any put.
        max_pending_handshakes: connections handshaking at once; one more drops the oldest.
        ssl_context: TLS for every connection (a server context with the receiver's
            certificate), before the token handshake; ``None``: no TLS.
        directory_assignments: producer name -> rank index, from the root's checkpoint
            (:attr:`directory_assignments`) or fixed beforehand; until :meth:`set_directory`,
            a producer assigned to another rank (or to any, without ``directory_index``) waits
            (each hello up to ``handshake_timeout``, then it retries).
        directory_index: this receiver's rank index; with ``directory_assignments``, its own
            producers are served before :meth:`set_directory` (give it on every rank's receiver
            when every rank gets the assignments).

    Raises:
        ConfigurationError: an argument is out of range.
    """

    def __init__(
        self,
        sink: SampleSink,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: bytes | str,
        acknowledged: Mapping[str, int] | None = None,
        producers_done: Iterable[str] = (),
        expected_producers: Iterable[str] | None = None,
        allowed_producers: Iterable[str] | None = None,
        uniform_samples: bool = True,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        handshake_timeout: float = 5.0,
        idle_timeout: float = 300.0,
        ack_every: int = 32,
        max_pending_handshakes: int = 64,
        ssl_context: ssl.SSLContext | None = None,
        directory_assignments: Mapping[str, int] | None = None,
        directory_index: int | None = None,
    ) -> None:
        if not callable(getattr(sink, "put", None)):
            msg = f"sink must have an async put(sample) (a SampleSink), got {type(sink).__name__}"
            raise ConfigurationError(msg)
        self._token = check_token(token)
        check_int_in("port", port, 0, 65535)
        check_int_in("max_frame_bytes", max_frame_bytes, PREAUTH_FRAME_BYTES)
        check_int_in("ack_every", ack_every, 1)
        check_int_in("max_pending_handshakes", max_pending_handshakes, 1)
        check_seconds_each(handshake_timeout=handshake_timeout, idle_timeout=idle_timeout)
        acked: dict[str, int] = {}
        for name, seq in (acknowledged or {}).items():
            _check_name("acknowledged", name)
            check_int_in(f"acknowledged[{name!r}]", seq, -1, MAX_SEQ)
            acked[name] = seq
        done = {_check_name("producers_done", name) for name in producers_done}
        self._expected = (
            None
            if expected_producers is None
            else frozenset(_check_name("expected_producers", name) for name in expected_producers)
        )
        self._allowed = (
            None
            if allowed_producers is None
            else frozenset(_check_name("allowed_producers", name) for name in allowed_producers)
        )
        if not isinstance(uniform_samples, bool):
            msg = f"uniform_samples must be a bool, got {type(uniform_samples).__name__}"
            raise ConfigurationError(msg)
        self._directory = ProducerDirectory(directory_assignments, own_index=directory_index)
        self._directory_index = 0 if directory_index is None else directory_index
        self._directory_set = anyio.Event()
        self._host, self._port = host, port
        self._max_frame_bytes = max_frame_bytes
        self._handshake_timeout = handshake_timeout
        self._idle_timeout = idle_timeout
        self._ack_every = ack_every
        self._handshakes = PendingHandshakes(max_pending_handshakes)
        self._tls = tls.check_context("ssl_context", ssl_context, server_side=True)
        self._refusals = RefusalLog(remember=_RECENT_REFUSALS, who="sample receiver")
        self._active: dict[str, _Active] = {}
        self._sup = Supervisor(on_failure=self._wake_up)
        self._all_done_or_failed = anyio.Event()
        self._address: tuple[str, int] | None = None
        # What the producers' sessions share: what is held, who is done, the stream's first sample.
        self._intake = Intake(
            sink,
            acknowledged=acked,
            done=done,
            uniform=uniform_samples,
            on_change=self._check_all_done,
            on_failure=self._sup.fail,
        )
        self._check_all_done()

    # -- what the owner reads --

    @property
    def address(self) -> tuple[str, int]:
        """The ``(host, port)`` the receiver listens on (the real port when ``port=0``)."""
        if self._address is None:
            msg = "the receiver is not listening yet: use `async with SampleReceiver(...) as receiver`"
            raise StreamingError(msg)
        return self._address

    @property
    def acknowledged(self) -> dict[str, int]:
        """Per producer, the highest seq in the sink with every one before it (a copy: checkpoint it)."""
        return dict(self._intake.acked)

    @property
    def directory_assignments(self) -> dict[str, int]:
        """Producer name -> rank index, as handed out so far (a copy, JSON-ready: checkpoint it on
        the root rank and give it back as ``directory_assignments=``)."""
        return self._directory.assignments

    def set_directory(self, addresses: Sequence[tuple[str, int]], *, own_index: int | None = None) -> None:
        """Hand producers out over every rank's receiver, this one being ``addresses[own_index]``
        (default: ``directory_index``, else 0: the root's).

        Call it on the root rank's receiver, once every rank's receiver listens (their
        :attr:`address`, gathered in rank order).  From then on a producer's hello is answered
        with a :class:`~lamploop.streaming.wire.Redirect` to its assigned receiver, or welcomed
        when that is this one.  Producers this receiver took before the call stay with it.  With
        one address, every producer stays here.

        Raises:
            ConfigurationError: ``addresses`` is empty or malformed, ``own_index`` is out of
                range, not ``directory_index``, or its address's port is not this receiver's, it
                was called before, or an assignment names a rank beyond ``addresses``.
        """
        index = own_index if own_index is not None else self._directory_index
        if self._address is not None and isinstance(index, int) and 0 <= index < len(addresses):
            mine = addresses[index]
            if isinstance(mine, tuple | list) and len(mine) == 2 and mine[1] != self._address[1]:
                msg = (
                    f"set_directory: addresses[{index}] is {mine!r:.80}, but this receiver "
                    f"listens on port {self._address[1]}"
                )
                raise ConfigurationError(msg)
        served = set(self._intake.acked) | self._intake.done | set(self._active)
        self._directory.set_addresses(addresses, own_index=own_index, served=served)
        self._directory_set.set()
        logger.info("sample receiver: producers handed out over %d receivers", len(addresses))

    @property
    def producers_done(self) -> frozenset[str]:
        """The producers that sent Done (and every sample before it)."""
        return frozenset(self._intake.done)

    @property
    def producers_refused(self) -> dict[str, str]:
        """The producers refused for good, and why (a sample unlike the stream's first one): they
        count as ended for :meth:`wait_all_done`; their samples before that one were taken."""
        return dict(self._intake.refused)

    @property
    def refusals(self) -> int:
        """Connections refused so far: strangers (a name not allowed included), producers that
        broke the protocol or sent a sample unlike the stream's, and samples after the buffer closed."""
        return self._refusals.total

    @property
    def recent_refusals(self) -> tuple[str, ...]:
        """The last few refusals, oldest first: ``"host:port: why"``."""
        return tuple(self._refusals.recent)

    @property
    def stats(self) -> IngestStats:
        """What was taken in so far."""
        return self._intake.stats(self._refusals.total)

    async def wait_all_done(self) -> None:
        """Wait until every producer of ``expected_producers`` has sent Done (or was refused for
        good: :attr:`producers_refused`).

        Raises:
            ConfigurationError: the receiver has no ``expected_producers``.
            StreamingError: the receiver failed (its sink's put raised).
        """
        if self._expected is None:
            msg = "wait_all_done() needs SampleReceiver(expected_producers=...)"
            raise ConfigurationError(msg)
        with self._sup.waiting():
            await self._all_done_or_failed.wait()
        self._sup.raise_failure()

    # -- life --

    async def __aenter__(self) -> SampleReceiver:
        if self._address is not None:
            msg = "a SampleReceiver can be entered only once"
            raise StreamingError(msg)
        await self._sup.enter()
        try:
            self._address = await self._sup.tg.start(self._serve)
        except OSError as exc:
            self._sup.leave_body(None)
            await self._sup.close(None, swallowed=False)
            msg = f"the sample receiver cannot listen on {self._host}:{self._port}: {exc}"
            raise StreamingError(msg) from exc
        logger.info("sample receiver listening on %s:%d", *self._address)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        remaining = self._sup.leave_body(exc)
        self._refusals.flush()
        return await self._sup.close(remaining, swallowed=exc is not None and remaining is None)

    def _wake_up(self) -> None:
        self._all_done_or_failed.set()

    def _check_all_done(self) -> None:
        intake = self._intake
        if self._expected is not None and self._expected <= intake.done | intake.refused.keys():
            self._all_done_or_failed.set()

    # -- serving --

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


def _check_name(where: str, name: object) -> str:
    reason = check_producer_name(name)
    if reason is not None:
        msg = f"{where}: {reason}"
        raise ConfigurationError(msg)
    assert isinstance(name, str)
    return name
