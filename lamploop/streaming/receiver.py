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

import logging
import ssl
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType

import anyio
import anyio.abc

from lamploop.checks import check_mapping
from lamploop.errors import (
    ConfigurationError,
    StreamingError,
)
from lamploop.streaming.buffer_core import StreamBuffer
from lamploop.streaming.directory import ProducerDirectory
from lamploop.streaming.receiver_serving import RULES as RULES
from lamploop.streaming.receiver_serving import ReceiverServing, _Active
from lamploop.streaming.receiver_session import IngestStats, Intake
from lamploop.streaming.receiver_thread import ServingThread
from lamploop.streaming.sample import SampleSink
from lamploop.streaming.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_SEQ,
    PREAUTH_FRAME_BYTES,
)
from lamploop.streaming.wire_messages import checked_producer_name, checked_producer_names
from lamploop.transport import tls
from lamploop.transport.proofs import check_token
from lamploop.transport.settings import check_int_in, check_seconds_each
from lamploop.transport.strangers import PendingHandshakes, RefusalLog
from lamploop.transport.supervisor import Supervisor

__all__ = ["IngestStats", "SampleReceiver"]

logger = logging.getLogger("lamploop.streaming")

_RECENT_REFUSALS = 16


class SampleReceiver(ReceiverServing):
    """Takes samples from producers over TCP into ``sink``; an async context manager.

    ``async with SampleReceiver(sink, token=...) as receiver:`` listens on ``host:port``
    (``port=0`` picks a free port: read :attr:`address`) and serves producers until the block
    ends.  If the sink's ``put`` raises, the receiver fails: the block's body is cancelled
    and leaving it raises :class:`~lamploop.errors.StreamingError` (from the sink's error),
    with the receiver on its own thread or not.  A cancelled ``put`` must not have taken the
    sample (anyio's memory streams behave so): it is not acknowledged, and will be resent.

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
        own_thread: serve the producers on a thread of the receiver's own, with its own event
            loop (started by ``async with``, joined on leaving it): receiving, decoding, putting
            and acknowledging then take no time from the thread that trains, which only draws
            from the buffer.  ``sink`` must be a :class:`~lamploop.streaming.buffers.StreamBuffer`
            (its puts and reads may come from two threads); its ``on_evict`` then runs on the
            receiver's thread.  Default ``False``: everything on the caller's event loop.

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
        own_thread: bool = False,
    ) -> None:
        """Check every argument (the class's Args) and set up what the connections share.

        Nothing is opened here: the listening socket and the supervisor's tasks start in
        ``__aenter__``.  The restored ``acknowledged`` and ``producers_done`` seed the
        :class:`~lamploop.streaming.receiver_session.Intake`; the directory's assignments
        seed the :class:`~lamploop.streaming.directory.ProducerDirectory`.

        Raises:
            ConfigurationError: an argument is out of range or of the wrong type.
        """
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
        for name, seq in check_mapping("acknowledged", acknowledged or {}).items():
            checked_producer_name("acknowledged", name)
            check_int_in(f"acknowledged[{name!r}]", seq, -1, MAX_SEQ)
            acked[name] = seq
        done = set(checked_producer_names("producers_done", producers_done))
        self._expected = (
            None
            if expected_producers is None
            else frozenset(checked_producer_names("expected_producers", expected_producers))
        )
        self._allowed = (
            None
            if allowed_producers is None
            else frozenset(checked_producer_names("allowed_producers", allowed_producers))
        )
        if not isinstance(uniform_samples, bool):
            msg = f"uniform_samples must be a bool, got {type(uniform_samples).__name__}"
            raise ConfigurationError(msg)
        if not isinstance(own_thread, bool):
            msg = f"own_thread must be a bool, got {type(own_thread).__name__}"
            raise ConfigurationError(msg)
        if own_thread and not isinstance(sink, StreamBuffer):
            msg = (
                "own_thread=True needs a StreamBuffer sink (puts from the receiver's thread, reads from "
                f"the trainer's), got {type(sink).__name__}"
            )
            raise ConfigurationError(msg)
        self._own_thread = own_thread
        self._left = False  # the owner's block has ended: nothing is served any more
        self._thread: ServingThread | None = None
        self._body: anyio.CancelScope | None = None  # the owner's block, with own_thread
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
        if self._thread is not None:  # the handshakes wait for it on the receiver's thread
            self._thread.call_soon(self._directory_set.set)
        else:
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
            StreamingError: the receiver failed (its sink's put raised), or it is not listening
                (called before its ``async with`` block or after it).
        """
        if self._expected is None:
            msg = "wait_all_done() needs SampleReceiver(expected_producers=...)"
            raise ConfigurationError(msg)
        if self._address is None or self._left:  # no producer could ever be served: no wait
            when = "any more: its block has ended" if self._left else "yet"
            msg = (
                f"wait_all_done(): the receiver is not listening {when}; call it inside "
                "`async with SampleReceiver(...) as receiver`"
            )
            raise StreamingError(msg)
        with self._sup.waiting():
            await self._all_done_or_failed.wait()
        self._sup.raise_failure()

    # -- life --

    async def __aenter__(self) -> SampleReceiver:
        if self._address is not None or self._thread is not None:
            msg = "a SampleReceiver can be entered only once"
            raise StreamingError(msg)
        if self._own_thread:
            return await self._enter_thread()
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
        self._left = True
        if self._thread is not None:
            return await self._exit_thread(exc)
        remaining = self._sup.leave_body(exc)
        self._refusals.flush()
        return await self._sup.close(remaining, swallowed=exc is not None and remaining is None)

    async def _enter_thread(self) -> SampleReceiver:
        """``own_thread``: start the serving thread, then the owner's block (a scope it may cancel)."""
        self._thread = ServingThread(self._sup, self._serve, self._thread_ended)
        try:
            self._address = await self._thread.start(f"lamploop-receiver-{id(self):x}")
        except OSError as exc:
            msg = f"the sample receiver cannot listen on {self._host}:{self._port}: {exc}"
            raise StreamingError(msg) from exc
        self._body = anyio.CancelScope()
        self._body.__enter__()
        logger.info("sample receiver listening on %s:%d (on a thread of its own)", *self._address)
        return self

    async def _exit_thread(self, exc: BaseException | None) -> bool:
        """``own_thread``: leave the owner's block, stop and join the thread, raise its failure."""
        assert self._thread is not None
        assert self._body is not None
        swallowed = bool(
            self._body.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
        )
        error = await self._thread.stop()
        self._refusals.flush()
        remaining = None if swallowed else exc
        if error is not None and error is not remaining:
            if remaining is None:
                raise error
            logger.warning("sample receiver: leaving on %r; its thread had failed too: %s", remaining, error)
        return swallowed

    def _thread_ended(self) -> None:
        """``own_thread``, on the owner's loop: the thread's tasks ended by themselves (a failure)."""
        if self._sup._waiting == 0 and self._body is not None:  # else wait_all_done raises it
            self._body.cancel()

    def _set_on_owner(self, event: anyio.Event) -> None:
        if self._thread is not None:  # the owner awaits it on its own loop
            self._thread.call_soon_owner(event.set)
        else:
            event.set()

    def _wake_up(self) -> None:
        self._set_on_owner(self._all_done_or_failed)

    def _check_all_done(self) -> None:
        intake = self._intake
        if self._expected is not None and self._expected <= intake.done | intake.refused.keys():
            self._set_on_owner(self._all_done_or_failed)
