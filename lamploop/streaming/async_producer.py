"""The asynchronous producer: numbered samples to a trainer's receiver, resent until acknowledged.

:class:`AsyncProducer` keeps the samples it is given in its :class:`~lamploop.streaming.outbox.Outbox`
(numbering and resend window, without I/O) and holds the caller back while the window is
full; in the background it connects (with backoff, following a receiver's redirect), runs the
producer's side of the transport's handshake (:mod:`lamploop.transport.handshake`), and
sends and resends on each connection.  :mod:`lamploop.streaming.producer` describes the
producers as a whole.

.. versionadded:: 0.3
   split from :mod:`lamploop.streaming.producer`.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import attrs
import torch

from lamploop.errors import (
    ConfigurationError,
    StreamingError,
    TransportError,
)
from lamploop.streaming.outbox import (
    DEFAULT_WINDOW_BYTES,
    DEFAULT_WINDOW_FLOOR,
    DEFAULT_WINDOW_SAMPLES,
    Outbox,
)
from lamploop.streaming.producer_connection import ProducerConnectionLoop, _Signal
from lamploop.streaming.tensor_bytes import check_samples
from lamploop.streaming.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_SEQ,
    PREAUTH_FRAME_BYTES,
    check_producer_name,
    encode_rows,
    encode_tensors,
)
from lamploop.transport import tls
from lamploop.transport.proofs import check_token
from lamploop.transport.settings import check_int_in, check_seconds_each
from lamploop.transport.supervisor import Supervisor

__all__ = ["HANDOVER_BYTES", "HANDOVER_SAMPLES", "AsyncProducer", "ProducerStats"]

logger = logging.getLogger("lamploop.streaming")

HANDOVER_SAMPLES = 64
HANDOVER_BYTES = 1024 * 1024
"""Samples are handed to the producer a chunk at a time: 64 samples or 1 MiB
(:meth:`AsyncProducer.send_many`, and a :class:`~lamploop.streaming.producer.BlockingProducer`'s
caller's thread)."""


@attrs.frozen
class ProducerStats:
    """What a producer did so far.

    Attributes:
        sent: sample frames sent for the first time.
        resent: sample frames sent again after a reconnection.
        skipped: samples not sent because the receiver already held them (a restarted producer).
        connections: connections made (the first, then one per reconnection).
    """

    sent: int
    resent: int
    skipped: int
    connections: int


class AsyncProducer(ProducerConnectionLoop):
    """Streams samples to a :class:`~lamploop.streaming.receiver.SampleReceiver`; an async context manager.

    ``async with AsyncProducer(receiver_address, name="sim-3", token=...) as producer:`` then
    ``await producer.send({"x": x, "y": y})`` for each sample and ``await producer.done()``
    at the end (leaving the block normally calls it too).  The connection is made in the
    background, and made again when it drops.  A failure that cannot be retried (a wrong
    token, a receiver that refuses this producer, one unreachable for ``reconnect_timeout``)
    is raised by the :meth:`send` or :meth:`done` that waits, or else cancels the block's
    body and is raised when it ends.

    Args:
        address: the receiver's ``(host, port)`` (:attr:`SampleReceiver.address`).
        name: this producer's name, unique among the run's producers (1 to 200 bytes).
        token: the secret shared with the receiver.
        resend_window: unacknowledged samples kept for resending; :meth:`send` waits while
            this many are unacknowledged (back-pressure: the receiver's sink is full).
            ``None`` (the default): up to 256 that hold at most 4 MiB together, and 64
            whatever their size (:data:`~lamploop.streaming.outbox.DEFAULT_WINDOW_SAMPLES`).
        keep_acknowledged: acknowledged samples also kept (the last ones), so that a receiver
            restored from a checkpoint older than its acknowledgements gets them again.
        start_seq: the first sample's seq: 0, or for a restarted producer the first seq not
            acknowledged before (0 works too: what the receiver holds is skipped).
        max_frame_bytes: the largest frame sent (a sample's tensors plus about 100 bytes).
        reconnect_timeout: seconds to keep trying to reach the receiver before failing.
        handshake_timeout: seconds the receiver may take to answer, once connected.
        ack_timeout: a connection on which sent samples wait this long without any
            acknowledgement is dropped and made again.
        ssl_context: TLS (a client context trusting the receiver's certificate); ``None``: no TLS.

    Raises:
        ConfigurationError: an argument is out of range.
    """

    def __init__(
        self,
        address: tuple[str, int],
        *,
        name: str,
        token: bytes | str,
        resend_window: int | None = None,
        keep_acknowledged: int = 0,
        start_seq: int = 0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        reconnect_timeout: float = 300.0,
        handshake_timeout: float = 10.0,
        ack_timeout: float = 300.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        reason = check_producer_name(name)
        if reason is not None:
            raise ConfigurationError(f"name: {reason}")
        if not (isinstance(address, tuple) and len(address) == 2 and isinstance(address[0], str)):
            msg = f"address must be a (host, port) tuple, got {address!r:.80}"
            raise ConfigurationError(msg)
        check_int_in("port", address[1], 1, 65535)
        self._token = check_token(token)
        if resend_window is not None:
            check_int_in("resend_window", resend_window, 1)
        check_int_in("keep_acknowledged", keep_acknowledged, 0)
        check_int_in("start_seq", start_seq, 0, MAX_SEQ)
        check_int_in("max_frame_bytes", max_frame_bytes, PREAUTH_FRAME_BYTES)
        check_seconds_each(
            reconnect_timeout=reconnect_timeout, handshake_timeout=handshake_timeout, ack_timeout=ack_timeout
        )
        self.name = name
        self._root = address  # the one address known; redirects lead elsewhere
        self._host, self._port = address  # where the next connection goes
        # The numbering and the resend window (no I/O): what is kept, sent, acknowledged.
        self._outbox = Outbox(
            name,
            window=DEFAULT_WINDOW_SAMPLES if resend_window is None else resend_window,
            window_bytes=DEFAULT_WINDOW_BYTES if resend_window is None else None,
            window_floor=DEFAULT_WINDOW_FLOOR if resend_window is None else None,
            keep_acknowledged=keep_acknowledged,
            start_seq=start_seq,
            max_frame_bytes=max_frame_bytes,
        )
        self._max_frame_bytes = max_frame_bytes
        self._reconnect_timeout = reconnect_timeout
        self._handshake_timeout = handshake_timeout
        self._ack_timeout = ack_timeout
        self._tls = tls.check_context("ssl_context", ssl_context, server_side=False)
        self._sup = Supervisor(on_failure=self._wake_up)
        self._changed = _Signal()
        self._send_lock = anyio.Lock(fast_acquire=True)
        self._queued = 0  # senders waiting for room in the window
        self._entered = self._closed = False
        self._done_requested = self._finished = False
        self._connections = 0
        self._writer_idle = False  # the writer waits for samples

    # -- what the owner reads --

    @property
    def next_seq(self) -> int:
        """The seq the next sample gets."""
        return self._outbox.next_seq

    @property
    def acknowledged_seq(self) -> int:
        """The highest seq the receiver holds with every one before it (as far as this producer knows)."""
        return self._outbox.acked

    @property
    def unacknowledged(self) -> int:
        """Samples kept until the receiver acknowledges them."""
        return self._outbox.unacknowledged

    @property
    def stats(self) -> ProducerStats:
        """What was sent so far."""
        box = self._outbox
        return ProducerStats(box.sent, box.resent, box.skipped, self._connections)

    @property
    def receiver_address(self) -> tuple[str, int]:
        """Where the producer connects now: the address it was given, or the one a redirect named."""
        return (self._host, self._port)

    # -- sending --

    async def send(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Queue one sample (its named tensors) for the receiver; its seq.

        Returns once the sample is kept for sending: waits while ``resend_window`` samples
        are unacknowledged.  The tensors are copied (encoded) before it returns.  It yields to
        other tasks (and can be cancelled, taking nothing) when it waits, and when a frame's
        worth of samples (256 KiB and 32 samples, or half of ``resend_window``) waits for
        the connection's writer while that writer is idle; the samples in between are kept
        without a task switch (while the writer sends, at most ``resend_window`` of them).

        Raises:
            TypeError, ValueError: ``tensors`` is not a non-empty mapping of str to tensors.
            FrameError: the sample's frame would be over ``max_frame_bytes``.
            StreamingError: the producer failed (see the class), is done, or is not entered.
        """
        return await self._submit(encode_tensors(tensors))

    async def _submit(self, payload: bytes, expected_seq: int | None = None) -> int:
        """Keep ``payload`` as the next seq's sample once the window has room; the seq."""
        self._check_open("send()")
        # Kept without switching tasks, so that samples sent in a row leave in one frame when
        # the caller next waits; but once a frame's worth (or half the window) waits for an idle
        # writer, the writer gets its turn first, so that the receiver takes a batch while the
        # caller makes the next one, instead of both waiting in turn for a full window.  Only
        # then is send() a checkpoint (a cancellation point): anyio's checkpoints cost more than
        # the rest of a send (and while the writer sends, yielding to it would gain nothing).
        size = len(payload)
        if self._queued == 0 and self._outbox.has_room(size) and self._writer_due():
            await anyio.lowlevel.checkpoint()  # cancelled here, the sample is not taken
            self._check_open("send()")
        if self._queued == 0 and self._outbox.has_room(size):
            return self._keep(payload, expected_seq)
        self._queued += 1  # no sender overtakes this one by the path above
        try:
            async with self._send_lock:
                with self._sup.waiting():
                    while not self._outbox.has_room(size):
                        self._sup.raise_failure()
                        await self._changed.wait()
                self._check_open("send()")
                return self._keep(payload, expected_seq)
        finally:
            self._queued -= 1

    async def send_many(self, samples: Iterable[Mapping[str, torch.Tensor]]) -> list[int]:
        """:meth:`send` each of ``samples`` (each a mapping of names to tensors), in order; their seqs.

        The same as a loop of :meth:`send` (the same waits and errors), with fewer task switches:
        the samples are encoded and kept a chunk at a time (64 samples or 1 MiB).  Cancelled or
        failing part of the way, it has kept the samples before the one it stopped at
        (:attr:`next_seq` tells how many).
        """
        check_samples(samples)
        return await self._submit_all(encode_tensors(tensors) for tensors in samples)

    async def send_rows(self, columns: Mapping[str, torch.Tensor]) -> list[int]:
        """:meth:`send` each row of ``columns`` as a sample, in order; their seqs.

        Row ``i`` is the sample ``{name: column[i] for name, column in columns.items()}``: a
        simulation that makes its samples a batch at a time hands the batch over as it is.  The
        receiver gets the same samples as from :meth:`send_many` of the rows, bitwise; the
        checks and the encoding's fixed costs are paid once for all rows
        (:func:`~lamploop.streaming.tensor_bytes.encode_rows`), and every row is encoded
        (copied) before the first is kept.  Then the waits of :meth:`send_many`: cancelled or
        failing part of the way, it has kept the rows before the one it stopped at.

        Raises:
            TypeError, ValueError: ``columns`` is not a non-empty mapping of str to tensors with
                one number of rows (their first dimension); nothing is kept.
            FrameError: a row's frame would be over ``max_frame_bytes``; nothing is kept.
            StreamingError: the producer failed (see the class), is done, or is not entered.

        .. versionadded:: 0.3
        """
        self._check_open("send()")
        payloads = encode_rows(columns)
        if payloads:  # the rows are alike: the last seq's frame header is the longest
            self._outbox.check_size(self._outbox.next_seq + len(payloads) - 1, payloads[0])
        return await self._submit_all(payloads)

    async def _submit_all(self, payloads: Iterable[bytes]) -> list[int]:
        """Keep each of ``payloads`` (encoded samples) as the next seq, in order, a chunk at a
        time (:meth:`_submit_many`); their seqs.  What an iterable that raises, or a payload whose
        frame is too large, stopped at: the payloads before it are kept, then the error raised."""
        seqs: list[int] = []
        chunk: list[bytes] = []  # encoded, not handed to _submit_many yet
        size = 0
        try:
            for payload in payloads:
                self._check_open("send()")
                self._outbox.check_size(self._outbox.next_seq, payload)
                chunk.append(payload)
                size += len(payload)
                if len(chunk) >= HANDOVER_SAMPLES or size >= HANDOVER_BYTES:
                    handed, chunk, size = chunk, [], 0
                    first = await self._submit_many(handed)
                    seqs.extend(range(first, first + len(handed)))
        except Exception:
            # A sample that cannot be sent (or the iterable failing) ends the call; the samples
            # before it are kept, as the docstring says (a cancellation keeps nothing more).
            if chunk and self._sup.failure is None:
                await self._submit_many(chunk)
            raise
        if chunk:
            first = await self._submit_many(chunk)
            seqs.extend(range(first, first + len(chunk)))
        return seqs

    async def _submit_many(
        self,
        payloads: Sequence[bytes],
        first_seq: int | None = None,
        on_kept: Callable[[int], None] | None = None,
    ) -> int:
        """Keep ``payloads`` (their sizes checked: :meth:`Outbox.check_size`) as the next seqs, in order,
        each once the window has room; the first one's seq.

        What fits is kept at once, without switching tasks (but an idle writer gets its turn once
        a frame's worth waits); ``on_kept(n)`` is told after each run of ``n`` kept.  Cancelled
        while waiting, the samples not kept yet are not taken.
        """
        self._check_open("send()")
        index = 0
        self._queued += 1  # no sender overtakes these by _submit's path
        try:
            async with self._send_lock:
                box = self._outbox
                first = box.next_seq
                while index < len(payloads):
                    if not box.has_room(len(payloads[index])):
                        with self._sup.waiting():
                            while not box.has_room(len(payloads[index])):
                                self._sup.raise_failure()
                                await self._changed.wait()
                        self._check_open("send()")
                    expected = None if first_seq is None else first_seq + index
                    if box.next_seq <= box.acked:  # held by the receiver already: one by one
                        box.keep(payloads[index], expected)
                        stop = index + 1
                    else:
                        stop = index + box.fitting(payloads[index:])
                        box.keep_run(payloads[index:stop], expected)
                    self._changed.notify()
                    if on_kept is not None:
                        on_kept(stop - index)
                    index = stop
                    if self._writer_due():
                        await anyio.lowlevel.checkpoint()  # the writer takes a frame
                        self._check_open("send()")
        finally:
            self._queued -= 1
        return first

    def _writer_due(self) -> bool:
        """Whether the writer waits for samples and a frame's worth waits for it (while it sends,
        or with no connection, a sender's yielding would only cost a loop iteration per sample)."""
        return self._writer_idle and self._outbox.frame_due()

    def _keep(self, payload: bytes, expected_seq: int | None) -> int:
        """Number the sample and keep it for the writer (:meth:`Outbox.keep`), and wake the writer."""
        seq = self._outbox.keep(payload, expected_seq)
        self._changed.notify()
        return seq

    async def done(self) -> None:
        """Send Done once every sample is sent, and wait until the receiver acknowledged them all.

        Raises:
            StreamingError: the producer failed (see the class) or is not entered.
        """
        self._check_open("done()", after_done=True)
        self._done_requested = True
        self._changed.notify()
        with self._sup.waiting():
            while not self._finished:
                self._sup.raise_failure()
                await self._changed.wait()

    def _check_open(self, what: str, *, after_done: bool = False) -> None:
        self._sup.raise_failure()
        if not self._entered or self._closed:
            msg = f"producer {self.name!r}: {what} outside `async with`"
            raise StreamingError(msg)
        if self._done_requested and not after_done:
            msg = f"producer {self.name!r}: {what} after done()"
            raise StreamingError(msg)

    def _wake_up(self) -> None:
        self._changed.notify()

    # -- life --

    async def __aenter__(self) -> AsyncProducer:
        if self._entered:
            msg = f"producer {self.name!r} can be entered only once"
            raise StreamingError(msg)
        self._entered = True
        await self._sup.enter()
        self._sup.tg.start_soon(self._run)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        flushing: BaseException | None = None
        if exc is None and not self._done_requested and self._sup.failure is None:
            try:
                await self.done()  # leaving normally: deliver everything first
            except TransportError:
                pass  # the supervisor's failure: close() raises it
            except BaseException as error:  # cancelled while flushing
                flushing = error
        elif exc is not None and self.unacknowledged:
            logger.warning(
                "producer %r left with %d unacknowledged samples (from seq %d)",
                self.name,
                self.unacknowledged,
                self._outbox.acked + 1,
            )
        self._closed = True
        remaining = self._sup.leave_body(exc if flushing is None else flushing)
        result = await self._sup.close(remaining, swallowed=exc is not None and remaining is None)
        if flushing is not None:
            raise flushing
        return result
